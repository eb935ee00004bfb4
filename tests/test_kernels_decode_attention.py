"""Triton flash-decoding GQA attention against SDPA over repeat_kv'd K/V (llmlab.model.repeat_kv).

CPU: Triton's interpreter in fp32 (TRITON_INTERPRET=1 from conftest.py), small head counts to keep it quick;
fp16/bf16 run on a GPU only.
"""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

import triton  # noqa: E402

from llmlab.kernels import attention_splits, lse_merge  # noqa: E402
from llmlab.kernels import decode_attention as da  # noqa: E402
from llmlab.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]


def _qkv(B, H, Hkv, S, hd, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, hd, generator=g).to(DEV, dtype)
    k = torch.randn(B, Hkv, S, hd, generator=g).to(DEV, dtype)
    v = torch.randn(B, Hkv, S, hd, generator=g).to(DEV, dtype)
    return q, k, v


@pytest.mark.parametrize("S", [1, 7, 17, 999, 1001, 4095])
def test_matches_sdpa_over_context_lengths(S):
    q, k, v = _qkv(1, 4, 2, S, 16, seed=S)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=3), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("H,Hkv,hd", [(4, 4, 16), (6, 2, 24), (8, 1, 64)])
def test_gqa_ratios_head_dims_and_per_sequence_lengths(H, Hkv, hd, dtype):
    q, k, v = _qkv(3, H, Hkv, 130, hd, dtype, seed=H * hd)
    seq_lens = torch.tensor([130, 1, 77], device=DEV)
    out = decode_attention(q, k, v, seq_lens=seq_lens, num_splits=4)
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, seq_lens), **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_split_count_does_not_change_the_answer(splits):
    q, k, v = _qkv(2, 2, 1, 300, 16, seed=splits)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=splits), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])


def test_cache_positions_past_seq_len_never_leak():
    # the unwritten tail of the cache holds NaN/inf: with seq_lens it must weigh exactly nothing
    q, k, v = _qkv(2, 4, 2, 200, 16)
    k[:, :, 150:], v[:, :, 150:] = float("nan"), float("inf")
    lens = torch.tensor([150, 3], device=DEV)
    out = decode_attention(q, k, v, seq_lens=lens, num_splits=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, lens), **TOL[torch.float32])


def test_strided_cache_views_and_4d_query():
    # KVCache.update returns k[:B, :, :end] views of a (max_batch, Hkv, max_seq, hd) buffer
    q, kbuf, vbuf = _qkv(3, 4, 2, 64, 16)
    k, v = kbuf[:2, :, :40], vbuf[:2, :, :40]
    q4 = q[:2, :, None]  # (B, H, 1, hd) as the model's decode step
    out = decode_attention(q4, k, v)
    assert out.shape == q4.shape
    torch.testing.assert_close(out[:, :, 0], decode_attention_reference(q[:2], k, v), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.gpu)])
def test_softmax_weights_sum_to_one_at_long_context(dtype):
    # with V = 1 everywhere the output is the sum of the softmax weights
    q, k, _ = _qkv(1, 2, 1, 2048, 16, dtype)
    q = q * 4  # peaky scores
    v = torch.ones_like(k)
    out = decode_attention(q, k, v, num_splits=4).float()
    assert torch.allclose(out, torch.ones_like(out), atol=1e-3)


