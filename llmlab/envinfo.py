"""What this machine is: package versions and the device — the first cell of every lab and every benchmark file."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import torch

PACKAGES = ["llmlab", "torch", "transformers", "tokenizers", "safetensors", "triton", "nvidia-ml-py", "plotly",
            "ipywidgets", "jupyterlab"]


def versions(packages: list[str] = PACKAGES) -> dict[str, str]:
    """{package: version} for the course's packages ('-' where not installed), plus python."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def device_name(device: torch.device | str | None = None) -> str:
    """`torch.cuda.get_device_name()` on a GPU (e.g. "NVIDIA H200"); on a CPU its model name and torch's thread
    count (e.g. "CPU: AMD EPYC 7763 64-Core Processor (2 threads)"), since a CPU's speed depends on both.
    The model name comes from /proc/cpuinfo (Linux), else `platform.processor()` or `platform.machine()`."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    n = torch.get_num_threads()
    return f"CPU: {model} ({n} thread{'' if n == 1 else 's'})"


def git_commit() -> str:
    """The repository's current commit (short hash); $LLMLAB_COMMIT where git cannot tell (a copied tree); else '-'."""
    if os.environ.get("LLMLAB_COMMIT"):
        return os.environ["LLMLAB_COMMIT"]
    try:
        from llmlab import REPO_ROOT

        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        return "-"


def describe(device: torch.device | str | None = None) -> str:
    """One line per fact, for printing at the top of a notebook."""
    v = versions()
    lines = [f"device: {device_name(device)}"]
    lines += [f"{k:>14}: {val}" for k, val in v.items()]
    return "\n".join(lines)
