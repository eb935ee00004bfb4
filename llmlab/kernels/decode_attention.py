"""Decode attention for grouped-query attention over a contiguous KV cache, flash-decoding style.

At decode time each sequence has ONE new query token per head, but thousands of cached keys. One program per
(sequence, head) would leave most of a GPU's SMs idle at batch 1, so the sequence is split across programs
(Dao et al., "Flash-Decoding for long-context inference", 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html):

    1. the split kernel (`split_attention.py`), grid (B * Hkv, splits): each program reads the K/V of one KV head
       for one slice of SPLIT_N keys, ONCE, for all n_rep query heads that share it (GQA, Ainslie et al. 2023,
       https://arxiv.org/abs/2305.13245), and writes a partial output normalized by its own softmax sum plus the
       log-sum-exp of its scores;
    2. the merge (`lse_merge.py`), grid (B * H,): rescales the partials by exp(lse_s - max lse) and sums them — or,
       for a config with FUSED_MERGE, the split kernel's last program of each (sequence, KV head) does that itself
       (`lse_merge.merge_last`: each split counts itself done on an atomic counter), and there is no second launch.

The split length SPLIT_N is autotuned with the tile (`attention_splits.py`: longer splits pipeline their loads
better, shorter ones make more programs), so the split count cdiv(S, SPLIT_N) is only known once the autotuner has
picked a config; the wrapper reads it back (`best_config`) to tell the merge. When one split covers the whole cache,
the split kernel writes the output itself and there is no merge: one launch.

This file is the op's host side: the PyTorch reference, the autotuned launch of the split kernel and the merge,
and the argument checks of `decode_attention`. Cache layout: (B, Hkv, S, hd), as `llmlab.cache.kv_cache.KVCache`
(any strides with a contiguous last dimension, so the cache's `[:B, :, :end]` views go in without a copy).
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
import triton

from ._util import (
    autotune_configs,
    check_flag,
    check_tensors,
    demo_needs_cuda,
    num_sms,
    pdl_kwargs,
    pdl_supported,
    tune_bench,
    zero_on_error,
)
from .attention_splits import (
    DEFAULT_CONFIG,
    NUM_SPLITS_CONFIG,
    SPLIT_CONFIGS,
    candidate_split_configs,
    kv_bytes_per_key,
)
from .lse_merge import FUSED_MERGE_TILE, merge_into, split_counters
from .split_attention import _decode_split_kernel

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over repeat_kv'd K/V, one sequence at a time (each attends to its first seq_lens[b] tokens).

    q: (B, H, hd); k, v: (B, Hkv, S, hd) -> (B, H, hd). Bytes: the kernel reads K and V once (2 x B x Hkv x S x hd x
    elem); eager PyTorch's repeat_kv first copies them n_rep times (write + read of H/Hkv times as many bytes).
    """
    from llmlab.model import repeat_kv

    B, H, hd = q.shape
    n_rep = H // k.shape[1]
    outs = []
    for b in range(B):
        S = k.shape[2] if seq_lens is None else int(seq_lens[b])
        kb, vb = repeat_kv(k[b:b + 1, :, :S], n_rep), repeat_kv(v[b:b + 1, :, :S], n_rep)  # (1, H, S, hd)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, None], kb, vb)[:, :, 0])
    return torch.cat(outs)  # (B, H, hd)


# Programmatic dependent launch (`pdl_enabled` in _util.py): the split kernel and the merge are launched with
# launch_pdl, so the GPU may start each while the kernel before it still runs — the split kernel allows it at its
# very start (`gdc_launch_dependents`) — and each program waits in `gdc_wait` until the previous kernel has finished
# and its writes are visible. The gaps between launches (a large part of so short an op) mostly go. None: follow
# LLMLAB_PDL (on where the GPU has it); True / False: force it (the tests).
USE_PDL = None
# Launches with an explicit num_splits or config (not tuned): the last split merges (True), or the merge kernel
# runs after the split kernel (False). The tuned kernel takes FUSED_MERGE from its config; the paged kernel always
# launches the merge kernel.
FUSE_MERGE = True


def _merge_into(o_part: torch.Tensor, lse: torch.Tensor, splits: int, out: torch.Tensor,
                trigger_next: bool = False) -> None:
    """`lse_merge.merge_into` with PDL as `USE_PDL` says: the partials' merge after a split kernel launch."""
    merge_into(o_part, lse, splits, out, trigger_next, _pdl_kwargs(out.device))