def _count_merges(monkeypatch) -> list:
    """Record the split count of every merge launch (`_merge_into`), tuning's included; the split kernel's own
    merge (FUSE_MERGE) is switched off so that every merge is a launch to count."""
    monkeypatch.setattr(da, "FUSE_MERGE", False)
    calls = []
    real = da._merge_into

    def counting(o_part, lse, splits, out, *rest):
        calls.append(splits)
        real(o_part, lse, splits, out, *rest)
    monkeypatch.setattr(da, "_merge_into", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_split_writes_the_output_directly_without_a_merge(dtype, monkeypatch):
    # a cache no longer than one split (here the interpreter's one config, SPLIT_N = 64, also on a GPU), or
    # num_splits=1: the split kernel writes the final output in q's dtype, and no merge is launched
    monkeypatch.setattr(da, "_decode_split_tuned", da.autotuned_split_kernel([attention_splits.DEFAULT_CONFIG]))
    merges = _count_merges(monkeypatch)
    q, k, v = _qkv(3, 6, 2, 64, 24, dtype, seed=1)
    lens = torch.tensor([64, 1, 37], device=DEV)
    tol = TOL[dtype]
    for out, ref in ((decode_attention(q, k, v), decode_attention_reference(q, k, v)),
                     (decode_attention(q, k, v, seq_lens=lens), decode_attention_reference(q, k, v, lens)),
                     (decode_attention(q, k, v, num_splits=1), decode_attention_reference(q, k, v))):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert merges == []
    q, k, v = _qkv(1, 2, 1, 65, 16, dtype, seed=2)  # one key more: two splits, one merge
    torch.testing.assert_close(decode_attention(q, k, v).float(), decode_attention_reference(q, k, v).float(), **tol)
    assert merges == [2]


@pytest.mark.parametrize("num_splits", [2, 7, 9, 40])
def test_split_counts_whose_last_splits_are_empty(num_splits):
    # S = 300 shared out in whole 32-key tiles: 9 splits get 64 keys each (5 non-empty, 4 empty), 40 get 32 (10
    # non-empty, 30 empty); per-row lengths empty more of them
    q, k, v = _qkv(3, 4, 2, 300, 16, seed=num_splits)
    lens = torch.tensor([300, 33, 1], device=DEV)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=num_splits), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])
    torch.testing.assert_close(decode_attention(q, k, v, seq_lens=lens, num_splits=num_splits),
                               decode_attention_reference(q, k, v, lens), **TOL[torch.float32])


@pytest.mark.parametrize("config", attention_splits.SPLIT_CONFIGS,
                         ids=lambda c: "N{BLOCK_N}-S{SPLIT_N}".format(**c.kwargs) + f"-w{c.num_warps}-st{c.num_stages}")
def test_every_config_the_gpu_autotuner_may_choose(config):
    # run through the plain kernel with the config, as the GPU autotuner would pick it: S = 700 gives 11, 6, 3, 2
    # and 1 splits (the last: the direct-output path); the lengths leave trailing splits empty
    q, k, v = _qkv(3, 6, 2, 700, 24, seed=config.kwargs["SPLIT_N"] + config.kwargs["BLOCK_N"])
    lens = torch.tensor([700, 1, 333], device=DEV)
    scale = 24 ** -0.5
    torch.testing.assert_close(da._decode(q, k, v, None, scale, config=config), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])
    torch.testing.assert_close(da._decode(q, k, v, lens, scale, config=config),
                               decode_attention_reference(q, k, v, lens), **TOL[torch.float32])


def test_merge_over_many_splits_in_chunks():
    # hd = 128: the merge takes 64 splits at a time (MERGE_TILE); 200 splits = 4 chunks with a running max, empty
    # splits (lse = -inf) in several chunks, one chunk wholly empty, the largest lse in a late chunk
    g = torch.Generator().manual_seed(3)
    B, H, splits, hd = 2, 3, 200, 128
    o = torch.randn(B, H, splits, hd, generator=g)
    lse = torch.randn(B, H, splits, generator=g) * 3
    lse[:, :, 5:9] = lse[:, :, 64:128] = lse[:, :, 190:] = float("-inf")
    lse[0, 1, 150] = 30.0
    o, lse = o.to(DEV), lse.to(DEV)
    w = torch.softmax(lse, dim=-1)  # exp(lse_s) / sum_s exp(lse_s)
    expected = (w[..., None] * o).sum(dim=2)
    torch.testing.assert_close(da.merge_splits(o, lse, torch.float32), expected, **TOL[torch.float32])
    part = torch.empty(B, H, hd, device=DEV)  # the first 100 of them only (a scratch buffer larger than needed)
    da._merge_into(o, lse, 100, part)
    w = torch.softmax(lse[:, :, :100], dim=-1)
    torch.testing.assert_close(part, (w[..., None] * o[:, :, :100]).sum(dim=2), **TOL[torch.float32])


