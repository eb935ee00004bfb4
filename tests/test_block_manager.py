"""Property tests of the paged-KV block allocator (`llmlab.cache.block_manager`): random operation sequences never leak
or double-allocate a block, and the pool returns exactly to full once everything is freed.

The stateful machine runs MAX_EXAMPLES x STEPS = 10,000+ random allocate / append / fork / free operations per run,
checking every invariant after each one against a model (the expected token count of every live sequence)."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from llmlab.cache.block_manager import BlockManager, OutOfBlocks

MAX_EXAMPLES, STEPS = 100, 150  # up to 15,000 operations per machine (runs may end early)


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4)
        self.expected: dict[int, int] = {}  # live seq id -> tokens
        self.next_id = 0
        self.ops = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(target=seqs, n=st.integers(1, 40))
    def allocate(self, n):
        self.ops += 1
        sid = self._new_id()
        can = self.bm.can_allocate(n)
        free_before = self.bm.num_free
        try:
            assert self.bm.allocate(sid, n) == 0
        except OutOfBlocks as e:
            assert not can and e.needed > e.free == free_before
            assert self.bm.num_free == free_before  # nothing changed
            return sid  # a dead id: later rules skip it
        assert can
        self.expected[sid] = n
        assert self.bm.num_free == free_before - self.bm.blocks_for(n)
        return sid

    @rule(sid=seqs, n=st.integers(1, 9))
    def append(self, sid, n):
        self.ops += 1
        if sid not in self.expected:
            return
        can = self.bm.can_append(sid, n)
        table_before = self.bm.block_table(sid)
        try:
            copies = self.bm.append(sid, n)
        except OutOfBlocks:
            assert not can and self.bm.block_table(sid) == table_before
            return
        assert can
        self.expected[sid] += n
        for src, dst in copies:  # copy-on-write gave this sequence its own last block
            assert src == table_before[-1] and dst not in table_before and self.bm.ref_count[src] >= 1

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        self.ops += 1
        child = self._new_id()
        if parent not in self.expected:
            return child
        free_before = self.bm.num_free
        self.bm.fork(parent, child)
        assert self.bm.num_free == free_before  # sharing costs no block
        self.expected[child] = self.expected[parent]
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        self.ops += 1
        if sid not in self.expected:
            with pytest.raises(KeyError):
                self.bm.free(sid)
            return
        self.bm.free(sid)
        del self.expected[sid]

    @invariant()
    def consistent(self):
        self.bm.check()
        assert {s: self.bm.length(s) for s in self.expected} == self.expected
        # no block is held by a table while on the free list, and no block is lost
        used = {b for t in self.bm.tables.values() for b in t}
        assert len(used) + self.bm.num_free == self.bm.num_blocks

    def teardown(self):
        for sid in list(self.expected):
            self.bm.free(sid)
        self.bm.check()
        assert self.bm.num_free == self.bm.num_blocks  # the pool is exactly full again
        assert sorted(self.bm.free_list) == list(range(self.bm.num_blocks))
        BlockManagerMachine.total_ops += self.ops


BlockManagerMachine.total_ops = 0
BlockManagerMachine.TestCase.settings = settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                                 suppress_health_check=list(HealthCheck))


class PrefixMachine(BlockManagerMachine):
    """The same machine with token ids: prefix sharing by hash, copy-on-write and cached free blocks."""

    def __init__(self):
        super().__init__()
        self.ids: dict[int, list[int]] = {}

    @rule(target=BlockManagerMachine.seqs, prefix_of=st.one_of(st.none(), BlockManagerMachine.seqs),
          extra=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def allocate_ids(self, prefix_of, extra):
        self.ops += 1
        sid = self._new_id()
        ids = (self.ids.get(prefix_of, []) if prefix_of is not None else []) + extra
        can = self.bm.can_allocate(ids)
        try:
            hit = self.bm.allocate(sid, ids)
        except OutOfBlocks:
            assert not can
            return sid
        assert can and hit % self.bm.block_size == 0 and hit < len(ids)
        self.expected[sid] = len(ids)
        self.ids[sid] = ids
        return sid

    @rule(sid=BlockManagerMachine.seqs, extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append_ids(self, sid, extra):
        self.ops += 1
        if sid not in self.ids or sid not in self.expected:
            return
        try:
            self.bm.append(sid, extra)
        except OutOfBlocks:
            return
        self.expected[sid] += len(extra)
        self.ids[sid] = self.ids[sid] + extra

    @rule(sid=BlockManagerMachine.seqs, n=st.integers(1, 9))
    def append(self, sid, n):
        if sid in self.ids:  # allocated with ids: a count would be refused
            with pytest.raises(ValueError):
                self.bm.append(sid, n)
            return
        super().append(sid, n)

    @rule(target=BlockManagerMachine.seqs, parent=BlockManagerMachine.seqs)
    def fork(self, parent):
        child = super().fork(parent)
        if parent in self.ids and parent in self.expected:
            self.ids[child] = list(self.ids[parent])
        return child

    def teardown(self):
        super().teardown()
        PrefixMachine.total_ops += self.ops


PrefixMachine.total_ops = 0
PrefixMachine.TestCase.settings = BlockManagerMachine.TestCase.settings


def test_block_manager_random_operations():
    BlockManagerMachine.total_ops = 0
    BlockManagerMachine.TestCase().runTest()
    assert BlockManagerMachine.total_ops >= 10_000, BlockManagerMachine.total_ops


def test_block_manager_prefix_sharing_random_operations():
    PrefixMachine.total_ops = 0
    PrefixMachine.TestCase().runTest()
    assert PrefixMachine.total_ops >= 10_000, PrefixMachine.total_ops


def test_out_of_blocks_names_needed_and_free():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate("a", 40)  # 3 blocks
    assert not bm.can_allocate(17)
    with pytest.raises(OutOfBlocks, match=r"needs 2 more KV blocks .* only 1 are free"):
        bm.allocate("b", 17)
    assert bm.num_free == 1 and "b" not in bm.tables


def test_fork_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", 6)  # blocks [x, y], y half full
    bm.fork("p", "c")
    assert bm.block_table("p") == bm.block_table("c") and bm.num_free == 6
    shared_last = bm.block_table("p")[-1]
    copies = bm.append("c", 1)  # the child writes into the shared half-full block: it gets its own copy
    assert copies == [(shared_last, bm.block_table("c")[-1])]
    assert bm.block_table("c")[0] == bm.block_table("p")[0]  # the full block stays shared
    assert bm.append("p", 1) == []  # the parent now holds its last block alone: written in place
    bm.free("p"), bm.free("c")
    assert bm.num_free == 8


def test_prefix_hits_and_cached_free_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    turn1 = list(range(10))
    assert bm.allocate(1, turn1) == 0
    bm.append(1, [10, 11])  # block 2 becomes full: hashed
    turn2 = turn1 + [10, 11] + [20, 21, 22]
    assert bm.allocate(2, turn2) == 12  # three full blocks reused
    assert bm.block_table(2)[:3] == bm.block_table(1)
    bm.free(1), bm.free(2)
    assert bm.num_free == 8
    assert bm.allocate(3, turn2) == 12  # freed blocks kept their contents and hashes
    assert bm.allocate(4, [99] * 5) == 0
    bm.free(3), bm.free(4)
    bm.check()
    assert bm.num_free == 8


def test_a_forgotten_prefix_is_not_reused_through_later_blocks():
    """After forget_prefix, the sequence's later full blocks must not be registered as if they began a sequence
    (their K/V came after unwritten ones): another sequence starting with the same ids reuses nothing."""
    bm = BlockManager(8, 4)
    bm.allocate("A", [1, 2, 3, 4, 5, 6])
    bm.forget_prefix("A", 0)
    bm.append("A", [7, 8])
    assert bm.allocate("B", [5, 6, 7, 8, 9]) == 0
    assert set(bm.block_table("B")).isdisjoint(bm.block_table("A"))


def test_arguments_of_the_wrong_kind_are_named():
    for args, err in (((4.5, 4), TypeError), (("4", 4), TypeError), ((4, 2.5), TypeError), ((0, 4), ValueError)):
        with pytest.raises(err, match="num_blocks|block_size"):
            BlockManager(*args)
    bm = BlockManager(8, 4)
    for bad in (2.5, "5", [1, 2.0], True):
        with pytest.raises(TypeError, match="token count"):
            bm.allocate("s", bad)
    assert bm.can_allocate(-5) is False and bm.can_allocate([]) is False
    torch = pytest.importorskip("torch")
    bm.allocate("A", [1, 2, 3, 4, 5])
    assert bm.allocate("B", torch.tensor([1, 2, 3, 4, 9])) == 4  # tensor ids share a prefix like a list's


def test_append_takes_a_count_or_token_ids_and_names_anything_else():
    np = pytest.importorskip("numpy")
    bm = BlockManager(8, 4)
    bm.allocate("s", 3)
    assert bm.append("s", np.int64(2)) == [] and bm.length("s") == 5  # numpy's ints are counts
    bm.allocate("t", [1, 2, 3])
    assert bm.append("t", np.array([7, 8])) == [] and bm.length("t") == 5  # an array is token ids
    for bad in (True, 2.5, None, "3"):
        for seq in ("s", "t"):
            with pytest.raises(TypeError, match=r"append takes a count \(an int\) or token ids"):
                bm.append(seq, bad)
    assert bm.length("s") == 5 and bm.length("t") == 5  # nothing changed
    bm.check()
