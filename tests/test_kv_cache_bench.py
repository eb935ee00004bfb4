"""tools/kv_cache_bench.py (lab 03's measurements as JSON): its --help, its printed lines and its --smoke sizes.

The script itself runs on the GPU (`python3 tools/kv_cache_bench.py --out data/bench`); `--smoke` is its quick CPU
check, not run here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "kv_cache_bench.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("kv_cache_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_describes_the_whole_script(tool, capsys):
    """The description was the docstring's first line, cut mid-sentence ("..., the")."""
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "int8/fp8 KV quality, and TTFT with and without prefix reuse." in text


def test_step_line_prints_ttft_beside_tokens_per_s(tool):
    """tokens/s is over the whole call, TTFT included: a line with TPOT and tokens/s alone reads as inconsistent."""
    row = {"model": "m", "step": "eager", "batch": 1, "ttft_ms": 150.0, "tpot_ms": 70.0, "tokens_per_s": 12.0}
    line = tool.step_line(row)
    assert "TTFT 150.0 ms" in line and "TPOT 70.00 ms" in line and "12 tok/s" in line and "TTFT included" in line
    assert "skipped: why" in tool.step_line({"model": "m", "step": "x", "batch": 1, "skipped": "why"})


def test_smoke_keeps_the_kv_quantization_part_small(tool):
    """The quality part decodes token by token: under --smoke it took most of a minutes-long run."""
    smoke, full = tool.SMOKE_QUALITY, tool.QUALITY
    assert smoke["eval_tokens"] <= 32 and smoke["new_tokens"] <= 16
    assert smoke["residual"] < smoke["eval_tokens"]  # some tokens still go through the quantizer
    assert full["eval_tokens"] == 512 and set(smoke) == set(full)
