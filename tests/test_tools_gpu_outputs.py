"""tools/unpack_gpu_outputs.py: only a clean GPU run of a lab goes into labs/gpu-outputs/ (CPU, standard library)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("unpack_gpu_outputs", ROOT / "tools" / "unpack_gpu_outputs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def notebook(device="NVIDIA H200", status="ok", error_cell=False) -> bytes:
    header = {"cell_type": "code", "metadata": {"tags": ["llmlab-run-header"]}, "source": "", "execution_count": 1,
              "outputs": [{"output_type": "stream", "name": "stdout",
                           "text": f"device: {device}\ndate: 2026-12-05 UTC\n"}]}
    cell = {"cell_type": "code", "metadata": {}, "source": "1", "execution_count": 2, "outputs": []}
    if error_cell:
        cell["outputs"] = [{"output_type": "error", "ename": "ValueError", "evalue": "boom", "traceback": []}]
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "cells": [header, cell],
                       "metadata": {"llmlab_run": {"status": status}}}).encode()


def test_a_clean_gpu_run_passes_and_each_fault_is_named():
    tool = load_tool()
    lab = sorted(p.name for p in (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))[0]
    assert tool.problems(lab, notebook()) == []
    assert any("error" in p.lower() for p in tool.problems(lab, notebook(error_cell=True)))
    assert tool.problems(lab, notebook(status="timeout"))
    assert tool.problems(lab, notebook(device="no CUDA GPU: cpu"))
    assert tool.problems(lab, notebook(device="no CUDA GPU: cpu"), allow_cpu=True) == []
    assert tool.problems("99_missing.ipynb", notebook()) == ["labs/ has no lab named 99_missing.ipynb"]
