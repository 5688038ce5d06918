"""PrefixCache: strict-prefix lookup, supersede, LRU byte/entry budget, thread-safe stats."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cache_snapshot import llama_model

from mlxserve.cache import PrefixCache, cache_nbytes, copy_cache


def fake(tag: Any) -> list[Any]:
    """An opaque snapshot for tests that never touch mlx arrays."""
    return [tag]


def make_cache(max_bytes: int = 10**9, max_entries: int = 64) -> PrefixCache:
    return PrefixCache(max_bytes, max_entries, copy=list, offset=None)


def test_whole_prompt_key_is_not_a_hit() -> None:
    pc = make_cache()
    assert pc.insert([1, 2, 3], fake("a"), nbytes=10)
    assert pc.lookup([1, 2, 3]) is None
    hit = pc.lookup([1, 2, 3, 4])
    assert hit is not None
    assert (hit.key_len, hit.cache, hit.remaining) == (3, ["a"], [4])
    assert pc.lookup([1, 2]) is None  # shorter than the key
    assert pc.lookup([]) is None
    s = pc.stats()
    assert (s.hits, s.misses, s.tokens_reused) == (1, 3, 3)


def test_longest_strict_prefix_wins() -> None:
    pc = make_cache()
    pc.insert([1, 2, 3, 4], fake("long"), nbytes=1)
    pc.insert([1, 2], fake("short"), nbytes=1)  # a prefix of an entry: both kept
    pc.insert([1, 2, 7], fake("branch"), nbytes=1)  # [1, 2] is a branch point: kept
    pc.insert([1, 2], fake("short"), nbytes=1)
    assert len(pc) == 3

    def key_len(prompt: list[int]) -> int:
        hit = pc.lookup(prompt)
        return 0 if hit is None else hit.key_len

    assert key_len([1, 2, 3, 4, 5]) == 4
    assert key_len([1, 2, 3, 4]) == 2  # the 4-token entry is the whole prompt
    assert key_len([1, 2, 3, 9]) == 2
    assert key_len([1, 2, 7, 0]) == 3
    assert key_len([1, 2, 7]) == 2
    assert key_len([1, 3]) == 0
    assert pc.peek([1, 2, 3, 4, 5]) == 4


def test_agent_conversation_keeps_exactly_one_entry() -> None:
    pc = make_cache()
    pc.insert([900, 901], fake("other conversation"), nbytes=5)
    prompt: list[int] = list(range(50))  # system prompt + first user turn
    held = 0
    for turn in range(8):
        hit = pc.lookup(prompt)
        if turn:
            assert hit is not None and hit.key_len == held
            assert hit.cache == [f"turn {turn - 1}"]
        else:
            assert hit is None
        # The engine snapshots when the cache covers exactly the prompt.
        assert pc.insert(prompt, fake(f"turn {turn}"), nbytes=100 + turn)
        held = len(prompt)
        prompt = prompt + [1000 + turn] * 2 + [2000 + turn] * 3  # reply + next user turn
    s = pc.stats()
    assert s.entries == 2  # this conversation's latest turn + the other one
    assert s.superseded == 7 and s.evictions == 0
    assert s.bytes == 5 + 107


def test_identical_key_replaces() -> None:
    pc = make_cache()
    pc.insert([5, 6, 7], fake("old"), nbytes=30)
    pc.insert([5, 6, 7], fake("new"), nbytes=20)
    hit = pc.lookup([5, 6, 7, 8])
    assert hit is not None and hit.cache == ["new"]
    assert (pc.stats().entries, pc.stats().bytes) == (1, 20)


def test_lru_order_and_entry_cap() -> None:
    pc = make_cache(max_entries=3)
    for k in (1, 2, 3):
        pc.insert([k, 0], fake(k), nbytes=1)
    assert pc.lookup([1, 0, 9]) is not None  # 1 is now most recent: 2 is oldest
    pc.insert([4, 0], fake(4), nbytes=1)
    assert pc.lookup([2, 0, 9]) is None
    assert all(pc.lookup([k, 0, 9]) is not None for k in (1, 3, 4))
    assert pc.stats().entries == 3 and pc.stats().evictions == 1


def test_byte_budget_evicts_lru_and_rejects_oversize() -> None:
    pc = make_cache(max_bytes=100)
    pc.insert([1, 1], fake(1), nbytes=40)
    pc.insert([2, 2], fake(2), nbytes=40)
    pc.insert([3, 3], fake(3), nbytes=40)  # evicts [1, 1]
    assert pc.stats().bytes == 80
    assert pc.lookup([1, 1, 0]) is None
    assert not pc.insert([2, 2, 2], fake("huge"), nbytes=101)  # larger than the budget
    s = pc.stats()
    assert (s.bytes, s.entries, s.rejected) == (80, 2, 1)
    hit = pc.lookup([2, 2, 2, 0])  # the rejected insert did not supersede [2, 2]
    assert hit is not None and hit.key_len == 2
    assert not pc.insert([], fake("empty"), nbytes=1)


def test_zero_budget_stores_nothing() -> None:
    assert not PrefixCache(0, 64, copy=list, offset=None).insert([1], fake(1), nbytes=1)
    assert not PrefixCache(100, 0, copy=list, offset=None).insert([1], fake(1), nbytes=1)
    with pytest.raises(ValueError):
        PrefixCache(-1, 1)


def test_shared_system_prompt_entry_serves_two_conversations() -> None:
    pc = make_cache()
    system = list(range(100, 140))
    pc.insert(system, fake("system"), nbytes=64)
    for user in ([1, 2, 3], [7, 8]):
        hit = pc.lookup(system + user)
        assert hit is not None and hit.key_len == len(system) and hit.remaining == user
    assert pc.stats().hits == 2 and pc.stats().tokens_reused == 2 * len(system)


def test_clear_keeps_counters() -> None:
    pc = make_cache()
    pc.insert([1, 2], fake(1), nbytes=3)
    pc.lookup([1, 2, 3])
    pc.clear()
    assert pc.lookup([1, 2, 3]) is None
    s = pc.stats()
    assert (s.entries, s.bytes, s.hits, s.misses, s.inserts) == (0, 0, 1, 1, 1)


def test_long_keys_many_entries() -> None:
    pc = make_cache(max_entries=64)
    shared = list(range(1000))
    for conv in range(64):
        key = shared + [(conv * 7919 + i) % 120_000 for i in range(30_000 - 1000)]
        assert pc.insert(key, fake(conv), nbytes=1)
    for conv in (0, 31, 63):
        prompt = shared + [(conv * 7919 + i) % 120_000 for i in range(30_000 - 1000)] + [5]
        hit = pc.lookup(prompt)
        assert hit is not None and hit.cache == [conv] and hit.remaining == [5]
    hit = pc.lookup(shared + [-1])
    assert hit is None
    with pytest.raises(ValueError):
        pc.lookup([2**40])


def test_stats_readable_from_another_thread() -> None:
    pc = make_cache(max_bytes=500, max_entries=8)
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            s = pc.stats()
            assert s.bytes <= 500 and s.entries <= 8
            seen.append(s.inserts)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(2000):
            pc.insert([i % 37, i % 11, i], fake(i), nbytes=i % 90)
            pc.lookup([i % 37, i % 11, i, 0])
    finally:
        stop.set()
        thread.join()
    assert seen and pc.stats().inserts == 2000


class _Reference:
    """A brute-force model of the prefix cache semantics."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.entries: list[tuple[tuple[int, ...], int, int]] = []  # LRU first

    def insert(self, key: tuple[int, ...], nbytes: int, tag: int) -> bool:
        if not key or nbytes > self.max_bytes or self.max_entries == 0:
            return False
        self.entries = [e for e in self.entries if not self._superseded(e[0], key)]
        self.entries.append((key, nbytes, tag))
        while (
            sum(e[1] for e in self.entries) > self.max_bytes or len(self.entries) > self.max_entries
        ):
            self.entries.pop(0)
        return True

    def _superseded(self, old: tuple[int, ...], key: tuple[int, ...]) -> bool:
        """A prefix of the new key goes, unless another key branches off right after it."""
        n = len(old)
        if key[:n] != old:
            return False
        if n == len(key):
            return True
        return not any(
            len(other) > n and other[:n] == old and other[n] != key[n]
            for other, _, _ in self.entries
        )

    def lookup(self, prompt: tuple[int, ...]) -> int | None:
        found = [e for e in self.entries if len(e[0]) < len(prompt) and prompt[: len(e[0])] == e[0]]
        if not found:
            return None
        best = max(found, key=lambda e: len(e[0]))
        self.entries.remove(best)
        self.entries.append(best)
        return best[2]


