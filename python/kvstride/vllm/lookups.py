"""The scheduler's lookups: when the store is asked about a waiting request, and what is kept
of its answer (the core computes the hit, SEMANTICS §6; this module decides when to ask).

vLLM asks ``get_num_new_matched_tokens`` about the head of its waiting queue every step, and
about every request a scheduling pass reaches. While the head cannot be allocated (KV memory
full: exactly when offload matters) it asks about the head again each step. So a hit, once
asked, stands while the store's content for it cannot have changed:

- the embedded store's index lives here: a hit stands while the index's ``version`` is the one
  it was computed at; then only the request vLLM asked about is asked again (an in-process
  call: batching saves nothing);
- a shared store (Mooncake) costs a round trip: the asked request's call also covers requests
  waiting behind it without a standing hit, up to ``LOOKUP_BATCH_TOKENS`` tokens and
  ``max_num_seqs`` requests; a hit stands ``REMOTE_HIT_VALIDITY_S`` (what other engines write
  is seen after at most that long), and keys this engine wrote since are merged into it
  without a call.

What the store held at a request's lookup is kept as a bitmap over the core's lookup keys
(one bit per key) and expanded to key strings only when the request's saves ask which keys
need no put.

With the embedded store's disk tier, a hit that needs keys only on disk is claimed only when
the placement's read admission (:mod:`kvstride.arena.read_admission`) weighs the reads its load
makes as worth waiting for against vLLM computing their tokens; else the hit is what memory
alone serves (the core computes both hits, and which keys the load reads).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np

__all__ = ["Lookups", "REMOTE_HIT_VALIDITY_S", "LOOKUP_BATCH_TOKENS", "WRITTEN_MEMORY"]

#: How long a shared store's answer stands for a request still waiting.
REMOTE_HIT_VALIDITY_S = 1.0

#: Tokens of other waiting requests one shared-store call may cover besides the asked one's.
LOOKUP_BATCH_TOKENS = 16384

#: Keys this engine's save jobs wrote, remembered (the oldest forgotten first) so that a request
#: whose lookup came before they were written neither misses them nor puts them again: about
#: 20 MiB.
WRITTEN_MEMORY = 1 << 17


@dataclass
class _Answer:
    """The store's answer about one request."""

    hit: int
    num_hashes: int  # the request's block hashes at the lookup (the bitmap's keys' inputs)
    num_tokens: int
    bits: np.ndarray  # packed existence bitmap over planner.lookup_keys
    count: int  # keys in the bitmap
    version: Optional[int]  # the index version it was computed at (a store whose index is here)
    at: float  # when the store answered
    step: int  # the scheduler step of the lookup
    merged: int  # the step through which this engine's writes are merged into ``bits``


