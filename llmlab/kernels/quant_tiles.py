"""The tiles the weight-only int8/int4 kernels are autotuned over, and how each kernel prunes them.

Autotuning (https://triton-lang.org/main/python-api/generated/triton.autotune.html): the first call for a new key
((N, K), plus the group size for int4) times each config and keeps the fastest. See `autotune_configs` in _util.py
for when only one config runs (the CPU interpreter, LLMLAB_TRITON_AUTOTUNE=0).

    GEMV_CONFIGS    the tl.dot kernels that read any strides (`int8_matmul` for M > 1, int4's byte-wise kernel)
    GEMV1_CONFIGS   the M = 1 K-walking GEMVs (int8, and int4 rows longer than `int4_gemv.IS_MAX_K`)
    TILE_CONFIGS    the int4 tile kernel for M = 2..16 (`int4_matmul`)
"""

from __future__ import annotations

import triton

from ._util import autotune_configs

# A GEMV's speed is how many bytes are in flight: more, smaller column tiles (BLOCK_N) give more programs to spread
# over the SMs; longer K tiles and more pipeline stages (num_stages) keep more loads outstanding per program.
_GEMV_SHAPES = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                (128, 128, 8, 3), (64, 64, 4, 5), (128, 64, 4, 4)]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMV_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                                 for n, k, w, st in _GEMV_SHAPES],
                                default=triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}))  # 32 divides any group


def int4_prune(configs, named_args, **kwargs):
    """int4 configs need BLOCK_K to divide the group size (one scale per column per K tile); 32 always does."""
    G = named_args["GROUP"]
    kept = [c for c in configs if G % c.kwargs["BLOCK_K"] == 0]
    return kept or [triton.Config({"BLOCK_N": 64, "BLOCK_K": 32})]


# The M = 1 GEMVs: a row of the 8B model's up projection is only 2 KB of int4, so a program that walks K alone makes
# a handful of dependent trips to memory. Two knobs put more bytes in flight:
#  * STAGES: the K loop is software-pipelined (`tl.range(num_stages=STAGES)`: later tiles' loads are issued before
#    this one is summed; a config's num_stages alone does not pipeline a loop without tl.dot). The pipeline syncs a
#    program's warps every step, which is free with ONE warp per program, so 1-2 warp programs beat 4-warp ones
#    (docs/results.md);
#  * SPLIT_K: programs share a row block's K range (`split_k.py`), which pays where N is small for the SMs (4096 x
#    14336: SPLIT_K 4).
# The list holds the configs that were fastest at some Llama-3.1-8B shape (every config timed by CUDA-graph
# replay): one-warp programs of 32 rows with K split 4-8 ways for int4, 4-8 rows x 512-wide K tiles for
# int8.
_GEMV1_SHAPES = [  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, STAGES)
    (32, 128, 1, 1, 4), (16, 128, 1, 1, 4), (32, 128, 4, 2, 4), (16, 256, 1, 1, 4), (16, 128, 1, 1, 6),
    (8, 256, 1, 1, 4), (32, 256, 4, 2, 3), (8, 256, 2, 1, 4), (16, 128, 2, 1, 4),
    (32, 128, 2, 1, 4), (64, 128, 4, 2, 4),
    (32, 128, 8, 1, 4), (32, 128, 4, 1, 4), (4, 512, 1, 1, 4), (8, 512, 1, 1, 3), (4, 256, 1, 1, 4)]
GEMV1_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "STAGES": st},
                                                num_warps=w) for n, k, sk, w, st in _GEMV1_SHAPES],
                                 # the interpreter's one config splits K, so the CPU tests run the split path
                                 default=triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "STAGES": 1}))


def gemv1_prune(configs, named_args, **kwargs):
    """int4: keep tiles that lie inside one group (BLOCK_K divides the group size; 32 always does).
    Both: drop splits that would get no K tile (more splits than tiles), unless that drops every config."""
    G = kwargs.get("GROUP", named_args.get("GROUP"))  # a constexpr arrives as a keyword; int8 has none
    K = named_args["K"]
    kept = [c for c in configs if G is None or G % c.kwargs["BLOCK_K"] == 0]
    kept = kept or [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "STAGES": 1})]
    return [c for c in kept if c.kwargs["SPLIT_K"] <= triton.cdiv(K, c.kwargs["BLOCK_K"])] or kept[:1]


_TILE_SHAPES = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 4, 3), (32, 64, 2, 4), (64, 128, 8, 3),
                (16, 128, 2, 4)]  # (BLOCK_N, BLOCK_K, num_warps, STAGES)
TILE_CONFIGS = autotune_configs([triton.Config({"BLOCK_N": n, "BLOCK_K": k, "STAGES": st}, num_warps=w)
                                 for n, k, w, st in _TILE_SHAPES],
                                default=triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "STAGES": 1}))


def tile_prune(configs, named_args, **kwargs):
    """BLOCK_K must divide the group size (one scale per row per tile); 32 always does."""
    G = kwargs.get("GROUP", named_args.get("GROUP"))
    return [c for c in configs if G % c.kwargs["BLOCK_K"] == 0] or [
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "STAGES": 3}, num_warps=4)]
