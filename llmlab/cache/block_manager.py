"""The paged-KV block allocator: plain Python bookkeeping, no torch (as in nano-vllm's `block_manager`).

A paged KV cache cuts the cache into fixed-size *blocks* of `block_size` tokens, all taken from one pool. A
sequence owns a *block table*: the list of block ids holding its tokens 0..bs-1, bs..2bs-1, ... Token p of a
sequence lives in block `table[p // block_size]` at offset `p % block_size`. Memory is taken one block at a time
as the sequence grows, so a sequence wastes at most block_size - 1 slots, instead of max_seq_len - length with a
max-length preallocation (Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention",
https://arxiv.org/abs/2309.06180).

What this module keeps, per block: a reference count (how many block tables hold it). A block with count 0 is on
the free list. Operations:

* `allocate(seq, tokens)`: a new sequence with `tokens` (a count, or the token ids to enable prefix sharing);
* `append(seq, n)`: n more tokens (a new block whenever the last one is full);
* `fork(parent, child)`: the child shares every block of the parent (reference counts + 1, nothing copied). The
  blocks are copy-on-write: when a sequence appends into a partly filled last block that another table also holds,
  `append` gives it a fresh block and returns the (source, destination) pair whose contents the cache must copy;
* `free(seq)`: drop a sequence; blocks whose count reaches 0 go back to the free list.

Prefix sharing (multi-turn chat, a shared system prompt): when token ids are given, every FULL block gets a hash
of its tokens chained with the hash of the block before it (so equal hashes mean equal whole prefixes, as vLLM's
automatic prefix caching does). The hash is SHA-256: with Python's 64-bit `hash()` two prompts can be crafted to
collide, and a collision would hand one request another's K/V (vLLM moved to SHA-256 for this, CVE-2025-25183). `allocate` reuses a cached block with the same hash instead of taking a new one and
returns how many leading tokens are therefore already in the cache: the caller prefills only the rest. A freed
block keeps its hash (and its contents) until it is handed out again, so a later request can still hit it.
"""

from __future__ import annotations

import hashlib
import numbers
from collections import deque
from typing import Hashable, Sequence


class OutOfBlocks(MemoryError):
    """Not enough free blocks for a request. `needed` and `free` are block counts."""

    def __init__(self, needed: int, free: int, block_size: int, what: str):
        self.needed, self.free, self.block_size = needed, free, block_size
        super().__init__(
            f"{what} needs {needed} more KV blocks ({needed * block_size} token slots) but only {free} are free "
            f"(block_size={block_size}); free finished sequences, preempt one, or build the cache with more blocks")


def _count_or_ids(tokens):
    """A token count (int) or a list of int token ids (from a list, tuple or 1-D integer tensor), else TypeError.
    A tensor becomes a list, so its full blocks hash (and are shared) like a list's."""
    if isinstance(tokens, bool):
        raise TypeError(f"tokens={tokens!r}: give a token count or a list of token ids")
    if isinstance(tokens, numbers.Integral):
        return int(tokens)
    if hasattr(tokens, "tolist") and not isinstance(tokens, (list, tuple)):
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in tokens):
        raise TypeError(f"tokens={tokens!r:.60}: give a token count (int) or token ids (a list of ints)")
    return [int(t) for t in tokens]


