"""The one-launch greedy argmax (llmlab/kernels/argmax.py) against torch.argmax, and the decode step that uses it.

On a CPU the kernel runs in Triton's interpreter (fp32, fp16); bf16 and CUDA-graph replay are `gpu`-marked. The
rows are views into wider buffers whose extra columns hold a huge value, so a masked lane that read past V would
win the argmax and show.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels import argmax as am  # noqa: E402
from llmlab.kernels.argmax import argmax, argmax_reference  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 7, 17, 999, 1001, 4095, 128256]  # V: one chunk, one partial chunk, many chunks (Llama 3's vocabulary)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def _rows(B, V, dtype, seed=0):
    """(B, V) logits: a view of a (B, V + 29) buffer whose last 29 columns are 1e4 (what a leaking lane reads)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((B, V + 29), 1e4)
    buf[:, :V] = torch.randn(B, V, generator=g) * 3
    return buf.to(DEV, dtype)[:, :V]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", SIZES)
@pytest.mark.parametrize("B", [1, 3])
def test_equals_torch_argmax(B, V, dtype):
    x = _rows(B, V, dtype, seed=V + B)
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == (B,)
    assert torch.equal(got, argmax_reference(x))


def test_ties_go_to_the_lowest_index_within_and_across_chunks():
    x = torch.zeros(3, 5 * am.CHUNK, device=DEV)
    x[0, [3 * am.CHUNK + 5, 4 * am.CHUNK + 1]] = 7.0  # two chunks hold the max: the first chunk's wins
    x[1, [am.CHUNK + 9, am.CHUNK + 2]] = 7.0  # twice in one chunk: the lower position
    x[2] = float("-inf")  # every entry ties: position 0, as torch.argmax
    assert argmax(x).tolist() == [3 * am.CHUNK + 5, am.CHUNK + 2, 0]
    assert torch.equal(argmax(x), argmax_reference(x))


def test_nan_counts_as_the_maximum_as_in_torch():
    x = _rows(2, 3 * am.CHUNK, torch.float32)
    x[0, 2 * am.CHUNK + 11] = float("nan")
    x[1, 17] = float("nan")
    x[1, 2 * am.CHUNK] = float("nan")
    assert torch.equal(argmax(x), argmax_reference(x))
    assert argmax(x).tolist() == [2 * am.CHUNK + 11, 17]


def test_a_row_slice_of_a_sequence_of_logits_and_repeated_launches():
    """The decode step passes logits[:, -1] of (B, T, V); and each launch's last program must leave the counters
    at zero for the next launch with the same scratch (else the next one would reduce before its chunks are in)."""
    g = torch.Generator().manual_seed(4)
    for seed in range(3):
        y = torch.randn(2, 5, 3000, generator=g).to(DEV)
        assert torch.equal(argmax(y[:, -1]), y[:, -1].argmax(-1)), seed
    assert (y.device, 2, 4) in am._scratch_buffers  # 3 chunks of 1024 -> 4 partial slots per row
    _, _, counters = am._scratch(y.device, 2, 4)
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("bad, err, match", [
    (lambda: torch.zeros(10), ValueError, r"\(B, V\)"),
    (lambda: torch.zeros(2, 0), ValueError, "empty"),
    (lambda: torch.zeros(0, 5), ValueError, "empty"),
    (lambda: torch.zeros(8, 4).t(), ValueError, "contiguous"),
    (lambda: torch.zeros(2, 5, dtype=torch.int32), TypeError, "dtype"),
    (lambda: [[1.0, 2.0]], TypeError, "torch.Tensor"),
])
def test_bad_input_gets_a_named_error(bad, err, match):
    x = bad()
    if isinstance(x, torch.Tensor):
        x = x.to(DEV)
    with pytest.raises(err, match=match):
        argmax(x)
    ok = torch.randn(1, 50, device=DEV)  # usable after the error
    assert torch.equal(argmax(ok), ok.argmax(-1))