def merge_splits(o_part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Combine the splits' partial outputs (B, H, splits, hd) fp32 and log-sum-exps (B, H, splits) fp32 into the
    attention output (B, H, hd) in `dtype` (one launch). Shared with the paged kernel (`paged_decode_attention`)."""
    B, H, splits, hd = o_part.shape
    out = torch.empty(B, H, hd, dtype=dtype, device=o_part.device)
    _merge_into(o_part, lse, splits, out)
    return out


def _prune(configs, nargs, **kwargs) -> list:
    """The autotuner's early_config_prune: `candidate_split_configs` for this call's key."""
    return candidate_split_configs(configs, nargs["S_BUCKET"], nargs["BHKV_BUCKET"], kwargs["HAS_LENS"],
                                   num_sms(nargs["q_ptr"].device), kv_bytes_per_key(nargs["k_ptr"], nargs["HD"]))


def _merge_during_tuning(nargs: dict, exception) -> None:
    """The autotuner's post_hook, which Triton runs after each timed launch while it compares configs (not on
    ordinary calls): merge the partials too, so each config is timed as the whole op. Otherwise short splits
    would win on the split kernel alone and pay, uncounted, in the merge."""
    if exception is None and not nargs["FUSED_MERGE"]:
        splits = triton.cdiv(nargs["S"], nargs["SPLIT_N"])
        if splits > 1:
            _merge_into(nargs["o_ptr"], nargs["lse_ptr"], splits, nargs["out_ptr"])


def autotuned_split_kernel(configs: list, **autotune_kwargs):
    """`_decode_split_kernel` under `triton.autotune` over `configs` (each sets BLOCK_N and SPLIT_N), keyed by
    what moves the best split length: the cache length and B * Hkv (power-of-2 buckets, so a cache growing by a
    token a step or a batch growing by a row does not re-tune every time), head_dim, n_rep and whether seq_lens
    are given (plus the tensors' dtypes, which Triton adds). The key is tuned on its first call — in a CUDA-graph
    run that is the warm-up, before capture. `autotune_kwargs` go to `triton.autotune` (the tests pass do_bench)."""
    return triton.autotune(configs=configs, key=["S_BUCKET", "BHKV_BUCKET", "HD", "N_REP", "HAS_LENS"],
                           prune_configs_by={"early_config_prune": _prune}, post_hook=_merge_during_tuning,
                           **autotune_kwargs)(_decode_split_kernel)


# timed as the GEMVs are (`tune_bench`: a read flush, then the GPU kept busy while the host queues the split and
# merge launches). Triton's default timing counts the host's gap between the two launches against every unfused
# config, so it favours fused-merge configs that are slower under CUDA-graph replay (docs/results.md)
_decode_split_tuned = autotuned_split_kernel(autotune_configs(SPLIT_CONFIGS, default=DEFAULT_CONFIG),
                                             do_bench=tune_bench)


def _pdl_kwargs(device: torch.device) -> dict:
    """The kernels' PDL meta-parameter and `launch_pdl`: `pdl_kwargs`, or as `USE_PDL` forces it (where the GPU
    has it)."""
    if USE_PDL is None:
        return pdl_kwargs(device)
    on = USE_PDL and pdl_supported(device)
    return {"PDL": on, **({"launch_pdl": True} if on else {})}


@functools.lru_cache(maxsize=None)
def _shortest_split(kernel, s_bucket: int, bhkv_bucket: int, has_lens: bool, sms: int, key_bytes: int) -> int:
    """The shortest SPLIT_N the autotuned `kernel` may pick for this key: it sizes the scratch buffers."""
    return min(c.kwargs["SPLIT_N"]
               for c in candidate_split_configs(kernel.configs, s_bucket, bhkv_bucket, has_lens, sms, key_bytes))


# Keys (with lengths) already tuned on a full cache. The autotuner times its configs on the call that first meets a
# key; in a CUDA-graph run that is the warm-up, whose lengths are 1 — where one split always wins — while the graph
# then replays that choice at every length up to the cache's capacity. So the first call with lengths runs once with
# every row full (lengths = S), the worst case, and the autotuner tunes on that.
_TUNED_AT_CAPACITY: set = set()


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None, scale: float,
            num_splits: int | None = None, config: triton.Config | None = None,
            trigger_next: bool = False, prefetch_kv: bool = False,
            rope_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the split kernel, then the merge (skipped when there is one split), on checked inputs.

    q: (B, H, hd); k, v: (B, Hkv, S, hd); seq_lens: None or (B,) int32/int64 -> (B, H, hd) in q's dtype.
    rope_freq: RoPE's (hd/2,) fp32 inverse frequencies: q is the q heads of the new token's fused projection, not
    yet rotated, whose k and v heads follow them, and the kernel applies RoPE and writes the cache itself
    (`rope_attention.rope_cache_attention`).
    Neither num_splits nor config: the autotuned kernel (`_decode_split_tuned`). Otherwise the plain jit kernel
    with `config` (default `NUM_SPLITS_CONFIG`) — how the tests run configs the GPU autotuner may choose — and,
    if num_splits is given, SPLIT_N = 0: S shared out over that many programs per (sequence, KV head).
    """
    B, H, hd = q.shape
    _, Hkv, S, _ = k.shape
    n_rep = H // Hkv
    has_lens = seq_lens is not None
    tuned = num_splits is None and config is None
    s_bucket, bhkv_bucket = triton.next_power_of_2(S), triton.next_power_of_2(B * Hkv)
    if tuned and has_lens and len(_decode_split_tuned.configs) > 1:
        key = (s_bucket, bhkv_bucket, hd, n_rep, q.dtype, q.device)
        if key not in _TUNED_AT_CAPACITY:  # first call for this key: tune it on a FULL cache (see above)
            _TUNED_AT_CAPACITY.add(key)  # (first, so that the call below goes straight through)
            try:
                _decode(q, k, v, torch.full_like(seq_lens, S), scale)
            except BaseException:
                _TUNED_AT_CAPACITY.discard(key)  # not tuned: the next call tries again
                raise
    if tuned:
        kernel, meta = _decode_split_tuned, {}
        # scratch for the most splits any candidate config makes; the grid follows the config the tuner picks
        max_splits = triton.cdiv(S, _shortest_split(kernel, s_bucket, bhkv_bucket, has_lens, num_sms(q.device),
                                                    kv_bytes_per_key(k, hd)))
        grid = lambda META: (B * Hkv, triton.cdiv(S, META["SPLIT_N"]))  # noqa: E731
    else:
        kernel = _decode_split_kernel
        meta = (NUM_SPLITS_CONFIG if config is None else config).all_kwargs()
        if num_splits is not None:
            max_splits = max(1, min(num_splits, S))
            meta["SPLIT_N"] = 0
        else:
            max_splits = triton.cdiv(S, meta["SPLIT_N"])
        grid = (B * Hkv, max_splits)

    out = torch.empty(B, H, hd, dtype=q.dtype, device=q.device)
    o_part = torch.empty(B, H, max_splits, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, max_splits, dtype=torch.float32, device=q.device)
    if not tuned:
        meta.setdefault("FUSED_MERGE", FUSE_MERGE)
    block_d = max(16, triton.next_power_of_2(hd))
    block_hm = triton.next_power_of_2(n_rep)
    counters = split_counters(q.device, B * Hkv)
    with zero_on_error(counters):
        kernel[grid](
            q, k, v, q if seq_lens is None else seq_lens, o_part, lse, out,  # no lengths: q stands in, never read
            counters, lse if rope_freq is None else rope_freq,  # no RoPE: an fp32 stand-in (one autotuning key)
            Hkv, n_rep, hd, S, s_bucket, bhkv_bucket, scale,
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HAS_LENS=has_lens, BLOCK_H=max(16, triton.next_power_of_2(n_rep)),  # tl.dot needs >= 16 rows (masked)
            BLOCK_D=block_d, IEEE=q.dtype == torch.float32, **_pdl_kwargs(q.device),
            BLOCK_HM=block_hm, BLOCK_S=max(1, FUSED_MERGE_TILE // (block_hm * block_d)), PREFETCH=prefetch_kv,
            ROPE=rope_freq is not None, **meta,
        )
    # the split count of THIS launch: the autotuner sets `best_config` to the config it ran for this call's key
    # (Triton 3.x `Autotuner.run`), host state only — nothing is read back from the GPU
    ran = kernel.best_config.kwargs if tuned else meta
    splits = triton.cdiv(S, ran["SPLIT_N"]) if tuned else max_splits
    if splits > 1 and not ran["FUSED_MERGE"]:  # one split, or the fused merge: the split kernel already wrote `out`
        _merge_into(o_part, lse, splits, out, trigger_next)
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
                     scale: float | None = None, num_splits: int | None = None,
                     check_lens: bool = True, trigger_next: bool = False,
                     prefetch_kv: bool = False, config: triton.Config | None = None) -> torch.Tensor:
    """One decode step of GQA attention, flash-decoding style (split over the sequence, merged by log-sum-exp).

    Args:
        q: (B, H, hd) or (B, H, 1, hd), the new token's queries (after RoPE).
        k, v: (B, Hkv, S, hd) cache views, H % Hkv == 0; last dimension contiguous; same dtype as q.
        seq_lens: optional (B,) int tensor on q's device: sequence b attends to k[b, :, :seq_lens[b]]; each in
            1..S. Default: all S tokens.
        scale: softmax scale, default 1/sqrt(hd) (as SDPA).
        num_splits: programs per (sequence, KV head) along the sequence, an int >= 1: S shared out in whole
            tiles (with seq_lens: each row's filled length); the last may be empty. Default (None): the autotuned
            split length (`attention_splits.SPLIT_CONFIGS`), one split when that covers S.
        check_lens: read seq_lens on the host to check they lie in 1..S (a GPU -> CPU sync; skipped during CUDA
            graph capture). The model's decode step passes False: its lengths come from the cache positions.
        trigger_next: with PDL, the merge kernel lets the NEXT kernel launch at its start (`gdc_launch_dependents`),
            so a next kernel with work that does not depend on the attention — the model's o projection loads
            its weights before it waits (`fused_gemv`) — does it while the attention runs, which shortens the
            decode step; but a chain of attention calls alone runs slower with it at long caches (the next split
            kernel's programs, which have nothing to do before they wait, then sit on the SMs), so it is off
            unless the caller knows what comes next (docs/results.md). It concerns the merge kernel only: with
            one split or the split kernel's own merge there is none, and the split kernel always lets the next
            kernel launch at its start.
        prefetch_kv: (with seq_lens) the caller promises that seq_lens and every cached key and value but each
            sequence's newest (slot seq_lens[b] - 1) were written before the kernel launched just before this
            call started — as in the model's decode step, where that kernel (`rope_and_cache_`) writes only the
            new token's K/V. Then, with PDL, each split program loads its first K/V tile BEFORE it waits for that
            kernel, and reads the newest slot again after. Without PDL it changes nothing. It shortens a
            short-context decode step a little and leaves long contexts unchanged (docs/results.md).
        config: run the split kernel with this config (a `triton.Config` with BLOCK_N, SPLIT_N and FUSED_MERGE,
            e.g. one of `candidate_configs`) instead of the autotuner's pick — how `step_tuning` runs the one it
            chose by timing the whole decode step. Not together with num_splits.

    Returns:
        (B, H, hd) or (B, H, 1, hd) like q, in q's dtype.

    Raises:
        ValueError: shape mismatches, H not a multiple of Hkv, S == 0, seq_lens out of 1..S, a non-contiguous
            last dimension. TypeError: unsupported or mismatched dtypes, an argument that is not a tensor,
            trigger_next or prefetch_kv not True/False, prefetch_kv without seq_lens; a config that is not a
            split config (BLOCK_N a power of 2 >= 16, SPLIT_N a multiple of it, FUSED_MERGE True/False), or
            given with num_splits.
    """
    check_tensors("decode_attention", DTYPES, q=q, k=k, v=v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"decode_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q_shape = q.shape
    if q.dim() == 4:
        if q.shape[2] != 1:
            raise ValueError(f"decode_attention: one query token per sequence (decode), got q {tuple(q.shape)}; "
                             f"use scaled_dot_product_attention for prefill")
        q = q[:, :, 0]
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"decode_attention: q must be (B, H, hd), k and v (B, Hkv, S, hd); got "
                         f"{tuple(q_shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, hd = q.shape
    _, Hkv, S, _ = k.shape
    if k.shape[0] != B or k.shape[3] != hd:
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} do not match q {tuple(q_shape)} in B or hd")
    if min(B, H, Hkv, hd) < 1:
        raise ValueError(f"decode_attention: batch, heads, KV heads and head_dim must be >= 1, got q "
                         f"{tuple(q_shape)} and k/v {tuple(k.shape)}")
    if H % Hkv:
        raise ValueError(f"decode_attention: {H} query heads are not a multiple of {Hkv} KV heads")
    if S == 0:
        raise ValueError("decode_attention: the KV cache is empty (S = 0)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"decode_attention: {name}'s last dimension must be contiguous, strides {t.stride()}")
    if seq_lens is not None:
        if not isinstance(seq_lens, torch.Tensor):
            raise TypeError(f"decode_attention: seq_lens must be a ({B},) int tensor on {q.device}, got "
                            f"{type(seq_lens).__name__}; pass torch.tensor(lengths, device=q.device)")
        if (seq_lens.shape != (B,) or seq_lens.device != q.device or seq_lens.is_floating_point()
                or seq_lens.dtype == torch.bool):
            raise ValueError(f"decode_attention: seq_lens must be a ({B},) int tensor on {q.device}, got shape "
                             f"{tuple(seq_lens.shape)} {seq_lens.dtype} on {seq_lens.device}")
        capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if check_lens and not capturing and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > S):
            raise ValueError(f"decode_attention: seq_lens must lie in 1..{S}, got {seq_lens.tolist()}")
        if seq_lens.dtype not in (torch.int32, torch.int64):
            seq_lens = seq_lens.to(torch.int32)
        seq_lens = seq_lens.contiguous()  # the kernel reads lens_ptr + b: a strided view would be read wrongly
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
                                   or num_splits < 1):
        raise ValueError(f"decode_attention: num_splits must be a whole number >= 1 (or None for the tuned "
                         f"split), got {num_splits!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"decode_attention: scale must be a number (the softmax scale, default 1/sqrt(hd)), got "
                        f"{scale!r}")
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)

    prefetch_kv = check_flag("decode_attention", "prefetch_kv", prefetch_kv)
    if prefetch_kv and seq_lens is None:
        raise TypeError("decode_attention: prefetch_kv needs seq_lens (it re-reads each sequence's newest slot, "
                        "seq_lens - 1); pass seq_lens or prefetch_kv=False")
    if config is not None:
        _check_split_config(config)
        if num_splits is not None:
            raise TypeError("decode_attention: give num_splits or config, not both (a config sets the split "
                            "length SPLIT_N itself)")
    return _decode(q, k, v, seq_lens, scale, int(num_splits) if num_splits else None, config=config,
                   trigger_next=check_flag("decode_attention", "trigger_next", trigger_next),
                   prefetch_kv=prefetch_kv).view(q_shape)


