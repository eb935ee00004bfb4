"""Where a compiled kernel's loads, FMAs and barriers sit in its machine code (SASS), read without a GPU.

A Triton or Gluon kernel's source says what to load and when; ptxas, which turns the PTX into the GPU's machine
code, schedules the instructions and may move a load far from where the source put it. In a memory-bound loop that
decides the speed: a load issued after the math it was meant to overlap leaves the memory waiting for the math,
and the loop runs at the memory's latency instead of its bandwidth (int4_gemv_gluon.py's notes on its loop).

`loop_schedule` disassembles a compiled kernel (`triton.compile`'s CompiledKernel, such as the `build_offline` of
int4_gemv_gluon.py and int8_gemv_gluon.py, which need no GPU) with cuobjdump, which ships with Triton's NVIDIA
backend, and writes its main loop as runs of letters: W a 16-byte global load (a chunk of weights), F an fp32 FMA,
B a barrier. "F128 W4 B2" is 128 FMAs, then 4 weight loads, then 2 barriers.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

LETTERS = {"LDG.E.128": "W", "FFMA": "F", "BAR.SYNC": "B"}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


def cuobjdump() -> Path:
    """The cuobjdump of Triton's NVIDIA backend. FileNotFoundError if this Triton has none."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.is_file():
        raise FileNotFoundError(f"no cuobjdump in this Triton ({triton.__version__}) at {path}: sass needs the "
                                "NVIDIA backend's binaries (a Linux x86-64 wheel of Triton has them)")
    return path


def sass(kernel) -> list[tuple[int, str]]:
    """(address, instruction) of a compiled kernel's SASS, in order (predicates kept, e.g. "@P2 LDG.E.128 ...").
    kernel: a CompiledKernel with a "cubin" in .asm (a CUDA build)."""
    cubin = kernel.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump()), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.search, out.splitlines()) if m]


def loop_schedule(kernel) -> str:
    """The kernel's main loop (the instructions from the target of its longest backward branch up to that branch)
    as runs of LETTERS, e.g. "F128 W4 B2 F128 W4 B2". ValueError if the kernel has no loop."""
    code = sass(kernel)
    loops = []
    for i, (addr, ins) in enumerate(code):
        m = _BRANCH.search(ins)
        if m and m.group(1) and int(m.group(1), 16) < addr:
            loops.append((addr - int(m.group(1), 16), int(m.group(1), 16), i))
    if not loops:
        raise ValueError("loop_schedule: the kernel has no backward branch (no loop)")
    _, start, end = max(loops)
    letters = [next((v for k, v in LETTERS.items() if re.search(rf"\b{re.escape(k)}\b", ins)), "")
               for addr, ins in code[:end + 1] if addr >= start]
    runs: list[list] = []
    for ch in filter(None, letters):
        if runs and runs[-1][0] == ch:
            runs[-1][1] += 1
        else:
            runs.append([ch, 1])
    return " ".join(f"{ch}{n}" for ch, n in runs)
