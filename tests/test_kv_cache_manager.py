"""Page accounting: exact page ids on a tiny pool, and invariants under random workloads."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.cache.kv_cache_manager import KVCacheManager


def test_pages_fill_in_order_and_return_to_the_free_queue():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = kv.allocate_slots("a", 6)  # pages 0 and 1, the second half full
    assert kv.block_ids("a") == [0, 1]
    assert a.slots == [0, 1, 2, 3, 4, 5] and a.copies == []
    assert kv.allocate_slots("a", 2).slots == [6, 7]  # fills page 1, no new page
    assert kv.allocate_slots("b", 5).slots == [8, 9, 10, 11, 12]  # pages 2 and 3
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("a", 1) is None  # out of pages: back-pressure, not an error
    assert kv.block_ids("a") == [0, 1]  # ... and nothing changed
    kv.free("a")
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots("c", 1).slots == [0]  # freed pages are reused oldest first


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.allocate_slots("parent", 6)  # pages 0 (full), 1 (2 of 4)
    kv.fork("parent", "child")
    assert kv.block_ids("child") == [0, 1]
    assert kv.pool.ref_count(0) == kv.pool.ref_count(1) == 2

    write = kv.allocate_slots("child", 1)
    assert write.copies == [(1, 2)]  # the child writes into its own copy of page 1
    assert kv.block_ids("child") == [0, 2] and write.slots == [2 * 4 + 2]
    assert kv.pool.ref_count(1) == 1 and kv.pool.ref_count(0) == 2

    write = kv.allocate_slots("parent", 1)  # page 1 is the parent's alone now: no copy
    assert write.copies == [] and write.slots == [1 * 4 + 2]
    kv.free("parent")
    kv.free("child")
    assert kv.num_free_blocks == 6


def test_a_full_shared_page_is_never_copied():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("p", 4)
    kv.fork("p", "c")
    w = kv.allocate_slots("c", 1)
    assert w.copies == [] and kv.block_ids("c") == [0, 1]


class PagePoolMachine(RuleBasedStateMachine):
    """Random allocate / fork / free on a tiny pool, with a shadow of what each
    sequence wrote: every sequence must read back exactly its own tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=3)
        self.cells: dict[int, tuple[str, int]] = {}  # slot -> (writer, position): the "device"
        self.history: dict[str, list[tuple[str, int]]] = {}  # what each sequence must see
        self.next_id = 0

    def _write(self, seq: str, n: int) -> bool:
        alloc = self.kv.allocate_slots(seq, n)
        if alloc is None:
            return False
        bs = self.kv.block_size
        for src, dst in alloc.copies:
            for off in range(bs):
                if (src * bs + off) in self.cells:
                    self.cells[dst * bs + off] = self.cells[src * bs + off]
        for slot in alloc.slots:
            mark = (seq, len(self.history.setdefault(seq, [])))
            self.cells[slot] = mark
            self.history[seq].append(mark)
        return True

    @rule(n=st.integers(1, 8))
    def start(self, n):
        seq = f"s{self.next_id}"
        self.next_id += 1
        if not self._write(seq, n):
            self.history.pop(seq, None)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), n=st.integers(1, 4))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.history)))
        self._write(seq, n)

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.history)))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent, child)
        self.history[child] = list(self.history[parent])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def finish_or_cancel(self, data):
        seq = data.draw(st.sampled_from(sorted(self.history)))
        self.kv.free(seq)
        del self.history[seq]

    @invariant()
    def each_sequence_sees_only_its_own_tokens(self):
        for seq, expected in self.history.items():
            table = self.kv.table(seq)
            assert table.num_tokens == len(expected)
            seen = [self.cells[s] for s in table.slots(0, table.num_tokens)]
            assert seen == expected

    @invariant()
    def ref_counts_match_the_page_tables(self):
        counts = [0] * self.kv.pool.num_blocks
        for seq in self.history:
            for b in self.kv.block_ids(seq):
                counts[b] += 1
        assert all(self.kv.pool.ref_count(b) == counts[b] >= 0 for b in range(len(counts)))
        assert self.kv.num_free_blocks == counts.count(0)

    def teardown(self):
        for seq in list(self.history):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks  # no page leaked


TestPagePool = PagePoolMachine.TestCase
TestPagePool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
