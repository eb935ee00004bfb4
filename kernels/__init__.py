"""Triton kernels for CUDA GPUs, one op per file, each beside its PyTorch reference.

This folder installs as `llmlab.kernels` (see `[tool.setuptools.package-dir]` in pyproject.toml), never as a
top-level `kernels` module: an unrelated PyPI package already owns that name. Import it as
`from llmlab import kernels` or `import llmlab.kernels`.
"""