def _check_split_config(config) -> None:
    """A `config=` for decode_attention: a triton.Config whose kwargs are exactly BLOCK_N (a power of 2 >= 16, as
    tl.dot needs), SPLIT_N (a positive multiple of BLOCK_N) and FUSED_MERGE (a bool). TypeError otherwise."""
    keys = {"BLOCK_N", "SPLIT_N", "FUSED_MERGE"}
    if not isinstance(config, triton.Config) or set(config.kwargs) != keys:
        raise TypeError(f"decode_attention: config must be a triton.Config with BLOCK_N, SPLIT_N and FUSED_MERGE "
                        f"and nothing else (see candidate_configs), got {config!r}")
    bn, sn, fm = (config.kwargs[k] for k in ("BLOCK_N", "SPLIT_N", "FUSED_MERGE"))
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (bn, sn))
    if not ints or bn < 16 or bn & (bn - 1) or sn < 1 or sn % bn or not isinstance(fm, bool):
        raise TypeError(f"decode_attention: config's BLOCK_N must be a power of 2 >= 16, SPLIT_N a positive "
                        f"multiple of it and FUSED_MERGE True or False, got BLOCK_N={bn!r}, SPLIT_N={sn!r}, "
                        f"FUSED_MERGE={fm!r}")


def candidate_configs(q: torch.Tensor, k: torch.Tensor, has_lens: bool = True) -> list:
    """The split configs the autotuner would time for a call with q (B, H, hd) and a cache k (B, Hkv, S, hd)
    (`candidate_split_configs`: with has_lens, a static cache's, no fused merge). One config where autotuning is off
    (the interpreter, LLMLAB_TRITON_AUTOTUNE=0). `step_tuning` times each of them inside the decode step."""
    B, Hkv, S, hd = k.shape
    return candidate_split_configs(_decode_split_tuned.configs, triton.next_power_of_2(S),
                                   triton.next_power_of_2(B * Hkv), has_lens, num_sms(q.device),
                                   kv_bytes_per_key(k, hd))


if __name__ == "__main__":
    demo_needs_cuda("decode_attention")
    from triton.testing import do_bench_cudagraph

    B, H, Hkv, hd = 1, 32, 8, 128
    for S in (256, 8192, 16384, 32768):
        q = torch.randn(B, H, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        nbytes = 2 * k.numel() * k.element_size()
        decode_attention(q, k, v)  # tunes this key (outside the graph)
        config = _decode_split_tuned.best_config
        ms_t = do_bench_cudagraph(lambda: decode_attention(q, k, v))
        ms_p = do_bench_cudagraph(lambda: decode_attention_reference(q, k, v))
        print(f"S={S:6d}: triton {nbytes / ms_t / 1e6:7.1f} GB/s ({config})   "
              f"SDPA+repeat_kv {nbytes / ms_p / 1e6:7.1f} GB/s")