def check_trie_invariants(pc: PrefixCache) -> None:
    """The radix trie is compact and each entry sits at the depth of its key."""
    entries = 0
    stack = [(pc._trie.root, 0)]
    while stack:
        node, depth = stack.pop()
        for head, child in node.children.items():
            assert child.parent is node and child.label[:4] == head
            assert child.label and len(child.label) % 4 == 0
            stack.append((child, depth + len(child.label) // 4))
        if node is pc._trie.root:
            continue
        if node.entry is None:
            assert len(node.children) >= 2, "a node without an entry must branch"
        else:
            entries += 1
            assert node.entry.key_len == depth
    assert entries == len(pc)


keys = st.lists(st.integers(0, 3), min_size=0, max_size=7).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), keys, st.integers(0, 60)),
        st.tuples(st.just("lookup"), keys, st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 120), max_entries=st.integers(0, 6), workload=ops)
def test_random_workload_matches_reference_and_stays_in_budget(
    budget: int, max_entries: int, workload: Sequence[tuple[str, tuple[int, ...], int]]
) -> None:
    pc = make_cache(max_bytes=budget, max_entries=max_entries)
    ref = _Reference(budget, max_entries)
    for step, (op, key, nbytes) in enumerate(workload):
        if op == "insert":
            assert pc.insert(list(key), fake(step), nbytes=nbytes) == ref.insert(key, nbytes, step)
            s = pc.stats()
            assert s.bytes <= budget and s.entries <= max_entries
            assert s.bytes == sum(e[1] for e in ref.entries)
            assert s.entries == len(ref.entries)
            check_trie_invariants(pc)
        else:
            hit = pc.lookup(list(key))
            want = ref.lookup(key)
            assert (None if hit is None else hit.cache[0]) == want
            if hit is not None:
                assert list(key[: hit.key_len]) + hit.remaining == list(key)
                assert hit.remaining


