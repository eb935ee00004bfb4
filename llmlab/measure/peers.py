"""The bench's peer: Hugging Face transformers `generate` on the SAME weights as the llmlab model.

`hf_peer_model` builds a transformers model that shares llmlab's weight tensors (no copy); `run_hf` runs a
workload with its `generate`, all requests as ONE left-padded batch with an attention mask (its normal way), eager
or with its static cache (which transformers compiles on a GPU); `run_hf_continuous` serves the requests with
transformers' own continuous batching (`generate_batch`, recent transformers); `torchao_peer_model` gives a copy of
the peer with torchao's weight-only int8 or int4 layers, the quantized peers of the `+int8` / `+int4` rungs. Greedy
decoding; EOS is ignored, so every request generates exactly its new tokens, as the llmlab rows do.
"""

from __future__ import annotations

import logging
import time

import torch

from llmlab.engine import LLM
from llmlab.measure.bench_metrics import Call, Run
from llmlab.measure.timing import StepTimer, sync


def hf_peer_model(llm: LLM):
    """A transformers `AutoModelForCausalLM` that SHARES llmlab's weight tensors (no copy, same device and dtype).

    Built from `llm.config.to_hf_config()`, then `load_state_dict(..., assign=True)` with llmlab's parameters
    (names: 'model.' + llmlab's, lm_head tied where the config says so). Raises ImportError without transformers,
    RuntimeError for a quantized model (no float weights to hand over) or if a weight would be left at its random
    initialisation.
    """
    import transformers

    from llmlab.measure.model_bytes import describe_weights
    from llmlab.quant import is_quantized

    if is_quantized(llm.model):  # its layers hold packed weights, no float `.weight` to hand over
        raise RuntimeError(f"the Hugging Face peers run a float model, and this one's weights are "
                           f"{describe_weights(llm.model, llm.dtype)}: bench the float checkpoint it came from, whose "
                           f"+int8 / +int4 rungs and torchao peers compare quantized runs")
    hf_cfg = llm.config.to_hf_config()
    cfg = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    with torch.device(llm.device):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=llm.dtype, attn_implementation="sdpa")
    wanted = set(hf.state_dict())
    ours = {("model." + k if k != "lm_head.weight" else k): v for k, v in llm.model.state_dict().items()}
    state = {k: v for k, v in ours.items() if k in wanted}
    missing = wanted - set(state)
    if llm.config.tie_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise RuntimeError(f"transformers model has weights llmlab does not: {sorted(missing)[:5]}")
    hf.load_state_dict(state, strict=False, assign=True)
    if llm.config.tie_embeddings:
        hf.tie_weights()
        if hf.lm_head.weight.data_ptr() != llm.model.embed_tokens.weight.data_ptr():
            hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.to(llm.device)  # the parameters are llmlab's already; this moves any buffer built elsewhere (RoPE tables)
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None  # never stop early: every request generates all its tokens
    return hf.eval()


class _StepClock:
    """Marks step boundaries from inside Hugging Face `generate` (a logits processor runs once per new token).

    CUDA events are recorded into the stream (no host synchronisation added); on a CPU the host clock is read.
    """

    def __init__(self, device: torch.device):
        self.timer = StepTimer(device)

    def __call__(self, input_ids, scores):
        self.timer.mark()
        return scores


def run_hf(hf, prompts: list[list[int]], new_tokens: int, static: bool, pad_id: int = 0) -> Run:
    """Run a workload with Hugging Face `generate`: all requests as ONE batch, left-padded with an attention mask.

    Greedy, exactly `new_tokens` new tokens (min_new_tokens = max_new_tokens). static=True adds
    `cache_implementation="static"` (transformers then compiles the forward pass on a GPU). Step times come from
    a logits processor that marks a CUDA event each time a token is chosen.
    """
    from transformers import LogitsProcessorList

    device = next(hf.parameters()).device
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    clock = _StepClock(device)
    extra = {"cache_implementation": "static"} if static else {}
    sync(device)
    clock.timer.start()
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, logits_processor=LogitsProcessorList([clock]), pad_token_id=pad_id,
                      **extra)
    step_ms = clock.timer.step_ms()
    tokens = out[:, T:].tolist()
    return Run([Call(list(range(len(prompts))), [len(p) for p in prompts], step_ms, tokens)])


def run_hf_continuous(hf, prompts: list[list[int]], new_tokens: int) -> Run:
    """Serve a workload with transformers' continuous batching (`hf.generate_batch`): every request at once.

    Greedy, EOS off, exactly `new_tokens` each. The manager (its paged cache and any CUDA graphs it captures) is
    kept between calls (`persistent_manager`, where this transformers has it), so a timed call after the bench's
    warm-up does not pay its set-up again; `close_hf_continuous` drops it. The run is one call whose one "step" is
    the whole serve (no per-token times: TPOT and MBU stay empty); each request's TTFT comes from the token
    timestamps where transformers records them (`record_timestamps`), else it is the whole call.

    Raises:
        AttributeError: a transformers without `generate_batch`.
    """
    import inspect

    from transformers import GenerationConfig

    device = next(hf.parameters()).device
    params = inspect.signature(hf.generate_batch).parameters
    extra = {k: True for k in ("record_timestamps", "persistent_manager") if k in params}
    if "progress_bar" in params:
        extra["progress_bar"] = False
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    # its logger warns, at every call, of the two things asked for on purpose: a kept manager, EOS off
    cb_log = logging.getLogger("ContinuousBatchingLogger")
    level = cb_log.level
    cb_log.setLevel(max(level, logging.ERROR))
    try:
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate_batch([list(p) for p in prompts], generation_config=config, **extra)
        sync(device)
    finally:
        cb_log.setLevel(level)
    total_ms = 1e3 * (time.perf_counter() - t0)
    by_prompt = {}
    for o in out.values():  # request ids are the library's: match each output to its prompt
        by_prompt.setdefault(tuple(o.prompt_ids), []).append(o)
    outputs = [by_prompt[tuple(p)].pop(0) for p in prompts]
    ttft = []
    for o in outputs:
        first = (getattr(o, "timestamps", None) or [None])[0]
        ms = None if first is None else 1e3 * (first - t0)
        ttft.append(ms if ms is not None and 0 < ms <= total_ms else total_ms)
    tokens = [list(o.generated_tokens)[:new_tokens] for o in outputs]
    return Run([Call(list(range(len(prompts))), [len(p) for p in prompts], [total_ms], tokens, ttft)])


