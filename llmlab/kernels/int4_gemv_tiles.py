"""The tiles of the int4 Gluon GEMV (int4_gemv_gluon.py, int4_gemv_ring.py): its default per row length, what a
tile may hold, and the tiles a decode step's tuning (`step_tuning`) times inside the captured step.

A tile is a triton.Config whose kwargs are
- R: rows per chunk; DEPTH: chunks requested ahead of the one being summed;
- SPLITS (optional): programs sharing each chunk's rows, each summing K / SPLITS of them (split-K, for long rows);
- RING (optional, 1): the chunks in flight wait in a shared-memory ring filled by cp.async (int4_gemv_ring.py)
  instead of registers;
and num_warps and maxnreg (registers a thread, for ptxas) its build options. `int4_gemv(..., tile=)` takes one.
"""

from __future__ import annotations

import torch
import triton

# The longest rows the Gluon GEMV takes: up to 512 slots of 32 weights, one slot per thread in 16 warps. Longer rows
# would put two or more slots in each thread, where ptxas spills registers, so int4_matmul sends them to
# int4_gemv.py's K-walking GEMV.
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
# The most shared memory a ring GEMV's program may take (`int4_gemv_ring.ring_bytes`): it leaves 32 KB of an H100 /
# H200 SM's 228 KB to the next kernel's first programs, which start beside it under PDL
MAX_RING_BYTES = 196 * 1024


def ring_bytes(R: int, Q: int, depth: int) -> int:
    """Shared memory of the ring GEMV's program (int4_gemv_ring.py): depth + 1 slots of R rows of Q slots, 16
    bytes of weights and 4 of scale each, and the reduction's two (R, Q // 32) fp32 buffers."""
    return (depth + 1) * R * Q * (16 + 4) + 2 * R * (Q // 32) * 4


def check_config(config) -> tuple[int, int]:
    """(R, DEPTH) of a config for this GEMV: a triton.Config whose kwargs are R (rows per chunk, a power of 2 in
    1..32, as the cross-thread sums lay out), DEPTH (chunks requested ahead, 1..MAX_DEPTH) and optionally SPLITS
    (`splits_of`) or RING (`ring_of`), and whose maxnreg (registers a thread, for ptxas) is None or an int in
    32..255. TypeError otherwise, naming what is wrong."""
    keys = set(config.kwargs) - {"SPLITS", "RING"} if isinstance(config, triton.Config) else None
    if keys != {"R", "DEPTH"}:
        got = f"triton.Config {config}" if isinstance(config, triton.Config) else repr(config)
        raise TypeError(f"int4 GEMV: config must be a triton.Config with R and DEPTH (and SPLITS or RING) and nothing "
                        f"else "
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
    ring, splits = ring_of(config), splits_of(config)
    if ring and splits > 1:
        raise TypeError(f"int4 GEMV: a config takes SPLITS or RING, not both (the ring GEMV sums whole rows), got "
                        f"{config}")
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


def ring_of(config) -> bool:
    """Whether the config's chunks in flight wait in a shared-memory ring (RING=1, int4_gemv_ring.py) rather than
    in registers (no RING, or 0). TypeError for any other RING."""
    ring = config.kwargs.get("RING", 0) if isinstance(config, triton.Config) else 0
    if ring not in (0, 1) or isinstance(ring, bool):
        raise TypeError(f"int4 GEMV: a config's RING must be 0 or 1, got {ring!r}")
    return ring == 1


def candidate_configs(K: int, device: torch.device | str | None = None) -> list:
    """The configs a decode step's tuning (`step_tuning`) times for rows of K weights: triton.Config({"R",
    "DEPTH"}) for R in 2..8 and DEPTH in 1..MAX_DEPTH whose words in flight fit MAX_AHEAD_WORDS a thread,
    `config(K)`'s R with DEPTH 1 (the default) first, only that one where autotuning is off; for 16-warp programs
    also the default with its registers capped (`maxnreg`) to leave NEXT_PROGRAM_REGS free on the SM, and split-K
    over halves and quarters of the rows (SPLITS 2 and 4, each with `config`'s R for its share); and the ring
    GEMV (RING=1) with `config`'s R and DEPTH 1..MAX_DEPTH where its ring fits MAX_RING_BYTES (`_util.
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
    Q = 32 * NW * S
    configs += [triton.Config({"R": R0, "DEPTH": d, "RING": 1}, num_warps=NW) for d in range(1, MAX_DEPTH + 1)
                if ring_bytes(R0, Q, d) <= MAX_RING_BYTES]
    return autotune_configs(configs, configs[0])


