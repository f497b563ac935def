"""Where a step's saves and loads go, decided on vLLM's scheduler (the one planning point):
the store layer's scheduler-side surface, so the connector's scheduler side plans every store
the same way and never asks which store it has.

A placement turns the keys the core planned into the entries workers execute, per TP rank::

    exists(keys) -> list[bool]           readable by a load now (lookups)
    knows_contents                       True where the scheduler holds the index (the arena),
                                         which then answers without a round trip
    known(keys) -> list[bool]            (only then) a save need not write them (stored, or
                                         being written)
    version                              (only then) moves whenever exists() could answer
                                         otherwise: a lookup's answer stands until it moves
    ranks_evictions                      True where the placement evicts (the arena's SlotIndex):
                                         it takes an eviction order, and then has
    stamp() -> int                       a recency stamp newer than every one before
    worth(value) -> float                a request's worth in the eviction order from the
                                         prefill its hit saves per byte (capacity.prefill_per_byte)
    place_saves(per_rank, ranks) -> (entries by rank, keys placed, keys refused for want of room);
                                         ranks: None, or key -> (stamp, depth, worth), the
                                         eviction order
    saves_done(keys, ok)                 every rank reported a save job (ok: all wrote it)
    place_load(req_id, per_rank, stamp, worth) -> entries by rank, or None when the hit is gone
    load_done(req_id, ok)                the workers reported the load (ok: every rank loaded it)
    forget_corrupt(items)                what a worker's load found corrupted
    reset() -> bool | None               ``reset_prefix_cache(reset_connector=True)``

An entry is ``(key or slot, group, block id)``; ``EVERY_RANK`` names the list every rank
executes. :class:`StorePlacement` is a store every rank calls itself (Mooncake);
``kvstride.arena.ArenaPlacement`` is the embedded store's slot index.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["EVERY_RANK", "StorePlacement", "Entry", "rank_entries"]

log = logging.getLogger("kvstride.stores")

#: The rank key of entries that every rank executes (the arena: the same slots on every rank).
EVERY_RANK = -1

#: ``(key or slot, group, block id)``.
Entry = Tuple[object, int, int]


def rank_entries(by_rank: Dict[int, List[Entry]], rank: int) -> List[Entry]:
    """One rank's entries of a placement's ``{rank: entries}``."""
    entries = by_rank.get(rank)
    return by_rank.get(EVERY_RANK, []) if entries is None else entries


class StorePlacement:
    """A store each rank reads and writes under its own keys (Mooncake): entries go out as
    the core planned them, and what is stored is the store's to say."""

    def __init__(self, store) -> None:
        self.store = store
        self._reset_logged = False

    def exists(self, keys: Sequence[str]) -> List[bool]:
        return self.store.exists(keys)

    knows_contents = False  # the store says, one round trip a call
    ranks_evictions = False  # Mooncake evicts by itself

    def place_saves(self, per_rank: List[List[Entry]], ranks=None):
        keys = [key for entries in per_rank for key, _, _ in entries]
        return dict(enumerate(per_rank)), keys, []

    def saves_done(self, keys: Sequence[str], ok: bool) -> None:
        """Nothing to do: a put that failed left nothing readable."""

    def saves_abandoned(self, keys: Sequence[str]) -> list:
        """Nothing held: each rank's puts go through its own staging, never a shared slot."""
        return []

    def abandoned_saves_ended(self, held) -> None:
        """Nothing was held."""

    def place_load(self, req_id: str, per_rank: List[List[Entry]], stamp=None, worth=1.0) -> Optional[Dict[int, List[Entry]]]:
        return dict(enumerate(per_rank))

    def load_done(self, req_id: str, ok: bool = True) -> None:
        """Nothing pinned: a value evicted under a load is a failed get, recomputed."""

    def forget_corrupt(self, items) -> None:
        """Nothing to do: the store removed a corrupted value when a get found it."""

    def reset(self) -> bool:
        """A shared store is not cleared by one of its engines: False."""
        if not self._reset_logged:
            self._reset_logged = True
            log.warning(
                "kvstride: reset_connector cannot clear the Mooncake store, other engines share it; "
                "to drop what it holds use another cache_prefix or restart its holder (logged once)"
            )
        return False