def test_a_vocabulary_beyond_one_launch_is_refused():
    x = torch.empty(1, am.MAX_V + 1, dtype=torch.float16, device=DEV)  # not filled: refused before any launch
    with pytest.raises(ValueError, match="torch.argmax"):
        argmax(x)


@pytest.mark.gpu
def test_rows_further_apart_than_2_to_the_31_elements():
    """A logits[:, -1] view of (B, T, V) logits puts rows T x V apart; the row offset must not wrap in int32."""
    stride = 2 ** 31 + 64
    buf = torch.full((stride + 300,), -1.0, dtype=torch.float16, device="cuda")  # 4 GB
    x = buf.as_strided((2, 300), (stride, 1))
    x[0, 17], x[1, 250] = 5.0, 7.0
    assert argmax(x).tolist() == [17, 250]


def test_new_scratch_during_a_graph_capture_is_refused(monkeypatch):
    """The check itself (on any machine): a new (device, rows, slots) key met while a CUDA stream is capturing."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        am._scratch(torch.device("cuda", 0), 7, 8)  # refused before anything is allocated
    assert (torch.device("cuda", 0), 7, 8) not in am._scratch_buffers


@pytest.mark.gpu
def test_a_first_call_during_graph_capture_is_refused_with_the_fix(monkeypatch):
    # an empty scratch table: the (3 rows, 8 partial slots) key is new even when an earlier test in this process
    # met it (the whole suite on an H200 did; the original table, restored after, keeps its buffers alive)
    monkeypatch.setattr(am, "_scratch_buffers", {})
    x = torch.randn(3, 5000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(graph):
            argmax(x)
    assert torch.equal(argmax(x), x.argmax(-1))  # warmed up: now it captures (and is usable eagerly)


@torch.no_grad()
def test_the_kernels_step_puts_it_in_the_decode_step_and_greedy_tokens_stay_the_same(monkeypatch):
    """Given the kernels' decode step (`KernelDecodeStep`, what the Triton kernels switch gives the LLM),
    `decode_step` picks tokens with this kernel (a spy counts the calls), and greedy decode on the static-cache
    runner equals the eager PyTorch decode token for token (fp32). Without it, the runner never calls it."""
    from llmlab.runtime.fast_generate import generate_fast
    from llmlab.generate import generate
    from llmlab.kernels import modules
    from llmlab.kernels.decode_step import KernelDecodeStep

    model = tiny_model(seed=5).to(DEV)
    prompts = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2)).tolist()
    ref = generate(model, prompts, max_new_tokens=20)
    calls = []
    real = modules.ops().argmax
    monkeypatch.setattr(modules.ops(), "argmax", lambda x: calls.append(x.shape) or real(x))
    mode = "graphs" if DEV == "cuda" else "static"
    modules.swap_in(model)
    try:
        got = generate_fast(model, prompts, max_new_tokens=20, mode=mode, kernels=KernelDecodeStep(model))
    finally:
        modules.swap_out(model)
    assert got.token_ids == ref.token_ids
    assert len(set(ref.token_ids[0])) >= 3  # not vacuous: the decode does not repeat one token
    V = model.config.vocab_size  # (with CUDA graphs the runner captures buckets 1 and 2)
    assert (2, V) in calls and all(s[1] == V for s in calls)
    calls.clear()
    assert generate_fast(model, prompts, max_new_tokens=4, mode=mode).n_generated == 4
    assert calls == []  # the model's own step: argmax_rows


@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_logits_each_time():
    x = torch.randn(1, 128256, device="cuda", dtype=torch.bfloat16)
    out = argmax(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(x)
    for seed in range(5):
        x.copy_(torch.randn(1, 128256, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        assert torch.equal(out, x.argmax(-1)), seed


def test_a_three_dimensional_input_says_to_take_the_last_position():
    with pytest.raises(ValueError, match=r"logits\[:, -1\]"):
        argmax(torch.randn(2, 3, 50, device=DEV))
