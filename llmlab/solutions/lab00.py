"""Lab 00 reference answers."""


def tokens_through_model(prompt_len: int, new_tokens: int, use_cache: bool) -> int:
    """Token positions that pass through the decoder to generate `new_tokens` tokens after a `prompt_len` prompt.

    With the KV cache: the prompt once (prefill), then one position per further token: prompt_len + new_tokens - 1.
    Without it: step i re-runs all prompt_len + i positions, for i = 0 .. new_tokens - 1.
    """
    if use_cache:
        return prompt_len + new_tokens - 1
    return sum(prompt_len + i for i in range(new_tokens))


def count_tokens_through_model(llm, prompt: str, new_tokens: int, use_cache: bool) -> int:
    """Measure the same number: count the token positions the embedding layer sees during one generate call."""
    seen = 0

    def hook(_module, args):
        nonlocal seen
        seen += args[0].numel()

    handle = llm.model.embed_tokens.register_forward_pre_hook(hook)
    try:
        llm.generate(prompt, max_new_tokens=new_tokens, use_cache=use_cache, stop_at_eos=False)
    finally:
        handle.remove()
    return seen