def test_candidate_configs_for_a_key():
    def lens_of(cs):
        return sorted({c.kwargs["SPLIT_N"] for c in cs})
    cands = attention_splits.candidate_split_configs
    # a chat-length cache: split lengths up to the first that covers it (one split, no merge), no longer
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 256, 8, False, 132)) == [64, 128, 256]
    # 8K at batch 1: every split length is worth timing
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 8192, 8, False, 132)) == [64, 128, 256, 512, 1024, 2048]
    # 32K: at most MAX_SPLITS splits
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 32768, 8, False, 132)) == [128, 256, 512, 1024, 2048]
    # a static cache (seq_lens): only split lengths that fill the GPU if the cache were full, or whose program
    # reads at most FULL_SPLIT_BYTES then (hd 128 in bf16: 512 bytes a key, so up to 512 keys)
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 4096, 8, True, 132, 512)) == [64, 128, 256, 512]
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 32768, 8, True, 132, 512)) == [128, 256, 512, 1024]
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 4096, 512, True, 132, 512)) == [1024, 2048]
    # a 1B model's chat cache (1024 slots, hd 64 in bf16: 256 bytes a key): one split is allowed
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 1024, 8, True, 132, 256)) == [64, 128, 256, 512, 1024]
    # nothing within the caps: the longest splits
    assert lens_of(cands(attention_splits.SPLIT_CONFIGS, 1 << 20, 512, False, 132)) == [2048]
    # one config (the interpreter): no pruning
    assert cands([attention_splits.DEFAULT_CONFIG], 8192, 8, True, 132) == [attention_splits.DEFAULT_CONFIG]
    # the fused merge: offered with 2..FUSED_MAX_SPLITS splits only (8K: split lengths 1024 and 2048)
    fused = [c for c in cands(attention_splits.SPLIT_CONFIGS, 8192, 8, False, 132) if c.kwargs["FUSED_MERGE"]]
    assert lens_of(fused) == [1024, 2048] and attention_splits.FUSED_MAX_SPLITS == 8
    assert not [c for c in cands(attention_splits.SPLIT_CONFIGS, 256, 8, False, 132)
                if c.kwargs["FUSED_MERGE"] and c.kwargs["SPLIT_N"] >= 256]  # one split: nothing to merge
    assert not [c for c in cands(attention_splits.SPLIT_CONFIGS, 8192, 8, True, 132, 256)
                if c.kwargs["FUSED_MERGE"]]  # lengths


