"""What `llmlab bench` prints: the "peaks:" line before the rows, the table of result rows, the notes below it."""

from __future__ import annotations


def _fmt(x, spec: str, pct: bool = False) -> str:
    if x is None:
        return "-"
    return format(100 * x, spec) + "%" if pct else format(x, spec)


def format_table(results: list[dict]) -> str:
    """Plain-text table of result rows (speed-up relative to the 'eager' row where there is one)."""
    base = next((r["tokens_per_s"] for r in results if r["step"] == "eager"), None)
    w = max([16] + [len(r["step"]) + 2 for r in results])  # the step column fits the longest name
    ww = max([8] + [len(r["weights"] or "-") + 1 for r in results])  # and the weights column its longest format
    head = (f"{'step':<{w}}{'batch':>6}{'weights':>{ww}}{'tokens/s':>11}{'vs eager':>9}{'TTFT ms':>10}{'TPOT p50':>10}"
            f"{'TPOT p90':>10}{'MBU':>8}{'MFU':>8}{'GPU-Util':>9}{'SM act.':>8}{'mem GB':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        tps = r.get("tokens_per_s")
        speed = f"{tps / base:.2f}x" if base and tps else "-"
        lines.append(f"{r['step']:<{w}}{_fmt(r['batch_size'], 'd'):>6}{r['weights'] or '-':>{ww}}{_fmt(tps, '.1f'):>11}"
                     f"{speed:>9}{_fmt(r['ttft_ms'], '.2f'):>10}{_fmt(r['tpot_ms_p50'], '.3f'):>10}"
                     f"{_fmt(r['tpot_ms_p90'], '.3f'):>10}{_fmt(r['mbu'], '.1f', True):>8}"
                     f"{_fmt(r['mfu'], '.2f', True):>8}{_fmt(r['gpu_util'], '.0f', True):>9}"
                     f"{_fmt(r['sm_active'], '.0f', True):>8}{_fmt(r['peak_mem_GB'], '.2f'):>8}")
    return "\n".join(lines)


def row_line(step: str, m: dict, warmup_s: float) -> str:
    """The line printed as a row is measured: tokens/s, TPOT p50, MBU, warm-up time."""
    return (f"  {step}: {m['tokens_per_s']:.1f} tokens/s, TPOT p50 {_fmt(m['tpot_ms_p50'], '.3f')} ms, "
            f"MBU {_fmt(m['mbu'], '.1f', True)} (warm-up {warmup_s:.1f} s)")


def peaks_line(p) -> str:
    """The "peaks:" line printed before a bench's rows: a `llmlab.measure.peaks.Peaks`'s figures, where they come from
    (`Peaks.source`) and how far to trust them (`Peaks.trust`), e.g. "peaks: copy 34 GB/s, matmul 0.20 TFLOP/s
    (float32), measured now, saved to <file>; spread 2% (copy), 1% (matmul) over 5 repeats: steady"."""
    line = (f"peaks: copy {p.copy_bw_gb_s:.0f} GB/s, matmul {p.matmul_tflops:.2f} TFLOP/s ({p.matmul_dtype}), "
            f"{p.source()}")
    if p.trust():
        line += f"; {p.trust()}"
    if p.cached:
        line += "; --refresh-peaks measures them again"
    return line


def mbu_above_roofline_note(results: list[dict]) -> str | None:
    """A note for rows with MBU above 100% (None if there are none): bytes read faster than the measured copy
    bandwidth. A copy reads and writes, so a decode step that only reads can beat it by a few % on a GPU; on a CPU
    a small model's weights also stay in the caches between decode steps."""
    above = [r["step"] for r in results if r["step"] != "roofline" and (r.get("mbu") or 0) > 1]
    if not above:
        return None
    return (f"MBU above 100% ({', '.join(above)}): the bytes were read faster than the measured copy bandwidth — "
            f"a copy reads and writes, and a step that only reads can beat it by a few % on a GPU; on a CPU a small "
            f"model's weights also stay in the caches between steps, which the DRAM roofline does not bound")


def converted_weights_mem_note(results: list[dict], loaded: str | None) -> str | None:
    """A note for rows whose weights differ from the loaded model's `loaded` format and that measured memory (None if
    there are none): their "mem GB" is the process's peak, which counts the loaded model kept beside the converted
    copy; the row's own weights are its `weights_allocated_GB`."""
    rows = [r for r in results if r.get("peak_mem_GB") is not None and r.get("weights_allocated_GB") is not None
            and r.get("weights") != loaded]
    if not rows:
        return None
    own = ", ".join(f"{r['step']} {r['weights_allocated_GB']:.2f}" for r in rows)
    return (f"mem GB is the process's peak: a row that converts the weights runs on a copy, so it counts the loaded "
            f"{loaded} model too; the rows' own weights (GB, allocated): {own}")


def roofline_mfu_note(results: list[dict]) -> str | None:
    """A note for a roofline row with MFU above 100% (None otherwise): the row is a bandwidth-only ceiling, and
    doing this workload's arithmetic at its speed would take more than the measured matmul rate, so the compute
    ceiling (`compute_ceiling_tokens_per_s`) is the tighter one."""
    row = next((r for r in results if r["step"] == "roofline"), None)
    if row is None or (row.get("mfu") or 0) <= 1:
        return None
    compute = row.get("compute_ceiling_tokens_per_s")
    return (f"MFU above 100% (roofline): the roofline row is a bandwidth-only ceiling (every decode step at the "
            f"measured copy bandwidth); doing this workload's arithmetic that fast would take {100 * row['mfu']:.0f}% "
            f"of the measured matmul rate, so here compute, not bandwidth, is the tighter limit"
            + (f": at most {compute:.1f} tokens/s (compute_ceiling_tokens_per_s)" if compute else ""))
