"""Shared test setup: GPU-marked tests are skipped, with the reason, where PyTorch sees no CUDA GPU.

Without a GPU, Triton kernels (llmlab.kernels) run in Triton's CPU interpreter: TRITON_INTERPRET=1 must be set
before triton is imported (and before any @triton.jit is decorated), so it is set here, before any test module
loads. `import torch` does not import triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
