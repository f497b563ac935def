"""What a driver hands the engine (``SaveRequest``, ``LoadRequest``), what it gets back
(``Finished``), and the jobs the lanes run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from kvstride.layout import ComingReads
from kvstride.transfer import CopyEvents, StagedBatch


@dataclass
class SaveRequest:
    """Tokens computed so far for a request, its block tables and this step's hand-offs."""

    req_id: str
    block_hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    num_tokens: int
    handoffs: Sequence[Tuple[int, int, int]] = ()  # (group, block_id, boundary)
    # The boundaries whose window tails are kept (SEMANTICS §8, ``KeyPlanner.hit_boundaries``);
    # None keeps every window tail (dense).
    boundaries: Optional[Sequence[int]] = None


@dataclass
class LoadRequest:
    """Load a hit of ``hit_tokens`` into the destination block tables ``block_ids``."""

    req_id: str
    block_hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    hit_tokens: int
    local_tokens: int = 0


@dataclass
class Finished:
    """What completed since the last ``get_finished``."""

    loads_done: set = field(default_factory=set)  # req ids whose load completed (ok or not)
    loads_failed: Dict[str, set] = field(default_factory=dict)  # req id -> failed (group, block_id)
    saves_done: set = field(default_factory=set)  # req ids whose save job finished: blocks free
    saves_failed: set = field(default_factory=set)  # req ids with a put that did not succeed
    saves_deferred: set = field(default_factory=set)  # req ids with puts left to a later step
    jobs_done: Dict[int, str] = field(default_factory=dict)  # planned save job id -> "ok", "failed" or "deferred"


class _RequestState:
    """A request's saved offsets: ``offset`` is confirmed (every put below it succeeded),
    ``planned`` is where the next save plan starts (puts in flight included). A job captures
    the object at submit time, so a save or a load that completes after ``finish_request``
    updates a detached object (never a later request that reuses the id, and never a leaked
    entry)."""

    __slots__ = ("offset", "planned", "ahead")

    def __init__(self) -> None:
        self.offset = 0
        self.planned = 0
        self.ahead: List[Tuple[int, int]] = []  # saved ranges above ``offset``, past a gap

    def loaded(self, planner, hit_tokens: int) -> None:
        """A load of ``hit_tokens`` succeeded: that prefix is in the store, so the request's
        saves start where the core says a save after that load starts."""
        done_to = planner.saved_offset_after_load(hit_tokens)
        self.confirm(0, done_to)
        self.planned = max(self.planned, done_to)

    def save_ended(self, start: int, end: int, ok: bool) -> None:
        """A save of ``[start, end)`` ended: stored (``ok``), or not all of it (failed, or left
        to a later step), when the next plan starts again from the confirmed offset."""
        if ok:
            self.confirm(start, end)
        else:
            self.planned = self.offset

    def confirm(self, start: int, end: int) -> None:
        """A save of ``[start, end)`` succeeded: ``offset`` moves across contiguous successes
        only, so a deferred or failed range below a later success stays below it and is planned
        again (from ``offset``); the later success counts once the gap is filled."""
        if start > self.offset:
            self.ahead.append((start, end))
            return
        self.offset = max(self.offset, end)
        self.ahead.sort()
        while self.ahead and self.ahead[0][0] <= self.offset:
            self.offset = max(self.offset, self.ahead.pop(0)[1])


@dataclass
class _LoadJob:
    step: int
    loads: List[LoadRequest]
    states: List[Optional[_RequestState]]  # one per load, captured at submit (None: planned elsewhere)
    after: object = None  # CUDA: an event on the caller's stream that the scatters follow
    planned: Optional[Dict[str, List[Tuple[str, int, int]]]] = None  # req id -> its gets, planned elsewhere
    deadline: float = float("inf")  # time.monotonic() past which its loads are reported failed
    abandoned: bool = False  # reported failed at its deadline: nothing of it may reach a KV block
    scattering: bool = False  # copying into KV blocks now: not abandoned until that ends


@dataclass
class _SaveJob:
    """A step's saves. Their blocks are copied out of the KV cache before ``submit`` returns,
    batch by batch; the save lane puts each batch (``_PutBatch``)."""

    step: int
    saves: List[SaveRequest]
    states: List[_RequestState]  # one per save
    ends: List[int]  # the save end of each save
    starts: List[int] = field(default_factory=list)  # where each save's plan started (its planned offset)
    owners: Dict[str, List[str]] = field(default_factory=dict)  # key -> req ids waiting for it
    failed: set = field(default_factory=set)  # req ids with a put that failed or was refused
    deferred: set = field(default_factory=set)  # req ids with puts left to a later step
    tail_keys: set = field(default_factory=set)  # keys only partial tails name
    in_flight: int = 0  # batches handed to the save lane and not put yet
    staging: bool = True  # submit is still copying batches
    job_id: Optional[int] = None  # a save job planned elsewhere (its owners are this id)
    # Groups whose blocks the caller fences itself (``OffloadEngine.fence``) before writing them
    # again; the caller's stream waits at once for the reads of every other group's blocks.
    fenced_groups: frozenset = frozenset()


@dataclass
class _PutBatch:
    """One staged batch of a save job, for the save lane to put and release."""

    job: _SaveJob
    entries: List[Tuple[str, int, int]]  # (key, group, block_id)
    batch: StagedBatch
    copied: CopyEvents  # its gather's


@dataclass
class _Launch:
    """A save job's device copies of blocks the caller fences itself, for the launch lane to
    launch after ``after`` (an event of the caller's stream), unless a fence cancelled them
    (``coming``: the reads the layout's pending reads expect)."""

    job: _SaveJob
    entries: List[Tuple[str, int, int]]
    after: object
    coming: ComingReads


@dataclass
class _DirectFinish:
    """A save job's copies into a store that copies blocks itself, still running on the
    device: the save lane calls ``finish`` (waits for them, keeps digests) and counts them."""

    job: _SaveJob
    entries: List[Tuple[str, int, int]]
    finish: object  # () -> statuses
    started: float  # time.perf_counter() of the copies' start


_STOP = object()