def test_autotuner_config_of_each_calls_key_sets_the_merge(monkeypatch):
    # Two configs, tuned by a fake timer: the key of a 300-token cache picks SPLIT_N = 64 (5 splits), that of a
    # 600-token cache SPLIT_N = 128 (5 splits of 128, not 10 of 64). Calls alternate between the keys: each
    # merge must combine the split count of the config run for THAT call (the autotuner's best_config), and while
    # tuning, each timed config is followed by its merge (the post_hook).
    a = triton.Config({"BLOCK_N": 32, "SPLIT_N": 64, "FUSED_MERGE": False})
    b = triton.Config({"BLOCK_N": 64, "SPLIT_N": 128, "FUSED_MERGE": False})
    timings = []

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        t = timings.pop(0)
        return [t, t, t]
    tuner = da.autotuned_split_kernel([a, b], do_bench=fake_bench)
    monkeypatch.setattr(da, "_decode_split_tuned", tuner)
    monkeypatch.setattr(da, "num_sms", lambda device: 4)  # the same pruning on a GPU: both configs timed per key
    merges = _count_merges(monkeypatch)
    short, long = _qkv(1, 4, 2, 300, 16, seed=4), _qkv(1, 4, 2, 600, 16, seed=5)
    lens = torch.tensor([450], device=DEV)

    timings[:] = [1.0, 2.0]  # a wins
    torch.testing.assert_close(decode_attention(*short), decode_attention_reference(*short), **TOL[torch.float32])
    assert merges == [5, 3, 5]  # tuning a (5 splits), tuning b (3), then the call with a
    timings[:] = [2.0, 1.0]  # b wins
    torch.testing.assert_close(decode_attention(*long), decode_attention_reference(*long), **TOL[torch.float32])
    timings[:] = [1.0, 2.0]  # with lengths: another key, a wins
    torch.testing.assert_close(decode_attention(*long, seq_lens=lens), decode_attention_reference(*long, lens),
                               **TOL[torch.float32])
    merges.clear()
    for _ in range(2):  # tuned keys now: no timing, alternating configs
        torch.testing.assert_close(decode_attention(*short), decode_attention_reference(*short), **TOL[torch.float32])
        torch.testing.assert_close(decode_attention(*long), decode_attention_reference(*long), **TOL[torch.float32])
        torch.testing.assert_close(decode_attention(*long, seq_lens=lens), decode_attention_reference(*long, lens),
                                   **TOL[torch.float32])
    assert timings == [] and merges == [5, 5, 10] * 2
    assert sorted(c.kwargs["SPLIT_N"] for c in tuner.cache.values()) == [64, 64, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_replay_with_and_without_pdl(pdl, monkeypatch):
    # tuned in the warm-up call, then captured; replays read the new q/k/v and lengths. With PDL (sm_90+) the merge
    # is launched early and waits on the split kernel (griddepcontrol)
    monkeypatch.setattr(da, "USE_PDL", pdl)
    for S, lens in ((48, None), (3000, None), (3000, [3000, 17])):
        q, k, v = _qkv(2, 32, 8, S, 128, torch.bfloat16, seed=S)
        seq_lens = None if lens is None else torch.tensor(lens, device=DEV)
        decode_attention(q, k, v, seq_lens=seq_lens, check_lens=False)  # warm-up: tunes this key
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, seq_lens=seq_lens, check_lens=False)
        for seed in (1, 2):
            q2, k2, v2 = _qkv(2, 32, 8, S, 128, torch.bfloat16, seed=S + seed)
            q.copy_(q2), k.copy_(k2), v.copy_(v2)
            graph.replay()
            torch.testing.assert_close(out, decode_attention_reference(q, k, v, seq_lens), **TOL[torch.bfloat16])


def test_rejects_bad_inputs():
    q, k, v = _qkv(1, 3, 2, 8, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, k, v)
    q, k, v = _qkv(1, 4, 2, 8, 16)
    with pytest.raises(ValueError, match="one query token"):
        decode_attention(q[:, :, None].expand(1, 4, 2, 16), k, v)
    with pytest.raises(ValueError, match="seq_lens must lie in 1..8"):
        decode_attention(q, k, v, seq_lens=torch.tensor([9], device=DEV))
    with pytest.raises(ValueError, match="seq_lens must lie"):
        decode_attention(q, k, v, seq_lens=torch.tensor([0], device=DEV))
    with pytest.raises(TypeError, match="share one dtype"):
        decode_attention(q.double().half() if DEV == "cuda" else q, k.to(torch.float16), v)
    with pytest.raises(ValueError, match="empty"):
        decode_attention(q, k[:, :, :0], v[:, :, :0])