class Lookups:
    """Standing hits of waiting requests, found keys for their saves, and this engine's writes."""

    def __init__(self, engine, planner, placement, batch_requests: int,
                 clock: Callable[[], float] = time.monotonic,
                 planner_of: Optional[Callable[[object], object]] = None,
                 count: Callable[[str], None] = lambda name: None) -> None:
        self.engine = engine  # OffloadEngine: asks the store, the core computes the hit
        self.planner = planner
        # A request's own planner (kvstride.vllm.bindings), None for one never looked up
        self.planner_of = planner_of or (lambda request: planner)
        self.placement = placement
        self.batch_requests = max(1, int(batch_requests))
        self.clock = clock
        self.read_admission = getattr(placement, "read_admission", None)  # with a disk tier
        self.count = count  # the side's counters: disk_hits_declined
        self.step = 0
        self._answers: Dict[str, _Answer] = {}  # req id -> its last answer, while it is needed
        self._standing: set = set()  # req ids waiting whose answer still stands for their hit
        self._found: Dict[str, set] = {}  # req id -> the keys its lookup found, once a save asks
        self._written: "OrderedDict[str, int]" = OrderedDict()  # key -> the step its job was reported
        self._last_write = -1  # the last step a write was remembered in

    # ---- hits ---------------------------------------------------------------------------------

    def hit(self, request, waiting: Dict[str, object], skip: Callable[[str], bool], local_tokens: int = 0) -> int:
        """``request``'s hit: its standing answer, else the store's (for a shared store, in one
        call with requests waiting behind it that have none and are not ``skip``-ped).
        ``local_tokens``: what vLLM's own cache holds of it (a load reads none of those)."""
        rid = request.request_id
        if rid in self._standing:
            answer = self._answers[rid]
            if self._stands(answer):
                if self._last_write > answer.merged:
                    self._merge_written(rid, request, answer)
                return answer.hit
        planner = self.planner_of(request)
        if planner is None:  # its keys cannot be bound to its content: never looked up
            return 0
        batch = {rid: (request, planner)}
        if not self.placement.knows_contents:
            tokens = 0
            for other, r in waiting.items():
                if len(batch) >= self.batch_requests:
                    break
                if other in batch or skip(other) or (other in self._standing and self._stands(self._answers[other])):
                    continue
                other_planner = self.planner_of(r)
                if other_planner is None:
                    continue
                tokens += int(r.num_tokens)
                if tokens > LOOKUP_BATCH_TOKENS:
                    break
                batch[other] = (r, other_planner)
        version = getattr(self.placement, "version", None) if self.placement.knows_contents else None
        bitmaps: Dict[str, List[bool]] = {}
        requests = [(other, list(r.block_hashes), int(r.num_tokens), p) for other, (r, p) in batch.items()]
        hits = self.engine.lookup(requests, bitmaps)
        now = self.clock()
        for other, hashes, num_tokens, planner in requests:
            bitmap = bitmaps.get(other)
            if bitmap is None:  # the store did not answer: nothing stands
                self._standing.discard(other)
                continue
            if self.read_admission is not None and hits[other]:
                local = int(local_tokens) if other == rid else 0
                hits[other] = self._within_disk_pace(planner, hashes, num_tokens, bitmap, hits[other], local)
            # (A prompt shorter than one hash block has no key: an empty bitmap, of no dtype.)
            packed = np.packbits(np.asarray(bitmap, dtype=bool))
            self._answers[other] = _Answer(hits[other], len(hashes), num_tokens, packed, len(bitmap),
                                           version, now, self.step, self.step)
            self._found.pop(other, None)
            self._standing.add(other)
        return hits[rid]

    def _within_disk_pace(self, planner, hashes, num_tokens: int, bitmap: List[bool], hit: int,
                          local_tokens: int) -> int:
        """``hit``, or the hit memory alone serves when the read admission would not wait for
        the keys its load reads from disk (those the load of ``hit`` after ``local_tokens``
        gets and memory does not hold)."""
        if local_tokens >= hit:
            return hit
        in_memory = self.placement.index.exists(planner.lookup_keys(hashes, num_tokens))
        if all(here or not found for found, here in zip(bitmap, in_memory)):
            return hit
        memory_hit = planner.longest_hit_bitmap(hashes, num_tokens, [f and m for f, m in zip(bitmap, in_memory)])
        if memory_hit >= hit:
            return hit
        records = self._disk_reads(planner, hashes, num_tokens, hit, local_tokens)
        if not records or self.read_admission.claims(records, hit - max(memory_hit, local_tokens)):
            return hit
        self.count("disk_hits_declined")
        return memory_hit

    def _disk_reads(self, planner, hashes, num_tokens: int, hit: int, local_tokens: int) -> int:
        """How many values the load of ``hit`` after ``local_tokens`` reads from disk: the
        core's load plan (block tables standing in for those vLLM allocates later), less what
        memory holds."""
        H = planner.hash_block_size
        tables = [list(range(1, -(-num_tokens // (n * H)) + 1)) if n else [] for n in planner.hashes_per_block]
        keys = list({key for key, _, _ in planner.plan_load(hashes, tables, hit, local_tokens=local_tokens).gets})
        return sum(not here for here in self.placement.index.exists(keys))

    def _stands(self, answer: _Answer) -> bool:
        if self.placement.knows_contents:
            return answer.version == self.placement.version
        return self.clock() - answer.at < REMOTE_HIT_VALIDITY_S

    def _merge_written(self, rid: str, request, answer: _Answer) -> None:
        """Keys this engine wrote since ``answer`` are in the store: its hit grows without a call."""
        hashes = list(request.block_hashes)[: answer.num_hashes]
        planner = self.planner_of(request)
        keys = planner.lookup_keys(hashes, answer.num_tokens)
        bitmap = np.unpackbits(answer.bits, count=answer.count).astype(bool)
        written, since = self._written, answer.merged
        fresh = np.fromiter((written.get(k, -1) > since for k in keys), dtype=bool, count=len(keys))
        answer.merged = self.step
        if not (fresh & ~bitmap).any():
            return
        bitmap |= fresh
        answer.bits = np.packbits(bitmap)
        answer.hit = planner.longest_hit_bitmap(hashes, answer.num_tokens, bitmap.tolist())
        self._found.pop(rid, None)

    def allocated(self, rid: str) -> None:
        """vLLM allocated the request: its hit is spent (a preempted request is asked afresh);
        what its lookup found stays for its saves."""
        self._standing.discard(rid)

    def forget(self, rid: str) -> None:
        self._standing.discard(rid)
        self._answers.pop(rid, None)
        self._found.pop(rid, None)

    # ---- what a save need not put (a shared store) -------------------------------------------

    def is_known(self, key: str, rids: List[str], requests: Dict[str, object]) -> bool:
        """The store holds ``key``: a lookup of one of ``rids`` found it, or this engine wrote it
        after that lookup (reports come after the step's lookups: a later step's report is a
        write the lookup could not see)."""
        written = self._written.get(key)
        for rid in rids:
            answer = self._answers.get(rid)
            if key in self._found_keys(rid, answer, requests.get(rid)):
                return True
            if written is not None and written > (answer.step if answer is not None else -1):
                return True
        return False

    def _found_keys(self, rid: str, answer: Optional[_Answer], request) -> set:
        if answer is None or request is None:
            return set()
        found = self._found.get(rid)
        if found is None:
            hashes = list(request.block_hashes)[: answer.num_hashes]
            keys = self.planner_of(request).lookup_keys(hashes, answer.num_tokens)
            bitmap = np.unpackbits(answer.bits, count=answer.count)
            found = self._found[rid] = {k for k, b in zip(keys, bitmap) if b}
        return found

    def remember_written(self, keys: List[str]) -> None:
        """A save job every rank wrote (a shared store): its keys."""
        if self.placement.knows_contents or not keys:
            return
        for key in keys:
            self._written[key] = self.step
            self._written.move_to_end(key)
        self._last_write = self.step
        while len(self._written) > WRITTEN_MEMORY:
            self._written.popitem(last=False)

    def states(self) -> int:
        """Requests with anything kept here (tests: none once every request finished)."""
        return len(set(self._answers) | self._standing | set(self._found))
