"""What the scheduler-side connector sends its workers each step, and what they send back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from kvstride.stores.placement import Entry

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["KVStrideMetadata", "KVStrideWorkerMetadata", "JOB_REPORTS"]

#: One rank's report of a save job, by the job's outcome there.
JOB_REPORTS = {"ok": [1, 0, 0], "failed": [0, 1, 0], "deferred": [0, 0, 1]}


@dataclass
class KVStrideMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: the entries ``(key or slot, group, block id)`` to load
    and to save, per TP rank (``kvstride.stores.placement.EVERY_RANK``: every rank's),
    planned and placed on the scheduler. Its size is the blocks that move, whatever the
    context length."""

    failed_loads: List[str] = field(default_factory=list)  # claimed hits no load could be planned for
    finished_tails: List[str] = field(default_factory=list)  # finished req ids saved this step
    loads: Dict[str, Dict[int, List[Entry]]] = field(default_factory=dict)  # req id -> TP rank -> gets
    saves: Dict[int, Dict[int, List[Entry]]] = field(default_factory=dict)  # save job id -> TP rank -> puts
    save_tails: Dict[int, List[str]] = field(default_factory=dict)  # save job id -> keys only a partial tail names
    # The embedded store's disk tier, every rank alike: write-through job id -> (slot, record,
    # key); req id -> the (record, slot, key, group) its load reads into slots first.
    disk_writes: Dict[int, List[Tuple[int, int, str]]] = field(default_factory=dict)
    disk_cancelled: List[int] = field(default_factory=list)  # write-through jobs given up: not to begin
    disk_reads: Dict[str, List[Tuple[int, int, str, int]]] = field(default_factory=dict)
    # req id -> seconds its reads may take before it recomputes (at most load_timeout_s)
    disk_read_deadlines: Dict[str, float] = field(default_factory=dict)
    # Block ids the step's scheduling allocated anew, those its loads write included (any group;
    # None: unknown, every block): saves still reading one are waited for before the step's
    # forward or loads may write it.
    allocated: Optional[List[int]] = field(default_factory=list)


@dataclass
class KVStrideWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per save job, [ranks that wrote it, ranks that failed, ranks that
    left some of it to a later step] (``JOB_REPORTS``); what this rank's loads found
    corrupted that the scheduler's placement must forget (the arena's slots); per disk
    write-through job, [ranks that wrote it, ranks that failed]; the disk records this rank's
    reads rejected; and per load from disk, [ranks whose reads passed the load's deadline,
    ranks whose late reads have ended since] (its slots are written until they all ended); per
    TP rank whose store was disabled or came back since its last report, whether it is disabled;
    [records read from the disk tier, the seconds its read lane took, records written to it, the
    seconds its write lane took], summed over ranks."""

    saves: Dict[int, List[int]] = field(default_factory=dict)
    corrupt: List = field(default_factory=list)
    disk: Dict[int, List[int]] = field(default_factory=dict)
    disk_corrupt: List[int] = field(default_factory=list)
    disk_late: Dict[str, List[int]] = field(default_factory=dict)
    store_disabled: Dict[int, bool] = field(default_factory=dict)
    disk_paces: List[float] = field(default_factory=lambda: [0, 0.0, 0, 0.0])

    def aggregate(self, other: "KVStrideWorkerMetadata") -> "KVStrideWorkerMetadata":
        return KVStrideWorkerMetadata(_summed(self.saves, other.saves, 3), self.corrupt + other.corrupt,
                                      _summed(self.disk, other.disk, 2), self.disk_corrupt + other.disk_corrupt,
                                      _summed(self.disk_late, other.disk_late, 2),
                                      {**self.store_disabled, **other.store_disabled},
                                      [a + b for a, b in zip(self.disk_paces, other.disk_paces)])


def _summed(mine: Dict, theirs: Dict, width: int) -> Dict:
    merged = {job: list(counts) for job, counts in mine.items()}
    for job, counts in theirs.items():
        into = merged.setdefault(job, [0] * width)
        for i, n in enumerate(counts):
            into[i] += n
    return merged
