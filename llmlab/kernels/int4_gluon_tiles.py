"""The configs of the int4 Gluon GEMV (int4_gemv_gluon.py): rows per chunk, chunks in flight, split-K, and the
ones a decode step's tuning may try.

Configs (`config`): R = 8 rows per chunk and one slot per thread up to K = 4096, R = 4 above; as many persistent
programs as fit the GPU at once (one wave: the compiled kernel's registers set how many fit an SM), or one per chunk
when there are fewer chunks — the best program count, or close to it, at every shape; fewer programs (the fewest
that keep one wave's chunks per program) leave less in flight. Each program keeps DEPTH chunks in flight beside the
one it sums (default 1). With one 16-warp program an SM (K = 14336), a chunk of 4 rows is ~29 KB per SM; DEPTH 2-3,
or more rows a chunk, put more in flight at the cost of registers. Split-K (SPLITS, offered for such rows): SPLITS
programs of 8 or 4 warps share each chunk's rows, each summing a half or a quarter of every row, so several programs
share an SM and each one's SwiGLU prologue covers only its share of x; each split writes its partial sums to
`split_k.scratch`, and the last of a chunk's splits to finish adds them in split order and writes y (split_k.py's
serial split-K; not with the RMSNorm prologue, whose rstd needs the whole row). A decode step's tuning
(`step_tuning`) times R and DEPTH per role inside the captured step (`candidate_configs`, `check_config`), and for
the 16-warp programs the split configs and the default with its registers capped (`maxnreg`) so that the next GEMV's
first program fits on the SM beside it and, under PDL, starts loading its weights before this one ends
(NEXT_PROGRAM_REGS); the chosen config reaches the kernel as `int4_gemv(..., tile=)`.
"""

from __future__ import annotations

import functools

import torch
import triton

# The longest rows it takes: up to 512 slots of 32 weights, one slot per thread in 16 warps. Longer rows would put
# two or more slots in each thread, where ptxas spills registers, so int4_matmul sends them to int4_gemv.py's
# K-walking GEMV.
MAX_K = 16384


