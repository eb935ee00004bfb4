"""Lab 03 reference answers (KV-cache memory, paged cache) and the checks the notebook runs on the student's
versions, which name the common mistakes (query heads for KV heads, K without V, the block index for the block id,
a full last block counted as waste, ...)."""

from __future__ import annotations

import math

from llmlab.config import ModelConfig
from llmlab.solutions.lab00 import check_cases


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


_KV_MISTAKES = (
    (lambda c, b: 2 * c.n_layers * c.n_heads * c.head_dim * b,
     "you counted the query heads (config.n_heads, or the width config.dim = n_heads x head_dim): the cache holds "
     "one key and one value vector per KV HEAD (config.n_kv_heads); with grouped-query attention several query "
     "heads share each KV head"),
    (lambda c, b: c.n_layers * c.n_kv_heads * c.head_dim * b,
     "that is K alone: each token stores a key AND a value vector, so multiply by 2"),
    (lambda c, b: 2 * c.n_kv_heads * c.head_dim * b,
     "that is one layer: every layer keeps its own K and V, so multiply by config.n_layers"),
    (lambda c, b: 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2,
     "use bytes_per_elem (2 for bf16, 1 for int8 or fp8, 4 for fp32), not a fixed 2"),
    (lambda c, b: 2 * c.n_layers * c.n_kv_heads * c.head_dim,
     "multiply by bytes_per_elem: that count is elements, not bytes"),
)


def check_kv_bytes_per_token(fn) -> None:
    """Compare `fn(config, bytes_per_elem)` with the reference on an MHA shape and two GQA shapes, at 1, 2 and 4
    bytes per element.

    Raises:
        AssertionError: the first case that disagrees, with the model's shape and, where the answer matches a common
            mistake (query heads for KV heads, K without V, one layer, elements for bytes), what it misses, else
            what to count (the expected number, never the formula). A stub still raising NotImplementedError is
            reported as not written.
    """
    configs = {name: ModelConfig.from_preset(name) for name in ("llama-3.1-8b", "qwen2.5-0.5b", "llama-2-7b")}

    def describe(case, want, got):
        c, b = case
        name = next(n for n, cfg in configs.items() if cfg is c)
        return (f"{name} ({c.n_layers} layers, {c.n_kv_heads} KV heads of {c.n_heads}, head_dim {c.head_dim}), {b} "
                f"bytes/element: expected {want} bytes per token, got {got!r}")

    cases = [(c, b) for c in configs.values() for b in (2, 1, 4)]
    check_cases("kv_bytes_per_token", fn, cases, kv_bytes_per_token, _KV_MISTAKES, describe,
                otherwise="count what one token leaves in the cache: in every layer, a key and a value vector for "
                          "each KV head, head_dim elements of bytes_per_elem bytes each")


_SLOT_MISTAKES = (
    (lambda t, p, bs: (p // bs, p % bs),
     "that is the block's INDEX in the sequence; the cache stores it in the physical block block_table[index]: "
     "return (block_table[position // block_size], position % block_size)"),
    (lambda t, p, bs: (t[p // 16], p % 16),
     "use the block_size argument, not a fixed 16"),
    (lambda t, p, bs: (t[p % bs], p // bs),
     "block and offset are swapped: the block is position // block_size (looked up in block_table), the offset "
     "position % block_size"),
    (lambda t, p, bs: (t[-(-p // bs)], p % bs),
     "the block index rounds DOWN: position // block_size (position 16 of 16-token blocks is the first token of "
     "block 1; position 17 is still in block 1)"),
    (lambda t, p, bs: (t[p // bs + 1], p % bs),
     "block indices count from 0: position 0 .. block_size - 1 is in block_table[0]"),
    (lambda t, p, bs: (t[(p - 1) // bs], (p - 1) % bs),
     "positions count from 0: position 0 is the first token (block_table[0], offset 0)"),
    (lambda t, p, bs: (t[p // bs], p % bs + 1),
     "offsets count from 0: the first token of a block is at offset 0"),
)


def check_slot(fn) -> None:
    """Compare `fn(block_table, position, block_size)` with the reference, at block edges and for two block sizes,
    on a table whose block ids are not 0, 1, 2.

    Raises:
        AssertionError: the first position that disagrees and, where the answer matches a common mistake (the block
            index returned instead of its id, a fixed block size, block and offset swapped, the index rounded up,
            counted from 1, or one position off), what it misses. A stub still raising NotImplementedError is
            reported as not written.
    """
    table = [7, 2, 9, 4]
    cases = [(table, pos, bs) for bs, positions in ((16, (0, 15, 16, 17, 33, 47)), (4, (0, 1, 3, 4, 5, 11)))
             for pos in positions]

    def same(got, want):
        return isinstance(got, (tuple, list)) and tuple(got) == tuple(want)

    def describe(case, want, got):
        t, pos, bs = case
        shape = "" if isinstance(got, (tuple, list)) or got is None else " (return a pair: (block id, offset))"
        return f"table {t}, block size {bs}, position {pos}: expected (block id, offset) = {want}, got {got!r}{shape}"

    check_cases("slot", fn, cases, slot, _SLOT_MISTAKES, describe, same)


_WASTE_MISTAKES = (
    (lambda lengths, bs: sum(bs - n % bs for n in lengths),
     "a sequence that fills its last block exactly (length a multiple of block_size) wastes nothing, not a whole "
     "block: waste = blocks x block_size - length, with blocks = ceil(length / block_size)"),
    (lambda lengths, bs: sum(n % bs for n in lengths),
     "that counts the FILLED slots of each last block; the waste is the empty rest: block_size - (length % "
     "block_size), or 0 when the block is full"),
    (lambda lengths, bs: sum(math.ceil(n / bs) * bs for n in lengths),
     "that is every slot reserved; subtract the tokens stored (the lengths)"),
    (lambda lengths, bs: len(lengths) * (bs - 1),
     "block_size - 1 per sequence is the worst case; count each sequence's actual empty tail"),
)


def check_paged_waste_tokens(fn) -> None:
    """Compare `fn(lengths, block_size)` with the reference, including lengths that fill their last block.

    Raises:
        AssertionError: the first case that disagrees and, where the answer matches a common mistake (a full last
            block counted as wasted, the filled part counted, the tokens not subtracted, the worst case for every
            sequence), what it misses. A stub still raising NotImplementedError is reported as not written.
    """
    cases = [(lengths, bs) for lengths in ([1], [17, 33, 1000], [16], [32, 64], [5] * 10) for bs in (16, 32)]

    def describe(case, want, got):
        return f"lengths {case[0]}, block size {case[1]}: expected {want} empty slots, got {got!r}"

    check_cases("paged_waste_tokens", fn, cases, paged_waste_tokens, _WASTE_MISTAKES, describe)