def test_a_key_with_lengths_is_tuned_on_a_full_cache_first(monkeypatch):
    """The first call with lengths for a key runs once with every row full (the worst case a CUDA graph replays),
    so the autotuner does not tune on a warm-up's 1-token rows; later calls of that key go straight through."""
    a = triton.Config({"BLOCK_N": 32, "SPLIT_N": 64, "FUSED_MERGE": False})
    b = triton.Config({"BLOCK_N": 32, "SPLIT_N": 128, "FUSED_MERGE": False})
    monkeypatch.setattr(da, "_decode_split_tuned", da.autotuned_split_kernel(
        [a, b], do_bench=lambda call, quantiles: (call(), [1.0] * 3)[1]))
    monkeypatch.setattr(da, "_TUNED_AT_CAPACITY", set())
    seen = []
    real = da._decode

    def spy(q, k, v, seq_lens, *args, **kw):
        seen.append(None if seq_lens is None else seq_lens.tolist())
        return real(q, k, v, seq_lens, *args, **kw)
    monkeypatch.setattr(da, "_decode", spy)
    q, k, v = _qkv(2, 4, 2, 300, 16, seed=6)
    lens = torch.tensor([1, 1], device=DEV)
    for _ in range(2):
        torch.testing.assert_close(decode_attention(q, k, v, seq_lens=lens),
                                   decode_attention_reference(q, k, v, lens), **TOL[torch.float32])
    assert seen == [[1, 1], [300, 300], [1, 1]]  # call, its tuning run on a full cache; the second call: none


@pytest.mark.parametrize("S, lens", [(300, [1, 37, 300]), (1000, [999, 64, 65])])
def test_with_lengths_each_rows_length_is_shared_over_the_splits(S, lens):
    """With lengths, split s of a row covers a share of ITS filled length (not of S): any split count, any row."""
    q, k, v = _qkv(3, 4, 2, S, 16, seed=S)
    seq_lens = torch.tensor(lens, device=DEV)
    want = decode_attention_reference(q, k, v, seq_lens)
    for splits in (1, 2, 5, 16):
        torch.testing.assert_close(decode_attention(q, k, v, seq_lens=seq_lens, num_splits=splits), want,
                                   **TOL[torch.float32])


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_num_splits_must_be_a_whole_number_from_one(bad):
    q, k, v = _qkv(1, 4, 2, 40, 16)
    with pytest.raises(ValueError, match="num_splits must be a whole number >= 1"):
        decode_attention(q, k, v, num_splits=bad)


def test_num_splits_as_a_numpy_integer_and_seq_lens_errors_say_what_was_passed():
    import numpy as np
    q, k, v = _qkv(2, 4, 2, 40, 16)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=np.int64(3)), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])
    with pytest.raises(TypeError, match=r"seq_lens must be a \(2,\) int tensor .* got list"):
        decode_attention(q, k, v, seq_lens=[3, 3])
    with pytest.raises(ValueError, match=r"got shape \(3,\) torch.int64"):
        decode_attention(q, k, v, seq_lens=torch.tensor([3, 3, 3], device=DEV))


# -- the fused merge: the last split of each (sequence, KV head) merges, no merge kernel -----------------------------

@pytest.mark.parametrize("num_splits", [2, 9, 40])  # 40 over hd 128, n_rep 4: five chunks of 8 splits
def test_fused_merge_equals_reference_and_resets_its_counters(num_splits, monkeypatch):
    assert da.FUSE_MERGE  # the default
    merges = []
    monkeypatch.setattr(da, "_merge_into", lambda *a: merges.append(a))  # must not be called
    q, k, v = _qkv(2, 8, 2, 300, 128, torch.float32, seed=num_splits)
    lens = torch.tensor([300, 45], device=DEV)  # row 1: most splits empty
    for _ in range(2):  # twice: the second launch finds the counters the first one left
        torch.testing.assert_close(decode_attention(q, k, v, num_splits=num_splits),
                                   decode_attention_reference(q, k, v), **TOL[torch.float32])
        torch.testing.assert_close(decode_attention(q, k, v, seq_lens=lens, num_splits=num_splits),
                                   decode_attention_reference(q, k, v, lens), **TOL[torch.float32])
    assert merges == []
    assert int(lse_merge.split_counters(q.device, 2 * 2).abs().sum()) == 0


