"""KV-cache memory math (`llmlab.cache.sizing`, measured in `llmlab.measure.kv_costs`): the formula equals what is allocated, MHA/GQA/MQA sizes, the waste
of max-length preallocation vs paging, and the error for a cache larger than free memory."""

from __future__ import annotations

import pytest
import torch

from llmlab.config import ModelConfig
from llmlab.cache.kv_cache import KVCache
from llmlab.cache.sizing import (allocated_bytes, available_memory, bytes_per_token, cache_bytes, calculator,
                                 check_fits, mixed_lengths, variants, waste)
from llmlab.measure.kv_costs import decode_latency_vs_context, measured_waste
from llmlab.cache.kv_quant import QuantizedKVCache
from llmlab.cache.paged_cache import PagedKVCache
from tiny_models import tiny_config, tiny_model


def test_llama_3_1_8b_numbers():
    c = ModelConfig.from_preset("llama-3.1-8b")  # 32 layers, 8 KV heads, head_dim 128
    assert bytes_per_token(c, torch.bfloat16) == 2 * 32 * 8 * 128 * 2 == 131072  # 128 KiB per token
    assert cache_bytes(c, 131072, 1) == 131072 * 131072  # 17.2 GB at the full 128K context
    v = variants(c)
    assert [x.n_kv_heads for x in v.values()] == [32, 8, 1]
    assert bytes_per_token(v["MHA"]) == 4 * bytes_per_token(c) == 32 * bytes_per_token(v["MQA"])


def test_calculator_rows():
    rows = calculator(["llama-2-7b", "llama-3.2-1b"], context=4096)
    names = [(r["model"], r["attention"].split()[0]) for r in rows]
    assert names == [("llama-2-7b", "MHA"), ("llama-2-7b", "MQA"), ("llama-3.2-1b", "MHA"),
                     ("llama-3.2-1b", "GQA"), ("llama-3.2-1b", "MQA")]
    assert rows[0]["gb"] == pytest.approx(2 * 32 * 32 * 128 * 2 * 4096 / 1e9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_equals_allocated(dtype):
    c = tiny_config()
    cache = KVCache(c, 3, 100, dtype, "cpu")
    assert allocated_bytes(cache) == cache.nbytes == cache_bytes(c, 100, 3, dtype)
    paged = PagedKVCache(c, 3, 100, dtype, "cpu", block_size=16)  # 3 x ceil(100 / 16) = 21 blocks
    assert allocated_bytes(paged) == paged.nbytes == 21 * 16 * bytes_per_token(c, dtype)
    q = QuantizedKVCache(c, 3, 100, dtype, "cpu", residual=0)
    assert allocated_bytes(q) == q.nbytes == 3 * 100 * QuantizedKVCache.bytes_per_token(c)


def test_waste_on_a_mixed_workload():
    lengths = mixed_lengths(64, 16, 1024, seed=0)
    contiguous, paged = waste(lengths, 1024, 16)
    assert contiguous.waste_fraction > 0.5 and paged.waste_fraction < 0.05
    assert paged.wasted_tokens < 16 * len(lengths)  # < one block per sequence
    m = measured_waste(tiny_config(max_seq_len=1024), lengths, 1024, 16)
    assert m["contiguous_waste"] == pytest.approx(contiguous.waste_fraction)
    assert m["paged_waste"] == pytest.approx(paged.waste_fraction)


def test_cache_larger_than_free_memory_names_the_numbers():
    free, where = available_memory("cpu")
    assert free > 0 and "host memory" in where
    with pytest.raises(MemoryError, match=r"test cache needs 1000000.00 GB but only .* GB of host memory is "
                                          r"available; make it smaller"):
        check_fits(10**15, "cpu", "test cache", "make it smaller")
    check_fits(1, "cpu", "tiny", "")  # fits: no error
    c = ModelConfig.from_preset("llama-3.1-8b")
    with pytest.raises(MemoryError, match="lower the batch size or max_seq_len"):
        KVCache(c, 4096, 131072, torch.bfloat16, "cpu")  # 70 TB: refused before any allocation


def test_decode_latency_vs_context_rows():
    rows = decode_latency_vs_context(tiny_model(seed=0), [8, 64], steps=2)
    assert [r["context"] for r in rows] == [8, 64] and all(r["ms"] > 0 for r in rows)
    assert rows[1]["kv_mb_read"] == 8 * rows[0]["kv_mb_read"]


def test_a_container_memory_limit_caps_what_is_available(tmp_path, monkeypatch):
    """Binder/Docker limit a container below the host's MemAvailable: the cgroup's room counts (v2, then v1)."""
    from llmlab.cache import sizing

    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text("2000000000\n")
    usage.write_text("1500000000\n")
    monkeypatch.setattr(sizing, "CGROUP_FILES", {"v2": (str(limit), str(usage))})
    free, where = available_memory("cpu")
    assert free == 500_000_000 and "container limit" in where
    with pytest.raises(MemoryError, match=r"needs 600.0 MB but only 500.0 MB of host memory is available"):
        check_fits(600_000_000, "cpu", "a model", "use a smaller one")
    limit.write_text("max\n")  # no limit: the host's figure
    assert available_memory("cpu")[1] == "host memory is available"


def test_an_unreadable_or_negative_host_reading_refuses_nothing(monkeypatch):
    import builtins

    from llmlab.cache import sizing

    real_open = builtins.open

    def no_meminfo(path, *a, **k):
        if str(path) == "/proc/meminfo":
            raise OSError("no /proc here")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    monkeypatch.setattr(sizing, "CGROUP_FILES", {})
    monkeypatch.setattr(sizing.os, "sysconf", lambda name: -1)  # sysconf's "unknown"
    free, where = available_memory("cpu")
    assert free == 1 << 62 and "unknown" in where
    check_fits(10**12, "cpu", "a large model", "")  # not refused on a guess


def test_numpy_counts_are_taken_and_a_dtype_name_is_refused_by_name():
    import numpy as np

    from llmlab.cache import sizing
    from llmlab.config import ModelConfig

    c = ModelConfig.from_preset("llama-3.2-1b")
    assert sizing.cache_bytes(c, np.int64(1024)) == sizing.cache_bytes(c, 1024)
    assert type(sizing.cache_bytes(c, np.int64(1024))) is int
    assert sizing.waste([np.int64(5)], np.int64(16)) == sizing.waste([5], 16)
    assert sizing.calculator(context=np.int64(8192))[0]["context"] == 8192
    with pytest.raises(TypeError, match=r"dtype='bf16': give a torch.dtype, e.g. torch.bfloat16"):
        sizing.bytes_per_token(c, "bf16")
