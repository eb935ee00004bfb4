"""No batching, the baseline: prompts served alone (batch 1), one after the other, as one `Generation`.

What `LLM.generate(prompts, batching="one_at_a_time")` runs and the bench's `+one_at_a_time` rung measures: a server
without a batcher, every request arriving at once, each one waiting for the ones before it. The batching rungs
(`llmlab.batching.static`, `llmlab.batching.continuous`) are measured against it.
"""

from __future__ import annotations

from llmlab.generate import Generation

__all__ = ["one_at_a_time"]


def one_at_a_time(results: list[Generation]) -> Generation:
    """One `Generation` for calls made one after the other, each of one prompt (`LLM.generate(...,
    batching="one_at_a_time")`): rows in order, every call's step times in order, and in `.extra["requests"]` each
    request's TTFT in ms from the start of the first call (the calls before it included), its mean TPOT and its
    finish_reason. The run's finish_reason is one of `Generation`'s: "stopped" when on_token stopped a call, "eos"
    when every request stopped at EOS, else "length"."""
    first, requests, waited = results[0], [], 0.0
    for g in results:
        requests.append({"ttft_ms": waited + g.step_ms[0],
                         "tpot_ms": sum(g.step_ms[1:]) / (len(g.step_ms) - 1) if len(g.step_ms) > 1 else None,
                         "finish_reason": g.finish_reason})
        waited += sum(g.step_ms)
    reasons = {g.finish_reason for g in results}
    finish = "stopped" if "stopped" in reasons else "eos" if reasons == {"eos"} else "length"
    return Generation(token_ids=[row for g in results for row in g.token_ids], prompt_len=first.prompt_len,
                      step_ms=[ms for g in results for ms in g.step_ms], finish_reason=finish,
                      use_cache=first.use_cache,
                      device=first.device, dtype=first.dtype,
                      texts=[t for g in results for t in g.texts] if first.texts is not None else None,
                      text=first.text, extra={"requests": requests})
