"""kvstride.arena: the scheduler's SlotIndex (never a hit some rank cannot serve) and the
workers' HostArena (one copy each way, verified by digest) on real torch KV tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstride import _core
from kvstride.arena import HostArena, SlotIndex, slots_for
from kvstride.capacity import PrefixOrder, prefill_per_byte
from kvstride.layout import KVLayout

NUM_BLOCKS = 64


# ---- SlotIndex ------------------------------------------------------------------------------


def test_keys_are_readable_only_after_confirmation():
    index = SlotIndex(4)
    (slot,) = index.reserve(["a"])
    assert index.exists(["a"]) == [False] and index.known(["a"]) == [True]
    assert index.pin(["a"]) is None  # a load can never be planned on a slot being written
    index.confirm(["a"])
    assert index.exists(["a"]) == [True] and index.pin(["a"]) == [slot]


def test_eviction_takes_the_least_recently_used_unpinned_ready_key():
    index = SlotIndex(3)
    for key in "abc":
        index.reserve([key])
        index.confirm([key])
    pinned = index.pin(["a"])  # a load in flight, and a is now the most recently used
    (slot,) = index.reserve(["d"])
    assert index.exists(list("abc")) == [True, False, True] and index.evictions == 1
    index.reserve(["e"])  # c goes next: a is pinned
    assert index.exists(list("ac")) == [True, False]
    # Nothing evictable: a pinned, d and e being written.
    assert index.reserve(["f"]) == [None]
    index.unpin(pinned)
    assert index.reserve(["f"]) != [None] and index.exists(["a"]) == [False]
    assert slot is not None


def test_eviction_takes_the_least_recent_prefix_from_its_deepest_block():
    """With ranks (the stamp of the request that wrote a key, the tokens its block ends at), a
    request's head written first is still evicted last: what stays of it is a prefix. A load
    (``pin`` with a new stamp) makes a prefix the most recent."""
    index = SlotIndex(5)
    old, new = index.stamp(), index.stamp()
    for depth in (16, 32, 48):  # one block a step, the head first
        key = f"old@{depth}"
        index.reserve([key], {key: (old, depth)})
        index.confirm([key])
    fresh = {f"new@{d}": (new, d) for d in (16, 32)}
    index.reserve(list(fresh), fresh)
    index.confirm(list(fresh))
    index.reserve(["x"])
    assert index.exists(["old@16", "old@32", "old@48"]) == [True, True, False]
    index.unpin(index.pin(["old@16", "old@32"], index.stamp()))  # a load of old's prefix
    index.reserve(["y"])  # new is now the least recent: its deepest block goes
    assert index.exists(["new@16", "new@32", "old@16", "old@32"]) == [True, False, True, True]
    assert index.keys()[0] == "new@16" and index.evictions == 2


def test_a_prefix_loaded_again_outlives_one_off_prompts_then_ages_out():
    """GreedyDual with frequency: a key read by loads ranks above keys only written once after
    it, while the clock (the level of each evicted key) has not passed it."""
    index = SlotIndex(4)
    index.reserve(["hot"])
    index.confirm(["hot"])
    for _ in range(2):  # two loads of it
        index.unpin(index.pin(["hot"], index.stamp()))
    one_offs = [f"once{i}" for i in range(12)]
    for i, key in enumerate(one_offs):
        index.reserve([key])
        index.confirm([key])
        if i == 3:  # four one-off prompts written after its last load: plain LRU loses it here
            assert index.exists(["hot", "once0"]) == [True, False]
    assert index.exists(["hot"]) == [False]  # never read again: it ages out


def test_a_long_prompt_outlives_a_short_one_written_after_it():
    """GreedyDual-Size: a key's level is scaled by its request's worth (the prefill a hit saves
    per byte), so a short prompt's keys go before those of an older, longer one; a read raises
    a key's worth to its reader's, so a worthier reader's prefix is never evicted before the
    blocks it extends it with."""
    index = SlotIndex(8)
    long_prompt, short_prompt = index.stamp(), index.stamp()
    ranks = {"long16": (long_prompt, 16, 3.0), "long32": (long_prompt, 32, 3.0), "short16": (short_prompt, 16, 1.5)}
    index.confirm([key for key, slot in zip(ranks, index.reserve(list(ranks), ranks)) if slot is not None])
    assert index.keys() == ["short16", "long32", "long16"]
    reader = index.stamp()
    index.unpin(index.pin(["short16"], reader, 9.0))  # a far worthier request loads it ...
    index.reserve(["reader32"], {"reader32": (reader, 32, 9.0)})  # ... and extends it
    index.confirm(["reader32"])
    assert index.keys() == ["long32", "long16", "reader32", "short16"]


def test_worth_weighs_prefill_saved_per_byte_against_the_mean():
    """A hit at a prompt's end saves its tokens and loads its boundary set: every attention
    block, the window's tail. Longer prompts save more per byte; the worth is relative to the
    mean of the values seen."""
    groups = [_core.GroupSpec("full_attention", 16), _core.GroupSpec("sliding_window", 16, window=32)]
    planner = _core.KeyPlanner(groups, hash_block_size=16, scheduler_block_size=16, namespace="ns")
    short, long = prefill_per_byte(planner, 70, [1, 1]), prefill_per_byte(planner, 170, [1, 1])
    assert (short, long) == (64 / (4 + 2), 160 / (10 + 2))  # 64 and 160 tokens (the alignment)
    assert prefill_per_byte(planner, 15, [1, 1]) == 0.0  # nothing to hit
    assert prefill_per_byte(planner, 170, [2, 1]) == 160 / (2 * 10 + 2)  # bytes per group's value
    order = PrefixOrder(value_weight=0.5)
    assert order.worth(short) == 1.5  # the first value is the mean
    assert order.worth(long) == pytest.approx(1 + 0.5 * long / ((short + long) / 2))
    assert order.worth(0.0) == 1.0 and PrefixOrder(value_weight=0).worth(long) == 1.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="value_weight"):
            PrefixOrder(value_weight=bad)


def test_touching_keys_again_and_again_does_not_grow_the_index():
    """Every touch re-ranks a key; the superseded heap entries are dropped once they are most of
    the heap, so an arena that hits often and never fills holds O(keys)."""
    index = SlotIndex(8)
    index.reserve(list("abcd"))
    index.confirm(list("abcd"))
    for _ in range(5000):
        index.touch(list("abcd"))
    assert index.order.heap_entries <= 2 * 4 + 1024 + 1
    index.reserve(list("efgh") + ["i"])  # the order survived the rebuilds: a, first in every touch, goes
    assert index.exists(list("abcd")) == [False, True, True, True]


def test_abandoned_writes_free_their_slot():
    index = SlotIndex(1)
    (slot,) = index.reserve(["a"])
    index.abandon(["a"])
    assert index.known(["a"]) == [False] and index.reserve(["b"]) == [slot]


def test_clear_waits_for_work_in_flight():
    index = SlotIndex(2)
    index.reserve(["a"])
    assert not index.clear()
    index.confirm(["a"])
    assert index.clear() and index.exists(["a"]) == [False] and len(index.reserve(["x", "y"])) == 2


def test_slot_count_is_the_same_everywhere_and_refuses_a_useless_budget():
    assert slots_for(1 << 20, 1000) == (1 << 20) // 1024
    with pytest.raises(ValueError, match="store_bytes"):
        slots_for(100, 1000)


# ---- HostArena ------------------------------------------------------------------------------


def _layout():
    """An attention group (blocks-first) and a Mamba group (conv + SSM state), hybrid-style."""
    kv = {
        "attn": torch.randn(NUM_BLOCKS, 2, 16, 8).to(torch.bfloat16),
        "mamba": [torch.randn(NUM_BLOCKS, 3, 8).to(torch.float16), torch.randn(NUM_BLOCKS, 2, 16)],
    }
    return kv, KVLayout(kv, [["attn"], ["mamba"]])


def _block(kv, name, b) -> bytes:
    value = kv[name]
    tensors = [value] if isinstance(value, torch.Tensor) else value
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("copier", ["regions", "device"])
def test_blocks_round_trip_through_slots(copier):
    kv, layout = _layout()
    arena = HostArena(layout, 8, copier=copier)
    assert arena.nbytes == 8 * arena.slot_bytes and arena.slot_bytes % 64 == 0
    before = {(n, b): _block(kv, n, b) for n in ("attn", "mamba") for b in (3, 4, 9)}
    arena.save([5, 0, 7], [0, 0, 1], [3, 4, 9])
    for t in (kv["attn"], *kv["mamba"]):
        t.zero_()
    ok = arena.load([0, 5, 7, 7], [0, 0, 1, 1], [10, 11, 12, 13])
    assert ok.all()
    assert _block(kv, "attn", 10) == before[("attn", 4)] and _block(kv, "attn", 11) == before[("attn", 3)]
    assert _block(kv, "mamba", 12) == before[("mamba", 9)] == _block(kv, "mamba", 13)
    assert _block(kv, "attn", 1) == bytes(len(before[("attn", 3)]))  # nothing else written


def test_a_corrupted_or_foreign_slot_is_never_scattered():
    kv, layout = _layout()
    arena = HostArena(layout, 4)
    arena.save([0, 1], [0, 1], [1, 2])
    arena.buffer[5] ^= 0xFF  # a byte of slot 0 changed after the save
    kv["attn"][20].zero_()
    ok = arena.load([0, 1, 2, 1], [0, 1, 0, 0], [20, 21, 22, 23])
    # corrupted; fine; never written; holds another group's value
    assert ok.tolist() == [False, True, False, False]
    assert _block(kv, "attn", 20) == bytes(len(_block(kv, "attn", 20)))


def test_bad_entries_are_refused_before_any_copy():
    _, layout = _layout()
    arena = HostArena(layout, 4)
    with pytest.raises(ValueError, match="slot out of range"):
        arena.save([4], [0], [1])
    with pytest.raises(ValueError, match="block id out of range"):
        arena.save([0], [1], [NUM_BLOCKS])
    with pytest.raises(ValueError, match="group 2 out of range"):
        arena.load([0], [2], [1])


def test_resident_bytes_stay_within_the_budget():
    """The arena is one allocation of ``slots × slot`` bytes, touched at construction; saves
    and loads allocate nothing per value (measured as the process's resident set)."""
    import os

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    _, layout = _layout()
    budget = 256 << 20
    slot = -(-max(g.block_bytes for g in layout.groups) // 64) * 64
    before = resident()
    arena = HostArena(layout, slots_for(budget, slot))
    assert arena.nbytes <= budget
    assert resident() - before >= 0.99 * arena.nbytes  # touched up front: no faults later
    n = min(arena.num_slots, NUM_BLOCKS - 1)
    for _ in range(3):
        arena.save(np.arange(n), np.zeros(n, dtype=np.int64), np.arange(1, n + 1))
        arena.load(np.arange(n), np.zeros(n, dtype=np.int64), np.arange(1, n + 1))
    grown = resident() - before
    assert grown <= budget * 1.01 + (8 << 20), grown  # + the interpreter's own noise


def test_a_corrupted_slot_is_forgotten_and_freed_after_its_last_load():
    index = SlotIndex(2)
    index.reserve(["a", "b"])
    index.confirm(["a", "b"])
    (slot,) = index.pin(["a"])
    index.drop_slots([slot])
    assert index.exists(["a", "b"]) == [False, True]
    index.pin(["b"])
    assert index.reserve(["c"]) == [None]  # a's slot is still being read, b's pinned
    index.unpin([slot])
    assert index.reserve(["d"]) == [slot]