def config(K: int) -> tuple[int, int, int]:
    """(R rows per chunk, NW warps, S slots per thread) for rows of K weights (see the module notes)."""
    Q = max(32, triton.next_power_of_2(K // 32))
    NW = min(16, Q // 32)
    return (8 if Q <= 128 else 4), NW, Q // (32 * NW)


# The most chunks a program keeps requested ahead of the one it sums (DEPTH), and the most words of weights a thread
# may hold: (DEPTH + 1) chunks of R rows x 4 words a slot. A 16-warp program has at most 128 registers a thread
# (65,536 an SM); half of them stay for x's 32 partners a slot, the sums and the addresses.
MAX_DEPTH = 3
MAX_AHEAD_WORDS = 64
# Under PDL the next kernel's programs start (and request their first weights) on an SM with room for them while this
# kernel still runs. A 16-warp program (K > 8192: the down projection) at its natural ~96 registers a thread leaves
# ~16K of an SM's 65,536, less than one 4-warp program of the GEMVs that follow it (q/k/v, gate/up at K = 4096: up to
# 144 registers a thread, 18,432 in all). The capped candidate limits it to the registers that leave that room.
NEXT_PROGRAM_REGS = 4 * 32 * 144


def check_config(config) -> tuple[int, int]:
    """(R, DEPTH) of a config for this GEMV: a triton.Config whose kwargs are R (rows per chunk, a power of 2 in
    1..32, as the cross-thread sums lay out), DEPTH (chunks requested ahead, 1..MAX_DEPTH) and optionally SPLITS
    (`splits_of`), and whose maxnreg (registers a thread, for ptxas) is None or an int in 32..255. TypeError
    otherwise, naming what is wrong."""
    keys = set(config.kwargs) - {"SPLITS"} if isinstance(config, triton.Config) else None
    if keys != {"R", "DEPTH"}:
        got = f"triton.Config {config}" if isinstance(config, triton.Config) else repr(config)
        raise TypeError(f"int4 GEMV: config must be a triton.Config with R and DEPTH (and SPLITS) and nothing else "
                        f"(see int4_gemv_gluon.candidate_configs), got {got}; a tile chosen for another weight "
                        f"format (int8, float) does not fit: clear the step's tiles or tune again")
    r, d = config.kwargs["R"], config.kwargs["DEPTH"]
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (r, d))
    if not ints or not 1 <= r <= 32 or r & (r - 1) or not 1 <= d <= MAX_DEPTH:
        raise TypeError(f"int4 GEMV: a config's R must be a power of 2 in 1..32 and DEPTH in 1..{MAX_DEPTH}, got "
                        f"R={r!r}, DEPTH={d!r}")
    cap = getattr(config, "maxnreg", None)
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or not 32 <= cap <= 255):
        raise TypeError(f"int4 GEMV: a config's maxnreg must be None or an int in 32..255, got {cap!r}")
    splits_of(config)
    return r, d


def splits_of(config) -> int:
    """The config's SPLITS (1 without one): how many programs share each chunk's rows, each summing K / SPLITS of
    their weights (split-K, module notes). TypeError unless a power of 2 in 1..split_k.MAX_SPLIT_K."""
    from .split_k import MAX_SPLIT_K

    splits = config.kwargs.get("SPLITS", 1) if isinstance(config, triton.Config) else 1
    if not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= MAX_SPLIT_K \
            or splits & (splits - 1):
        raise TypeError(f"int4 GEMV: a config's SPLITS must be a power of 2 in 1..{MAX_SPLIT_K}, got {splits!r}")
    return splits


def candidate_configs(K: int, device: torch.device | str | None = None) -> list:
    """The configs a decode step's tuning (`step_tuning`) times for rows of K weights: triton.Config({"R",
    "DEPTH"}) for R in 2..8 and DEPTH in 1..MAX_DEPTH whose words in flight fit MAX_AHEAD_WORDS a thread,
    `config(K)`'s R with DEPTH 1 (the default) first, only that one where autotuning is off; for 16-warp programs
    also the default with its registers capped (`maxnreg`) to leave NEXT_PROGRAM_REGS free on the SM, and split-K
    over halves and quarters of the rows (SPLITS 2 and 4, each with `config`'s R for its share) (`_util.
    autotune_configs`); none where the kernel does not run on `device` (a CPU, the interpreter, no Gluon,
    switched off or failed: `int4_matmul.gluon_gemv_status`; None: the current CUDA device) or cannot take K
    (K > MAX_K, or not a multiple of 32)."""
    from ._util import autotune_configs
    from .int4_matmul import gluon_gemv_status

    dev = torch.device("cuda") if device is None else torch.device(device)
    if not 0 < K <= MAX_K or K % 32 or gluon_gemv_status(dev) != "gluon":
        return []
    R0, NW, S = config(K)
    shapes = [(R0, 1)] + [(r, d) for r in (2, 4, 8) for d in range(1, MAX_DEPTH + 1)
                          if (r, d) != (R0, 1) and (d + 1) * r * 4 * S <= MAX_AHEAD_WORDS]
    configs = [triton.Config({"R": r, "DEPTH": d}, num_warps=NW) for r, d in shapes]
    if NW == 16:  # one program an SM: cap it so that the next GEMV's first program fits beside it (see above)
        cap = (65536 - NEXT_PROGRAM_REGS) // (32 * NW) // 8 * 8  # registers are allocated 8 a thread at a time
        configs.append(triton.Config({"R": R0, "DEPTH": 1}, num_warps=NW, maxnreg=cap))
        # split-K: 8- or 4-warp programs over a half or a quarter of each row, several an SM (module notes)
        for splits in (2, 4):
            if K % (32 * splits) == 0:
                r_split, nw_split, _ = config(K // splits)
                configs.append(triton.Config({"R": r_split, "DEPTH": 1, "SPLITS": splits}, num_warps=nw_split))
    return autotune_configs(configs, configs[0])


@functools.lru_cache(maxsize=None)
def programs_per_sm(n_regs: int, NW: int) -> int:
    """Programs of NW warps and n_regs registers a thread that fit one SM at once (65536 registers, 64 warps)."""
    return max(1, min(65536 // (max(n_regs, 1) * 32 * NW), 64 // NW))


def max_chunks(N: int, R: int, step: int, splits: int) -> int:
    """MAXC: a power of 2 >= the chunks a split program sums (1 for whole rows, which do not use it)."""
    return triton.next_power_of_2(triton.cdiv(triton.cdiv(N, R), step)) if splits > 1 else 1
