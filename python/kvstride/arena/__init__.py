"""The embedded store across vLLM's processes: the scheduler owns the index, the workers own the
bytes.

vLLM runs the scheduler (EngineCore) and the model runners (Workers, one per TP rank) in
separate processes. The bytes of offloaded blocks stay with the workers, each rank its own
shard, in one preallocated :class:`HostArena` of fixed-size slots. The scheduler keeps a
:class:`SlotIndex` of which key lives in which slot and decides every allocation and eviction
itself, so it answers lookups without asking a worker, and a hit it reports is always servable:

- a key becomes visible to lookups only after every rank reported its slot written;
- the slots of a load are pinned from the step that plans it until its completion comes back,
  and eviction never takes a pinned or a still-being-written slot;
- all of it happens on the scheduler's own thread (lookup, allocation and eviction are never
  interleaved with each other), and workers never evict on their own.

Both sides derive the slot count from the same configuration (``slots_for``), so slot ids mean
the same in every process. Each slot keeps the XXH3 digest of the value written into it; a
load checks it before scattering, and a mismatch fails the load (vLLM recomputes).

One copy each way: a save copies block pieces from the KV cache straight into the slot, a
load from the slot straight into the destination blocks (raw region copies in the Rust core,
GIL released, spread over cores for large batches; a torch path for device tensors).

Split by side: :mod:`.index` (the scheduler's :class:`SlotIndex`, and :class:`ArenaPlacement`,
the store placement the connector's scheduler side plans through) and :mod:`.slots` (the
workers' :class:`HostArena`, and :class:`ArenaSlots`, the store a worker's engine copies blocks
into and out of on its lanes).
"""

from kvstride.arena.index import ALIGN, ArenaPlacement, SlotIndex, slots_for
from kvstride.arena.slots import VALUE_GROUP, ArenaSlots, HostArena

__all__ = ["SlotIndex", "ArenaPlacement", "HostArena", "ArenaSlots", "slots_for", "ALIGN", "VALUE_GROUP"]
