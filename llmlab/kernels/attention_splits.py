"""How decode attention splits a sequence across programs: the split configs its autotuner chooses from, and which
of them are worth timing for a call (`candidate_split_configs`).

A config fixes the K/V tile (BLOCK_N keys per loop step, warps, pipeline stages) AND the split length SPLIT_N (keys
per program, a multiple of BLOCK_N), which sets the grid: B * Hkv x cdiv(S, SPLIT_N) programs. The split length is a
trade-off that depends on S, B * Hkv, head_dim and the GPU, so it is measured rather than derived from the SM count:

  * short splits: many programs (every SM busy), but each runs only 1-2 tiles — no room for the loop's software
    pipelining to overlap one tile's loads with the previous tile's math — and the merge has more partials to read;
  * long splits: each program streams many tiles with several loads in flight, but too few programs leave SMs idle;
  * one split (SPLIT_N >= S): no merge at all — the split kernel writes the output itself, one launch instead of
    two. This is the short-context case (a chat turn of a few hundred tokens), where the launch is most of the time.

Each config is timed as split + merge (`decode_attention._merge_during_tuning`), so the merge's cost is in the
comparison.
"""

from __future__ import annotations

import torch
import triton

_TILES = ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 8, 3))  # (BLOCK_N, num_warps, num_stages)
_SPLIT_LENS = (64, 128, 256, 512, 1024, 2048)
# FUSED_MERGE: the split kernel's last program merges (`lse_merge.merge_last`) instead of a merge kernel. It saves a
# launch, which wins for short caches split a few ways, and loses for long caches split many ways, where the merge
# kernel's B * H programs merge in parallel while the fused merge runs in one program per KV head at the kernel's
# tail (docs/results.md). So it is tuned like the rest, offered only up to FUSED_MAX_SPLITS splits.
SPLIT_CONFIGS = [triton.Config({"BLOCK_N": n, "SPLIT_N": s, "FUSED_MERGE": f}, num_warps=w, num_stages=st)
                 for f in (False, True) for s in _SPLIT_LENS for n, w, st in _TILES if s % n == 0]
FUSED_MAX_SPLITS = 8
# the one config in the interpreter (and with LLMLAB_TRITON_AUTOTUNE=0): short splits, so small test caches still
# split into several programs and go through the merge
DEFAULT_CONFIG = triton.Config({"BLOCK_N": 32, "SPLIT_N": 64, "FUSED_MERGE": False})
# an explicit num_splits: this tile, SPLIT_N = 0 (the kernel shares S out over the grid's programs), not tuned
NUM_SPLITS_CONFIG = triton.Config({"BLOCK_N": 32, "SPLIT_N": 0}, num_warps=4, num_stages=3)

MAX_SPLITS = 256  # partials per (sequence, head) the merge may have to combine (and the scratch buffers hold)
MAX_PROGRAMS_PER_SM = 16  # splitting finer than this many programs per SM only adds merge work
FULL_SPLIT_BYTES = 256 * 1024  # with seq_lens: a split may be one program's K/V of up to this many bytes when full


def candidate_split_configs(configs, s_bucket: int, bhkv_bucket: int, has_lens: bool, sms: int,
                            key_bytes: int = 512) -> list:
    """The configs worth timing for one tuning key (all of them when there is only one, as in the interpreter).

    1. at most MAX_SPLITS splits and MAX_PROGRAMS_PER_SM programs per SM (or the longest splits, if none is left);
    2. every split length >= S gives the same one-split launch: only the shortest of them is kept;
    3. with seq_lens (a static cache: S is its capacity, the filled lengths sit on the device), the tuner sees the
       lengths of the call that tunes — a warm-up, often short — but a CUDA graph replays the same grid at every
       later length: keep only split lengths that still give each SM a program when the cache is full, or whose
       program reads at most FULL_SPLIT_BYTES of K/V when full (key_bytes = 2 x hd x element size per key; e.g. a
       1024-slot cache of a 1B model, hd 64 in bf16: one split of 256 KB per KV head, no merge) — or the shortest;
    4. the fused merge (FUSED_MERGE) only with 2..FUSED_MAX_SPLITS splits (one split has no merge at all), and
       not with seq_lens: in the model's decode step (a static cache) offering it made the long-context workload
       slower (docs/results.md).
    """
    configs = list(configs)
    if len(configs) <= 1:
        return configs

    def splits(c):
        return triton.cdiv(s_bucket, c.kwargs["SPLIT_N"])

    def shortest(cs):
        n = min(c.kwargs["SPLIT_N"] for c in cs)
        return [c for c in cs if c.kwargs["SPLIT_N"] == n]

    keep = [c for c in configs
            if splits(c) <= MAX_SPLITS and bhkv_bucket * splits(c) <= MAX_PROGRAMS_PER_SM * sms]
    if not keep:
        longest = max(c.kwargs["SPLIT_N"] for c in configs)
        keep = [c for c in configs if c.kwargs["SPLIT_N"] == longest]
    one_split = [c for c in keep if splits(c) == 1]
    if one_split:
        keep = [c for c in keep if c.kwargs["SPLIT_N"] <= shortest(one_split)[0].kwargs["SPLIT_N"]]
    if has_lens:
        keep = [c for c in keep if bhkv_bucket * splits(c) >= sms
                or c.kwargs["SPLIT_N"] * key_bytes <= FULL_SPLIT_BYTES] or shortest(keep)
    return [c for c in keep if not c.kwargs.get("FUSED_MERGE")
            or (not has_lens and 1 < splits(c) <= FUSED_MAX_SPLITS)] or keep


def with_fused_merge(configs, s_bucket: int) -> list:
    """`configs` plus, for each that makes 2..FUSED_MAX_SPLITS splits of an S of `s_bucket` without the fused
    merge, its twin with FUSED_MERGE: one launch fewer. Rule 4 above keeps these from the autotuner where lengths
    are given, since it times the attention alone; step tuning times the whole decode step, so it may offer them
    and keep one only where the step is faster."""
    configs = list(configs)
    twins = [triton.Config({**c.kwargs, "FUSED_MERGE": True}, num_warps=c.num_warps, num_stages=c.num_stages)
             for c in configs if not c.kwargs.get("FUSED_MERGE")
             and 1 < triton.cdiv(s_bucket, c.kwargs["SPLIT_N"]) <= FUSED_MAX_SPLITS]
    known = {(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in configs}
    return configs + [c for c in twins if (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) not in known]


def kv_bytes_per_key(k: torch.Tensor, hd: int) -> int:
    """Bytes of K and V per cached key of one KV head."""
    return 2 * hd * k.element_size()
