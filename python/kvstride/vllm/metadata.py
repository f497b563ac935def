"""What the scheduler-side connector sends its workers each step, and what they send back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = ["ArenaCopy", "KVStrideMetadata", "KVStrideWorkerMetadata"]


@dataclass
class ArenaCopy:
    """Blocks to copy between the KV cache and arena slots: parallel lists, one entry per
    block. A load that the scheduler could not plan has ``failed`` set (the worker reports
    it, so vLLM recomputes the request)."""

    slots: List[int] = field(default_factory=list)
    groups: List[int] = field(default_factory=list)
    block_ids: List[int] = field(default_factory=list)
    failed: bool = False


#: One rank's report of a save job, by the job's outcome there.
JOB_REPORTS = {"ok": [1, 0, 0], "failed": [0, 1, 0], "deferred": [0, 0, 1]}

#: A store transfer: (key, group, block id).
Entry = Tuple[str, int, int]


@dataclass
class KVStrideMetadata(KVConnectorMetadata):
    """Scheduler -> workers, each step: what to copy and what to ask the store for, planned
    on the scheduler. Its size is the blocks that move, whatever the context length."""

    failed_loads: List[str] = field(default_factory=list)  # claimed hits no load could be planned for
    finished_tails: List[str] = field(default_factory=list)  # finished req ids saved this step
    arena_loads: Dict[str, ArenaCopy] = field(default_factory=dict)  # req id -> copy (embedded)
    arena_saves: Dict[int, ArenaCopy] = field(default_factory=dict)  # save job id -> copy (embedded)
    store_loads: Dict[str, Dict[int, List[Entry]]] = field(default_factory=dict)  # req id -> TP rank -> gets
    store_saves: Dict[int, Dict[int, List[Entry]]] = field(default_factory=dict)  # save job id -> TP rank -> puts


@dataclass
class KVStrideWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per save job, [ranks that wrote it, ranks that failed, ranks that
    left some of it to a later step] (``JOB_REPORTS``); and the arena slots whose value a load
    found corrupted (the scheduler forgets them)."""

    saves: Dict[int, List[int]] = field(default_factory=dict)
    corrupt_slots: List[int] = field(default_factory=list)

    def aggregate(self, other: "KVStrideWorkerMetadata") -> "KVStrideWorkerMetadata":
        merged = {job: list(counts) for job, counts in self.saves.items()}
        for job, counts in other.saves.items():
            into = merged.setdefault(job, [0, 0, 0])
            for i, n in enumerate(counts):
                into[i] += n
        return KVStrideWorkerMetadata(merged, self.corrupt_slots + other.corrupt_slots)