def test_fused_and_kernel_merges_agree(monkeypatch):
    q, k, v = _qkv(1, 6, 2, 200, 32, torch.float32, seed=3)  # n_rep 3: a padded head in the fused merge's tile
    fused = decode_attention(q, k, v, num_splits=7)
    monkeypatch.setattr(da, "FUSE_MERGE", False)
    torch.testing.assert_close(fused, decode_attention(q, k, v, num_splits=7), atol=1e-5, rtol=1e-5)


def test_tuned_fused_merge_config_launches_no_merge(monkeypatch):
    # a fake timer makes the fused-merge config win: its calls launch no merge kernel and still equal SDPA
    a = triton.Config({"BLOCK_N": 32, "SPLIT_N": 64, "FUSED_MERGE": False})
    b = triton.Config({"BLOCK_N": 32, "SPLIT_N": 64, "FUSED_MERGE": True})
    timings = [2.0, 1.0]

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        t = timings.pop(0)
        return [t, t, t]
    monkeypatch.setattr(da, "_decode_split_tuned", da.autotuned_split_kernel([a, b], do_bench=fake_bench))
    monkeypatch.setattr(da, "num_sms", lambda device: 4)
    merges = _count_merges(monkeypatch)
    q, k, v = _qkv(1, 4, 2, 300, 16, seed=6)  # 5 splits
    torch.testing.assert_close(decode_attention(q, k, v), decode_attention_reference(q, k, v), **TOL[torch.float32])
    assert merges == [5]  # only while tuning config a (the post_hook); b merges inside the kernel
    merges.clear()
    torch.testing.assert_close(decode_attention(q, k, v), decode_attention_reference(q, k, v), **TOL[torch.float32])
    assert merges == [] and timings == []


def test_a_launch_stopped_part_way_leaves_no_counts_behind(monkeypatch):
    # a launch that stops after some splits counted themselves (an interrupt in the interpreter) must not make the
    # next launch merge early
    q, k, v = _qkv(1, 4, 2, 200, 16, seed=8)
    counters = lse_merge.split_counters(q.device, 2)
    real = da._decode_split_kernel

    class Stop:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counters[1] += 3
                raise KeyboardInterrupt
            return launch
    monkeypatch.setattr(da, "_decode_split_kernel", Stop())
    with pytest.raises(KeyboardInterrupt):
        decode_attention(q, k, v, num_splits=4)
    assert int(counters.abs().sum()) == 0
    monkeypatch.setattr(da, "_decode_split_kernel", real)
    torch.testing.assert_close(decode_attention(q, k, v, num_splits=4), decode_attention_reference(q, k, v),
                               **TOL[torch.float32])


