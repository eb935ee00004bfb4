"""Lab 03 reference answers (KV-cache memory, paged cache, KV quantization, prefix reuse) and the checks the
notebook runs on the student's versions."""

from __future__ import annotations

import math

from llmlab.config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, bytes_per_elem: float = 2) -> float:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_elem


def max_context(config: ModelConfig, free_bytes: float, batch: int = 1, bytes_per_elem: float = 2) -> int:
    """The longest context whose cache fits in `free_bytes` for `batch` sequences."""
    return int(free_bytes // (batch * kv_bytes_per_token(config, bytes_per_elem)))


def slot(block_table: list[int], position: int, block_size: int) -> tuple[int, int]:
    """(block id, offset) holding token `position` of a sequence."""
    return block_table[position // block_size], position % block_size


def paged_waste_tokens(lengths: list[int], block_size: int) -> int:
    """Slots reserved but empty in a paged cache: the unfilled tail of each sequence's last block."""
    return sum(math.ceil(n / block_size) * block_size - n for n in lengths)


def check_kv_bytes_per_token(fn) -> None:
    """Compare `fn(config, bytes_per_elem)` with the reference on an MHA shape and two GQA shapes."""
    for name in ("llama-2-7b", "llama-3.1-8b", "qwen2.5-0.5b"):
        c = ModelConfig.from_preset(name)
        for b in (1, 2, 4):
            want, got = kv_bytes_per_token(c, b), fn(c, b)
            assert got is not None and got == want, (
                f"{name} ({c.n_layers} layers, {c.n_kv_heads} KV heads of {c.n_heads}, head_dim {c.head_dim}), "
                f"{b} bytes/element: expected {want} bytes per token, got {got}")


def check_slot(fn) -> None:
    """Compare `fn(block_table, position, block_size)` with the reference, at block edges and for two sizes."""
    table = [7, 2, 9]
    for bs, positions in ((16, (0, 15, 16, 17, 33, 47)), (4, (0, 3, 4, 5, 11))):
        for pos in positions:
            want, got = slot(table, pos, bs), fn(table, pos, bs)
            assert isinstance(got, (tuple, list)) and tuple(got) == want, (
                f"table {table}, block size {bs}, position {pos}: expected (block, offset) = {want}, got {got!r}")


def check_paged_waste_tokens(fn) -> None:
    """Compare `fn(lengths, block_size)` with the reference, including lengths that fill their last block."""
    for lengths in ([1], [16], [17, 33, 1000], [5] * 10):
        for bs in (16, 32):
            want, got = paged_waste_tokens(lengths, bs), fn(lengths, bs)
            assert got is not None and got == want, (
                f"lengths {lengths}, block size {bs}: expected {want} empty slots, got {got}")