class BlockManager:
    """Hands out KV-cache blocks from a pool of `num_blocks`, `block_size` tokens each.

    Args:
        num_blocks: blocks in the pool (> 0).
        block_size: tokens per block (> 0); vLLM uses 16.

    Raises:
        ValueError: non-positive sizes.

    Sequence ids are any hashable value (ints in the engine). All methods are O(blocks touched) except reusing a
    freed-but-cached block, which removes it from the middle of the free list (O(num_blocks); fine for a course).
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}={value!r}: give a whole number, e.g. {name}=16")
        num_blocks, block_size = int(num_blocks), int(block_size)
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.free_list: deque[int] = deque(range(num_blocks))  # blocks with ref_count 0, oldest-freed first
        self.tables: dict[Hashable, list[int]] = {}  # seq id -> block table
        self.lengths: dict[Hashable, int] = {}  # seq id -> tokens stored
        self.tokens: dict[Hashable, list[int] | None] = {}  # seq id -> its token ids (None: counts only)
        self.block_hash: dict[int, bytes] = {}  # block -> hash of its full prefix (full blocks only)
        self.hash_to_block: dict[bytes, int] = {}  # prefix hash -> block holding it

    # -- sizes ----------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table. Raises KeyError for an unknown sequence."""
        return list(self._table(seq_id))

    def length(self, seq_id: Hashable) -> int:
        self._table(seq_id)
        return self.lengths[seq_id]

    def _table(self, seq_id: Hashable) -> list[int]:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no blocks (not allocated, or already freed)") from None

    # -- the pool -------------------------------------------------------------------------------------------
    def _take(self) -> int:
        block = self.free_list.popleft()
        old = self.block_hash.pop(block, None)  # its old contents are about to be overwritten
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.ref_count[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_list.append(block)  # keeps its hash: a later request may still reuse its contents

    @staticmethod
    def _hash(prev: bytes | None, block_tokens: Sequence[int]) -> bytes:
        """SHA-256 of the previous block's hash and this block's token ids (8 bytes each, little-endian)."""
        h = hashlib.sha256(prev or b"")
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in block_tokens))
        return h.digest()

    # -- operations -----------------------------------------------------------------------------------------
    def _prefix_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` (full blocks, at most len - 1 tokens: the last
        prompt token is always computed, its logits give the first new token)."""
        hits, prev, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            prev = self._hash(prev, token_ids[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(prev)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, tokens: int | Sequence[int]) -> bool:
        """Whether `allocate(seq, tokens)` would succeed now (counting prefix-cache hits when ids are given); False
        for no tokens, which allocate refuses."""
        tokens = _count_or_ids(tokens)
        if (tokens if isinstance(tokens, int) else len(tokens)) <= 0:
            return False
        return self._allocate_cost(tokens) <= self.num_free

    def _allocate_cost(self, tokens: int | Sequence[int]) -> int:
        if isinstance(tokens, int):
            return self.blocks_for(tokens)
        hits = self._prefix_hits(tokens)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)  # cached but free: leaves the free list
        return self.blocks_for(len(tokens)) - len(hits) + revived

    def allocate(self, seq_id: Hashable, tokens: int | Sequence[int]) -> int:
        """Give a new sequence blocks for its first tokens.

        tokens: a token count, or the token ids (then full blocks are hashed and shared by prefix).
        Returns the number of leading tokens already present in the cache (prefix hits; always 0 for a count).

        Raises:
            ValueError: the sequence already exists, or no tokens.
            OutOfBlocks: not enough free blocks (nothing is changed).
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first")
        tokens = _count_or_ids(tokens)
        n = tokens if isinstance(tokens, int) else len(tokens)
        if n <= 0:
            raise ValueError(f"sequence {seq_id!r}: allocate at least one token (got {n})")
        cost = self._allocate_cost(tokens)
        if cost > self.num_free:
            raise OutOfBlocks(cost, self.num_free, self.block_size, f"sequence {seq_id!r} ({n} tokens)")
        table: list[int] = []
        hits = [] if isinstance(tokens, int) else self._prefix_hits(tokens)
        for block in hits:
            if self.ref_count[block] == 0:
                self.free_list.remove(block)
            self.ref_count[block] += 1
            table.append(block)
        for _ in range(self.blocks_for(n) - len(hits)):
            table.append(self._take())
        self.tables[seq_id], self.lengths[seq_id] = table, n
        self.tokens[seq_id] = None if isinstance(tokens, int) else list(tokens)
        self._register_full_blocks(seq_id, 0)
        return len(hits) * self.block_size

    def _register_full_blocks(self, seq_id: Hashable, first: int) -> None:
        """Hash the sequence's full blocks from index `first` on (only when its token ids are known)."""
        ids = self.tokens[seq_id]
        if ids is None:
            return
        table, bs = self.tables[seq_id], self.block_size
        if any(block not in self.block_hash for block in table[:first]):
            # an earlier block was forgotten (`forget_prefix`: its K/V were never written), so what follows it was
            # computed from garbage, and a hash chained from None would pass it off as a sequence's first block
            return
        prev = self.block_hash.get(table[first - 1]) if first > 0 else None
        for i in range(first, self.lengths[seq_id] // bs):
            h = self._hash(prev, ids[i * bs:(i + 1) * bs])
            if table[i] not in self.block_hash:
                self.block_hash[table[i]] = h
                self.hash_to_block.setdefault(h, table[i])
            prev = h

    def forget_prefix(self, seq_id: Hashable, first_token: int = 0) -> None:
        """Unregister the prefix hashes of `seq_id`'s blocks from the one holding token `first_token` on.

        Hashes are registered when blocks are allocated or appended, before their K/V are written: a caller whose
        writes did not happen (a prefill interrupted or failed) must call this, or a later request with the same
        prefix would reuse blocks that hold garbage. The blocks stay allocated (free them as usual).

        Raises:
            KeyError: unknown sequence.
        """
        for block in self._table(seq_id)[max(0, first_token) // self.block_size:]:
            h = self.block_hash.pop(block, None)
            if h is not None and self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]

    def can_append(self, seq_id: Hashable, n: int = 1) -> bool:
        """Whether `append(seq_id, n)` would succeed now."""
        return self.append_cost(seq_id, n) <= self.num_free

    def append_cost(self, seq_id: Hashable, n: int) -> int:
        """Free blocks that `append(seq_id, n)` would take: new blocks plus the copy of a forked, partly filled
        last block."""
        table, length = self._table(seq_id), self.lengths[seq_id]
        cost = self.blocks_for(length + n) - len(table)
        if length % self.block_size and self.ref_count[table[-1]] > 1:
            cost += 1  # the shared, partly filled last block is copied before it is written
        return cost

    def append(self, seq_id: Hashable, n: int | Sequence[int] = 1) -> list[tuple[int, int]]:
        """Make room for n more tokens (a count, or their ids when the sequence was allocated with ids).

        Returns the copy-on-write pairs [(src_block, dst_block)]: the cache must copy src's contents into dst
        before writing (non-empty only when the partly filled last block was shared by a fork).

        Raises:
            KeyError: unknown sequence. ValueError: n < 1, or ids given/missing inconsistently. TypeError: n is
            neither a count (an int, numpy's too) nor token ids (a bool or a string is neither).
            OutOfBlocks: not enough free blocks (nothing is changed).
        """
        if type(n) is int:  # a plain count, the decode step's case: tested first, the ABC checks below cost more
            ids, count = None, n
        elif isinstance(n, (bool, str, bytes)) or not (isinstance(n, numbers.Integral) or hasattr(n, "__iter__")):
            raise TypeError(f"append takes a count (an int) or token ids, not {n!r}")
        else:
            ids = None if isinstance(n, numbers.Integral) else [int(t) for t in n]
            count = int(n) if ids is None else len(ids)
        if count < 1:
            raise ValueError(f"append at least one token (got {count})")
        table = self._table(seq_id)
        if (ids is None) != (self.tokens[seq_id] is None):
            raise ValueError(f"sequence {seq_id!r} was allocated with {'a count' if ids else 'token ids'}: "
                             f"append the same kind")
        cost = self.append_cost(seq_id, count)
        if cost > self.num_free:
            raise OutOfBlocks(cost, self.num_free, self.block_size, f"appending {count} token(s) to {seq_id!r}")
        copies = []
        length = self.lengths[seq_id]
        if length % self.block_size and self.ref_count[table[-1]] > 1:  # copy-on-write
            src = table[-1]
            dst = self._take()
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        for _ in range(self.blocks_for(length + count) - len(table)):
            table.append(self._take())
        self.lengths[seq_id] = length + count
        if ids is not None:
            self.tokens[seq_id].extend(ids)
            self._register_full_blocks(seq_id, length // self.block_size)
        return copies

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child starts as a copy of the parent, sharing all its blocks (no new block, no data copied).

        Raises:
            KeyError: unknown parent. ValueError: the child already exists.
        """
        table = self._table(parent)
        if child in self.tables:
            raise ValueError(f"sequence {child!r} is already allocated; free it first")
        for block in table:
            self.ref_count[block] += 1
        self.tables[child], self.lengths[child] = list(table), self.lengths[parent]
        ids = self.tokens[parent]
        self.tokens[child] = None if ids is None else list(ids)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; its blocks return to the free list when no other table holds them.

        Raises:
            KeyError: unknown (or already freed) sequence.
        """
        table = self._table(seq_id)
        for block in reversed(table):  # the tail first: the prefix stays cached the longest
            self._release(block)
        del self.tables[seq_id], self.lengths[seq_id], self.tokens[seq_id]

    # -- checking -------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants (used by the property tests): every block's count equals the number of tables
        holding it, the free list holds exactly the blocks with count 0, once each, and every table is just long
        enough for its sequence."""
        counts = [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            assert len(table) == self.blocks_for(self.lengths[seq_id]), f"{seq_id}: table length"
            assert len(set(table)) == len(table), f"{seq_id}: a block appears twice in one table"
            for block in table:
                counts[block] += 1
        assert counts == self.ref_count, "reference counts differ from the tables"
        assert len(set(self.free_list)) == len(self.free_list), "a block is twice on the free list"
        assert set(self.free_list) == {b for b, c in enumerate(counts) if c == 0}, "free list != unreferenced blocks"