def test_real_snapshot_hit_continues_like_a_full_prefill() -> None:
    model = llama_model()
    prompt = [(5 * i + 1) % 256 for i in range(40)]
    live = model.make_cache()
    model(mx.array([prompt[:30]]), cache=live)
    snapshot = copy_cache(live)
    pc = PrefixCache(max_bytes=10**8, max_entries=4)
    with pytest.raises(ValueError, match="holds 30 tokens"):
        pc.insert(prompt[:29], snapshot)
    assert pc.insert(prompt[:30], snapshot)
    assert pc.stats().bytes == cache_nbytes(snapshot)

    hit = pc.lookup(prompt)
    assert hit is not None and hit.key_len == 30 and hit.remaining == prompt[30:]
    assert hit.cache[0] is not snapshot[0]
    warm = model(mx.array([hit.remaining]), cache=hit.cache)[:, -1, :]
    cold = model(mx.array([prompt]), cache=model.make_cache())[:, -1, :]
    assert mx.allclose(warm, cold, atol=1e-4).item()
    assert mx.argmax(warm).item() == mx.argmax(cold).item()

    again = pc.lookup(prompt)  # the first hit's writes did not reach the entry
    assert again is not None and again.cache[0].offset == 30
    warm_again = model(mx.array([again.remaining]), cache=again.cache)[:, -1, :]
    assert mx.array_equal(warm_again, warm).item()


def test_take_hands_a_superseded_leaf_over_without_copying() -> None:
    copies: list[Any] = []

    def counting_copy(snapshot: list[Any]) -> list[Any]:
        copies.append(snapshot)
        return list(snapshot)

    pc = PrefixCache(10**9, 64, copy=counting_copy, offset=None)
    stored = fake("turn-1")
    pc.insert([1, 2, 3], stored, nbytes=10)
    hit = pc.lookup([1, 2, 3, 4, 5], take=True)
    assert hit is not None and hit.taken and hit.cache is stored
    assert (hit.key_len, hit.remaining) == (3, [4, 5])
    assert copies == [] and len(pc) == 0 and pc.nbytes == 0
    s = pc.stats()
    assert (s.hits, s.taken, s.tokens_reused) == (1, 1, 3)


def test_take_shares_an_entry_that_others_branch_from() -> None:
    pc = make_cache()
    pc.insert([1, 2, 3, 4, 5], fake("a"), nbytes=1)
    pc.insert([1, 2, 3, 7, 8], fake("b"), nbytes=1)
    pc.insert([1, 2, 3], fake("system"), nbytes=1)
    hit = pc.lookup([1, 2, 3, 9, 9], take=True)  # the branch point stays for the others
    assert hit is not None and not hit.taken and hit.cache == ["system"]
    assert len(pc) == 3 and pc.stats().taken == 0
    # A trimmable entry used only in part is shared (and trimmed), never taken.
    trimmed = PrefixCache(10**9, 64)
    live = llama_model().make_cache()
    logits = llama_model()(mx.array([[5, 6, 7, 8]]), cache=live)
    mx.eval(logits)
    trimmed.insert([5, 6, 7, 8], copy_cache(live))
    part = trimmed.lookup([5, 6, 9, 9], take=True)
    assert part is not None and not part.taken and part.key_len == 2
    assert len(trimmed) == 1