def test_strided_lengths_and_empty_dimensions():
    """seq_lens as a strided view means its values (the kernel reads it densely); zero heads or head_dim and
    bool lengths are refused with a message, not a ZeroDivisionError or a silent read."""
    q, k, v = _qkv(2, 4, 2, 20, 16)
    spread = torch.tensor([5, 0, 20, 0], device=DEV)
    for lens in (spread[::2], spread[::2].int()):
        torch.testing.assert_close(decode_attention(q, k, v, seq_lens=lens),
                                   decode_attention_reference(q, k, v, torch.tensor([5, 20])), **TOL[torch.float32])
    with pytest.raises(ValueError, match="must be >= 1"):
        decode_attention(q[:, :0], k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="must be >= 1"):
        decode_attention(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(ValueError, match="seq_lens must be a"):
        decode_attention(q, k, v, seq_lens=torch.tensor([True, True], device=DEV))


def test_trigger_next_changes_nothing_in_the_answer(monkeypatch):
    """trigger_next only lets the next kernel launch earlier (PDL, on a GPU that has it): same output, with and
    without lengths, with the merge kernel running (several splits, the split kernel's own merge off)."""
    monkeypatch.setattr(da, "FUSE_MERGE", False)
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 8, 64, device=DEV), torch.randn(2, 2, 300, 64, device=DEV), torch.randn(2, 2, 300, 64,
                                                                                                    device=DEV)
    lens = torch.tensor([300, 41], device=DEV)
    for seq_lens in (None, lens):
        ref = decode_attention_reference(q, k, v, seq_lens)
        for trigger in (False, True):
            out = decode_attention(q, k, v, seq_lens=seq_lens, num_splits=3, trigger_next=trigger)
            torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_trigger_next_must_be_a_bool_and_head_dim_one_takes_any_stride():
    q, k, v = torch.randn(1, 2, 1, device=DEV), torch.randn(1, 1, 1, 8, device=DEV), torch.randn(1, 1, 8, 1, device=DEV)
    with pytest.raises(TypeError, match="trigger_next must be True or False"):
        decode_attention(q, k.transpose(2, 3), v, trigger_next="no")
    kt = k.transpose(2, 3)  # (1, 1, 8, 1) with last-dimension stride 8: still one contiguous number per key
    torch.testing.assert_close(decode_attention(q, kt, v), decode_attention_reference(q, kt, v), **TOL[torch.float32])


_PREFETCH_CONFIGS = [attention_splits.DEFAULT_CONFIG,  # several splits, the merge kernel
                     next(c for c in attention_splits.SPLIT_CONFIGS
                          if c.kwargs["FUSED_MERGE"] and c.kwargs["SPLIT_N"] == 64),
                     attention_splits.SPLIT_CONFIGS[-1]]  # one split of up to 2048 keys: the first tile, then the loop


@pytest.mark.parametrize("config", _PREFETCH_CONFIGS,
                         ids=lambda c: "N{BLOCK_N}-S{SPLIT_N}-F{FUSED_MERGE:d}".format(**c.kwargs))
def test_prefetch_kv_equals_the_reference(config):
    """prefetch_kv: the first tile is read before the (PDL) wait and the newest slot again after; same answers at
    lengths whose newest key falls in a program's first tile, in a later tile, at the cache's end, and length 1."""
    q, k, v = _qkv(4, 6, 2, 300, 24, seed=config.kwargs["BLOCK_N"])
    lens = torch.tensor([300, 1, 33, 130], device=DEV)
    want = decode_attention_reference(q, k, v, lens)
    torch.testing.assert_close(da._decode(q, k, v, lens, 24 ** -0.5, config=config, prefetch_kv=True), want,
                               **TOL[torch.float32])
    torch.testing.assert_close(decode_attention(q, k, v, seq_lens=lens, prefetch_kv=True, num_splits=5), want,
                               **TOL[torch.float32])


@pytest.mark.skipif(not interpret_mode(), reason="simulates PDL by replacing gdc_wait, which only the interpreter "
                                                "looks up at run time")
@pytest.mark.parametrize("config", _PREFETCH_CONFIGS + [None],
                         ids=lambda c: "num_splits" if c is None else "N{BLOCK_N}-S{SPLIT_N}-F{FUSED_MERGE:d}".format(
                             **c.kwargs))