def close_hf_continuous(hf) -> None:
    """Drop the continuous-batching manager `run_hf_continuous` kept (its cache and graphs), if any."""
    destroy = getattr(hf, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()


TORCHAO_PEERS = {"torchao_int8": "int8", "torchao_int4": "int4"}  # bench row -> weights
PEER_NAMES = ("hf_eager", "hf_static", "hf_continuous", *TORCHAO_PEERS)  # every peer row a bench can run


def select_peers(peers) -> frozenset | None:
    """Which peer rows to run: None for all of them (True, or "all" in the names), an empty set for none (False or
    None), else the names given (a comma-separated string or an iterable of `PEER_NAMES`, spaces, case and empty
    items ignored). A named row still runs only where its workload and rungs call for it (`peers_that_run`).

    Raises:
        TypeError: peers that is neither a bool, None, a string nor an iterable of strings.
        ValueError: a name that is not a peer row, or a string that names none (the message lists them).
    """
    if peers is True:
        return None
    if peers is False or peers is None:
        return frozenset()
    items = peers.split(",") if isinstance(peers, str) else peers
    try:
        names = [n.strip().lower() for n in items if n.strip()]
    except (TypeError, AttributeError):
        raise TypeError(f"peers={peers!r}: give True (all), False (none), or peer names (a comma-separated string "
                        f"or a list)") from None
    known = ", ".join(PEER_NAMES)
    if not names:
        raise ValueError(f"peers={peers!r} names no peer; give 'all' or some of {known}")
    unknown = [n for n in names if n != "all" and n not in PEER_NAMES]
    if unknown:
        raise ValueError(f"peers: unknown peer(s) {unknown}; give 'all' or some of {known}")
    return None if "all" in names else frozenset(names)


def peers_that_run(wanted: frozenset | None, n_requests: int, weights: set) -> list[str]:
    """The peer rows a bench run makes, in order: Hugging Face generate eager and static, its continuous batching
    (a workload of several requests), torchao's int8 / int4 (beside a rung with those weights: `weights`, the
    runnable rungs' formats); only those in `wanted` (None: all)."""
    names = ["hf_eager", "hf_static"] + (["hf_continuous"] if n_requests > 1 else [])
    names += [name for name, w in TORCHAO_PEERS.items() if w in weights]
    return [n for n in names if wanted is None or n in wanted]


def why_not_run(name: str, n_requests: int) -> str:
    """Why a peer row that was asked for does not apply to this run (see `peers_that_run`)."""
    if name == "hf_continuous":
        return f"continuous batching needs a workload of several requests; this one has {n_requests}"
    weights = TORCHAO_PEERS[name]
    return f"torchao's {weights} layers run beside the +{weights} rung, which this run does not have"


def torchao_peer_model(hf, weights: str):
    """A COPY of the Hugging Face peer whose decoder layers carry torchao's weight-only quantization: "int8" (one
    scale per output channel) or "int4" (groups of 128, as the `+int4` rung). lm_head stays in the peer's dtype, as
    llmlab's rungs keep it; the llmlab weights the peer shares are not touched (the copy owns its tensors).

    Returns (model, how): how names the torchao config used. Raises ImportError without torchao, ValueError for
    another `weights`; torchao's own errors (e.g. an int4 layout its kernels do not support here) pass through.
    """
    import copy

    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    if weights not in ("int8", "int4"):
        raise ValueError(f"weights={weights!r}: give 'int8' or 'int4'")
    q = copy.deepcopy(hf)
    if weights == "int8":
        config, how = Int8WeightOnlyConfig(), "Int8WeightOnlyConfig()"
    else:
        try:  # the tinygemm layout: torchao's fast int4 path for small batches on a CUDA GPU
            config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
            how = "Int4WeightOnlyConfig(group_size=128, int4_packing_format='tile_packed_to_4d')"
        except (TypeError, ValueError):  # an older or newer torchao without that argument or value
            config, how = Int4WeightOnlyConfig(group_size=128), "Int4WeightOnlyConfig(group_size=128)"
    quantize_(q.model, config)  # the decoder layers only: lm_head is q.lm_head, outside q.model
    return q.eval(), how


def torchao_version() -> str:
    """torchao's version, "?" where it is not installed."""
    try:
        import torchao

        return torchao.__version__
    except ImportError:
        return "?"


def transformers_version() -> str:
    """transformers' version, "?" where it is not installed."""
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "?"
