"""Batching on a CUDA GPU (marked `gpu`, skipped on a CPU): the padded static batch on CUDA graphs and the Triton
kernels, and continuous batching with its graph-captured paged decode step, each request against its solo tokens.

At fp32 the math of a row does not depend on the rows beside it, so greedy tokens must match the solo run token for
token where both run the same kernels; where the batched path runs other kernels than the solo one (cuBLAS for
M > 1 against the batch-1 GEMV), the claim is agreement on at least 90% of the tokens, stated per test.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = (3, 17, 40, 9, 64)


@pytest.fixture(scope="module")
def llm():
    import llmlab

    return llmlab.load(device="cuda", dtype=torch.float32)


def prompts(llm, lengths=PROMPT_LENGTHS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, llm.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def solo(llm, ps, n, **kw):
    return [llm.generate([p], max_new_tokens=n, stop_at_eos=False, **kw).token_ids[0] for p in ps]


def agreement(a, b):
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_static_batch_on_cuda_graphs_equals_each_solo_run(llm):
    ps = prompts(llm)
    g = llm.generate(ps, max_new_tokens=24, stop_at_eos=False, cuda_graphs=True)
    assert g.token_ids == solo(llm, ps, 24)


def test_continuous_batching_eager_on_cuda_equals_each_solo_run(llm):
    ps = prompts(llm)
    g = llm.generate(ps, max_new_tokens=24, stop_at_eos=False, batching="continuous")
    assert g.token_ids == solo(llm, ps, 24)


def test_batching_rungs_on_top_of_the_ladder_agree_with_solo(llm):
    from llmlab.ladder import available_steps
    from llmlab.switches import apply_switches

    ps = prompts(llm)
    want = solo(llm, ps, 24)
    runnable, skipped = available_steps(llm, ["+one_at_a_time", "+static_batching", "+continuous_batching"])
    assert [r.name for r in runnable] == ["+one_at_a_time", "+static_batching", "+continuous_batching"], skipped
    for r in runnable:
        run_llm, kwargs = apply_switches(llm, r.settings)
        got = run_llm.generate(ps, max_new_tokens=24, stop_at_eos=False, **kwargs).token_ids
        assert agreement(got, want) >= 0.9, (r.name, got, want)