def test_prefetch_kv_rereads_the_newest_slot_after_the_wait(config, monkeypatch):
    """PDL simulated in the interpreter: at each program's start (`gdc_launch_dependents`) the newest slot of every
    row holds the OLD key/value (the kernel before has not written it yet); `gdc_wait` writes the new ones. A
    program that kept its prefetched copy of that slot would attend to the old values and differ from the
    reference over the final cache (checked: taking out the re-read of K or of V fails this test)."""
    B, H, Hkv, S, hd = 8, 6, 2, 300, 24
    q, k, v = _qkv(B, H, Hkv, S, hd, seed=7)
    lens_list = [300, 1, 33, 130, 64, 65, 256, 2]  # newest slot: first tile, only slot, later tiles, split edges
    lens = torch.tensor(lens_list, device=DEV)
    rows, slots = torch.arange(B), lens - 1
    g = torch.Generator().manual_seed(8)
    old_k, old_v = k[rows, :, slots].clone(), v[rows, :, slots].clone()  # (B, Hkv, hd)
    new_k, new_v = torch.randn(B, Hkv, hd, generator=g) * 3, torch.randn(B, Hkv, hd, generator=g) * 3

    def stale():
        k[rows, :, slots], v[rows, :, slots] = old_k, old_v

    def written():
        k[rows, :, slots], v[rows, :, slots] = new_k, new_v

    monkeypatch.setattr(triton.language.extra.cuda, "gdc_launch_dependents", lambda *a, **kw: stale())
    monkeypatch.setattr(triton.language.extra.cuda, "gdc_wait", lambda *a, **kw: written())
    monkeypatch.setattr(da, "_pdl_kwargs", lambda device: {"PDL": True})
    if config is None:
        out = da._decode(q, k, v, lens, hd ** -0.5, num_splits=5, prefetch_kv=True)
    else:
        out = da._decode(q, k, v, lens, hd ** -0.5, config=config, prefetch_kv=True)
    written()  # the cache as the kernel before left it
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, lens), **TOL[torch.float32])


def test_scale_must_be_a_number():
    q, k, v = _qkv(1, 4, 2, 8, 16)
    with pytest.raises(TypeError, match="scale must be a number"):
        decode_attention(q, k, v, scale="x")
    import numpy as np

    torch.testing.assert_close(decode_attention(q, k, v, scale=np.float32(0.25)),
                               decode_attention(q, k, v, scale=0.25), **TOL[torch.float32])


def test_prefetch_kv_needs_lengths_and_a_bool():
    q, k, v = _qkv(1, 4, 2, 8, 16)
    with pytest.raises(TypeError, match="prefetch_kv needs seq_lens"):
        decode_attention(q, k, v, prefetch_kv=True)
    with pytest.raises(TypeError, match="prefetch_kv must be True or False"):
        decode_attention(q, k, v, seq_lens=torch.tensor([8], device=DEV), prefetch_kv=1)


@pytest.mark.gpu
def test_prefetch_kv_reads_the_newest_slot_written_by_the_kernel_just_before():
    """On the GPU with PDL, as in the model's decode step: a CUDA graph of [the q/k/v GEMV, RoPE + the newest K/V
    slot written into the cache (rope_and_cache_, a PDL kernel), attention with prefetch_kv]; each replay writes new
    values there, and the attention must see them (it re-reads that slot after its wait)."""
    from llmlab.kernels.fused_gemv import fused_gemv
    from llmlab.kernels.rope_cache import rope_and_cache_

    H, Hkv, hd, S = 32, 8, 64, 1024
    g = torch.Generator().manual_seed(0)
    w = (torch.randn((H + 2 * Hkv) * hd, 2048, generator=g) * 0.02).to("cuda", torch.bfloat16)
    x = torch.randn(1, 2048, generator=g).to("cuda", torch.bfloat16)
    kc, vc = (torch.randn(1, Hkv, S, hd, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    inv_freq = (1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)).cuda()
    for newest in (0, 200, S - 1):  # the newest slot in the first tile of the first split, inside, the last
        pos = torch.tensor([newest], device="cuda")
        lens = pos + 1

        def step():
            qkv = fused_gemv(x, w).view(1, -1, hd)
            rope_and_cache_(qkv, None, None, pos, kc, vc, n_heads=H, inv_freq=inv_freq)
            return decode_attention(qkv[:, :H], kc, vc, seq_lens=lens, check_lens=False, prefetch_kv=True), qkv

        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, qkv = step()
        for seed in range(3):
            x.copy_(torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)).to(x))
            graph.replay()
            torch.testing.assert_close(out, decode_attention_reference(qkv[:, :H], kc, vc, lens),
                                       **TOL[torch.bfloat16])
