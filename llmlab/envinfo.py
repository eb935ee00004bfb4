"""What this machine is: package versions and the device — the first cell of every lab and every benchmark file."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

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
    """'NVIDIA H200' on a GPU, 'CPU (x86_64, 2 threads)' otherwise."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


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
