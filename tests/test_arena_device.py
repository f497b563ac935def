"""The arena's device data path (``kvstride.arena.device``) on the KV layouts vLLM's CUDA backends
use, built as tensors: the same code as on a GPU, with CPU tensors (no streams). Its slots hold
exactly the bytes the Rust region copier writes, so either path reads the other's values; loads
restore blocks byte for byte, however a save or load is cut into staging chunks and slot runs.

The ordering of the device paths' launches, events and waits is checked on modelled CUDA streams
(``Streams``); the CUDA tests at the end (ordering against the caller's stream on a real device)
run wherever CUDA is present."""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest
import torch

import kvdata
from interpreted import run_under_triton_interpreter
from kvstride.arena import HostArena
from kvstride.arena.device import DeviceCopier, slot_runs
from kvstride.layout import KVLayout


def flashinfer_hnd(nb=12, bs=64, heads=4, dim=32, layers=2, dtype=torch.bfloat16):
    """FlashInfer's HND: (num_blocks, 2, heads, block, dim) in memory, viewed as NHD."""
    kv = {f"hnd.{i}": torch.empty(nb, 2, heads, bs, dim, dtype=dtype).permute(0, 1, 3, 2, 4) for i in range(layers)}
    return kv, [list(kv)]


def fp8_flash_attn(nb=12, bs=64, heads=4, dim=32, layers=2):
    kv = {f"fp8.{i}": torch.empty(2, nb, bs, heads, dim, dtype=torch.float8_e4m3fn) for i in range(layers)}
    return kv, [list(kv)]


def hybrid(nb=12):
    """Full attention + sliding window + Mamba state lists + a scratch ring, block size 64."""
    kv = {
        "fa.0": torch.empty(2, nb, 64, 2, 32, dtype=torch.bfloat16),
        "swa.0": torch.empty(nb, 2, 64, 2, 32, dtype=torch.bfloat16),
        "mamba.0": [torch.empty(nb, 4, 96, dtype=torch.bfloat16), torch.empty(nb, 2, 16, 32, dtype=torch.float32)],
        "ring.0": torch.empty(nb, 2, 4, 2, 32, dtype=torch.bfloat16),
    }
    return kv, [["fa.0"], ["swa.0"], ["mamba.0"], ["ring.0"]]


LAYOUTS = {
    "flash_attn_bs64": lambda: kvdata.flash_attn(nb=12, bs=64),
    "flashinfer_nhd": lambda: kvdata.blocks_first(nb=12, bs=64),
    "flashinfer_hnd": flashinfer_hnd,
    "mla": lambda: kvdata.mla(nb=12, bs=64),
    "fp8": fp8_flash_attn,
    "hybrid": hybrid,
    "mamba_raw_pages": kvdata.mamba_raw_pages,
}


def _entries(layout, count, seed):
    """``count`` (slot, group, block) entries: slots partly consecutive, partly scattered."""
    rng = np.random.default_rng(seed)
    slots = np.concatenate([np.arange(3, 3 + count // 2), rng.choice(np.arange(20, 40), count - count // 2, replace=False)])
    groups = rng.integers(0, len(layout.groups), count)
    blocks = np.array([rng.integers(0, layout.groups[g].num_blocks) for g in groups])
    return slots.astype(np.int64), groups.astype(np.int64), blocks.astype(np.int64)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("stage_slots", [1, 3, 64])
def test_device_path_matches_the_region_copier_byte_for_byte(name, stage_slots):
    kv, groups = LAYOUTS[name]()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed=1)
    device = HostArena(layout, 48, copier="device")
    device._device.chunk_slots = stage_slots
    regions = HostArena(layout, 48, copier="regions")
    slots, grps, blocks = _entries(layout, 10, seed=2)
    device.save(slots, grps, blocks)
    regions.save(slots, grps, blocks)
    assert _values(device, slots, grps) == _values(regions, slots, grps) and (device.digests == regions.digests).all()
    saved = _blocks(kv, groups, grps, blocks)
    for t in layout.storages:
        t.zero_()
    assert device.load(slots, grps, blocks).all()
    assert _blocks(kv, groups, grps, blocks) == saved


def _values(arena, slots, grps) -> list:
    """The bytes of each entry's value in its slot (a slot's bytes past its value are undefined)."""
    return [bytes(arena.buffer[s * arena.slot_bytes:s * arena.slot_bytes + int(arena.block_bytes[g])].numpy())
            for s, g in zip(slots, grps)]


def _blocks(kv, groups, grps, blocks) -> list:
    """Each entry's block bytes, tensor by tensor of its group's layers."""
    out = []
    for g, b in zip(grps, blocks):
        for name in groups[g]:
            for t in [kv[name]] if isinstance(kv[name], torch.Tensor) else kv[name]:
                out.append(bytes(kvdata.block_bytes_of(t.cpu(), int(b)).numpy()))
    return out


KERNELS_ON_CPU = r"""
import itertools
import numpy as np, torch
import kvdata
from test_arena_device import LAYOUTS, _blocks, _entries, _values
from kvstride.arena import HostArena
from kvstride import _core
from kvstride.arena.device import DeviceCopier, copy_rows
from kvstride.arena.device_xxh3 import launch_xxh3_rows
from kvstride.layout import KVLayout

src = torch.arange(16384, dtype=torch.int32).view(torch.uint8)
# Rows in elements: one longer than a tile, one short, one of a single element.
at, into, count = (np.array(x, dtype=np.uint64) for x in ([0, 3000, 64], [100, 0, 3100], [2500, 7, 1]))
for unit in (8, 4, 2, 1):
    dst = torch.zeros_like(src)
    base_src, base_dst = np.uint64(src.data_ptr()), np.uint64(dst.data_ptr())
    copy_rows(base_src + at * np.uint64(unit), base_dst + into * np.uint64(unit), count * np.uint64(unit),
              kernel_on=torch.device("cpu"), programs=2)
    want = torch.zeros_like(src)
    for a, b, n in zip(at * unit, into * unit, count * unit):
        want[int(b):int(b + n)] = src[int(a):int(a + n)]
    assert torch.equal(dst, want), unit

# XXH3 on the device: the host's digest for lengths around its block (1 KiB) and stripe (64 B) edges.
lengths = np.array([248, 256, 1000, 1016, 1024, 1032, 1088, 2048, 2056, 4160, 3080, 65536], dtype=np.uint64)
values = torch.randint(0, 256, (int(lengths.sum()) + 8 * len(lengths),), dtype=torch.uint8)
addresses = np.uint64(values.data_ptr()) + np.concatenate([[0], np.cumsum(lengths + np.uint64(8))[:-1]]).astype(np.uint64)
want = _core._xxh3_64_regions(addresses, lengths)
table = torch.from_numpy(np.stack([addresses, lengths]).view(np.int64))
digests = torch.zeros(len(lengths), dtype=torch.int64)
launch_xxh3_rows(values, table, 0, len(lengths), 0, 1, digests)
assert (digests.numpy().view(np.uint64) == want).all()
expected = torch.from_numpy(want.view(np.int64).copy())
expected[3] ^= 1
launch_xxh3_rows(values, table, 0, len(lengths), 0, 1, digests, expected=expected)
assert digests.tolist() == [int(i != 3) for i in range(len(lengths))]

hashed_layouts = 0
for (name, make), dma_runs in itertools.product(LAYOUTS.items(), (0, 8)):  # scattered slots: kernels only
    kv, groups = make()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed=1)
    regions, arena = HostArena(layout, 48, copier="regions"), HostArena(layout, 48, copier="regions")
    copier = DeviceCopier(layout, arena.buffer, arena.slot_bytes, arena._pieces, chunk_bytes=3 * arena.slot_bytes,
                          programs=5, kernels=True, dma_runs=dma_runs)
    slots, grps, blocks = _entries(layout, 10, seed=2)
    chunks, found = copier.save(slots, grps, blocks)
    assert [len(part) for part, _ in chunks] == [1, 3, 3, 2, 1] and found is None  # at most 3, the last ones smaller
    regions.save(slots, grps, blocks)
    assert _values(arena, slots, grps) == _values(regions, slots, grps), name
    if dma_runs:  # a few runs of slots: the save's drains are the copy engine's, one copy a run
        engine_arena, engine_regions = HostArena(layout, 48, copier="regions"), HostArena(layout, 48, copier="regions")
        DeviceCopier(layout, engine_arena.buffer, engine_arena.slot_bytes, engine_arena._pieces,
                     chunk_bytes=3 * engine_arena.slot_bytes, programs=5, kernels=True,
                     dma_runs=dma_runs).save(np.arange(5, 15), grps, blocks)
        engine_regions.save(np.arange(5, 15), grps, blocks)
        assert _values(engine_arena, np.arange(5, 15), grps) == _values(engine_regions, np.arange(5, 15), grps), name
    saved = _blocks(kv, groups, grps, blocks)
    saved_by_entry = [_blocks(kv, groups, grps[i:i + 1], blocks[i:i + 1]) for i in range(10)]
    for t in layout.storages:
        t.zero_()
    copied, _ = copier.load(slots, grps, blocks, check=lambda part: part % 4 != 1)
    assert (copied == (np.arange(10) % 4 != 1)).all(), name
    got = _blocks(kv, groups, grps, blocks)
    assert got != saved
    for t in layout.storages:
        t.zero_()
    copier.load(slots, grps, blocks, check=lambda part: np.ones(len(part), dtype=bool))
    assert _blocks(kv, groups, grps, blocks) == saved, name

    # Digests on the device: a save's are the host's XXH3 of the slots; a load checks them in
    # staging and leaves an entry whose slot was corrupted unwritten.
    copier.digests_on_device = True
    if not copier.hashes_on_device(grps):
        continue
    hashed_layouts += 1
    _, found = copier.save(slots, grps, blocks, digests=True)
    assert (found.numpy().view(np.uint64) == regions.digests[slots]).all(), name
    for t in layout.storages:
        t.zero_()
    arena.buffer[int(slots[2]) * arena.slot_bytes + 5] ^= 0xFF
    copied, _ = copier.load(slots, grps, blocks, check=None, expected=regions.digests[slots])
    assert (copied == (np.arange(10) != 2)).all(), name
    entries = [(int(g), int(b)) for g, b in zip(grps, blocks)]
    for i in range(10):
        mine = _blocks(kv, groups, grps[i:i + 1], blocks[i:i + 1])
        if i != 2:
            assert mine == saved_by_entry[i], (name, i)
        elif entries.count(entries[2]) == 1:
            assert all(not any(piece) for piece in mine), name  # never written
assert hashed_layouts >= 5, hashed_layouts

# Through the arena (what the connector's workers call): the digests it keeps from a save taken
# on the device are the host's, and its verified load leaves a corrupted slot's block alone.
kv, groups = LAYOUTS["hybrid"]()
layout = KVLayout(kv, groups)
kvdata.fill_random(layout.storages, seed=5)
host, device = HostArena(layout, 48, copier="regions"), HostArena(layout, 48, copier="regions")
device.copier, device._device = "device", DeviceCopier(layout, device.buffer, device.slot_bytes, device._pieces,
                                                       kernels=True, digests_on_device=True)
slots, grps, blocks = _entries(layout, 10, seed=6)
assert device._device.hashes_on_device(grps)


def host_digests(*args):
    raise AssertionError("the host hashed a slot")


device._digest = host_digests
host.save(slots, grps, blocks)
device.save(slots, grps, blocks)
assert (device.digests[slots] == host.digests[slots]).all()
device.buffer[int(slots[4]) * device.slot_bytes] ^= 1
assert (device.load(slots, grps, blocks) == (np.arange(10) != 4)).all()
print("ok")
"""


def test_the_copy_kernels_move_every_byte_and_nothing_else():
    """The CUDA copy kernels themselves, run by Triton's interpreter on CPU memory (the
    addresses are host addresses there): rows of each element width, longer and shorter than
    a tile; XXH3-64 on the device against the host's; the arena's saves and loads through them
    on every layout, chunked, byte for byte what the region copier writes, entries that fail
    their check (on the host, or on the device against their digests) left unwritten."""
    done = run_under_triton_interpreter(KERNELS_ON_CPU)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_kernels_compile_for_a_hopper_gpu_with_16_byte_accesses():
    """Each kernel compiled as a GPU would (offline, for sm_90; the interpreter accepts code the
    compiler may not): every variant builds, and the copies and the hash move 16 bytes a thread
    (Triton vectorizes only from a base it knows to be aligned: a regression is a slow copy)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvstride.arena.device import _kernels
    from kvstride.arena.device_xxh3 import WARPS, _kernel

    pointers = {"origin", "table", "pieces", "groups", "flags", "keys", "expected", "out"}
    copy_rows_kernel, copy_blocks_kernel = _kernels()
    copies = ("ld.global.v2.b64", "st.global.v2.b64")
    variants = [(copy_rows_kernel, {"W": 8, "VEC": 2, "TILE": 2048}, 4, copies)]
    variants += [(copy_blocks_kernel, {"TO_SLOTS": to_slots, "FLAGS": flags, "W": 8, "VEC": 2, "TILE": 2048}, 4, copies)
                 for to_slots in (False, True) for flags in (False, True)]
    variants += [(_kernel(), {"CHECK": check}, WARPS, ("ld.global.v2.b64",)) for check in (False, True)]
    for kernel, constants, warps, accesses in variants:
        signature = {name: "constexpr" if param.is_constexpr else "*i64" if name in pointers else "i64"
                     for name, param in zip(kernel.arg_names, kernel.params)}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs={(0,): [["tt.divisibility", 16]]})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        for access in accesses:
            assert access in ptx, (kernel.fn.__name__, constants, access)


def test_the_warm_up_launches_every_kernel_variant_a_save_or_load_uses(monkeypatch):
    """Triton compiles a kernel variant (its constexpr arguments) on its first launch, under the
    launch lock: ``warm_up`` (run when the copier is built on CUDA) launches every variant that
    saves, loads and loads checked on the device later launch, so none of them compiles then."""
    from kvstride.arena import device, device_xxh3

    launched = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **constexprs: launched.append((self.name, tuple(sorted(constexprs.items()))))

    monkeypatch.setattr(device, "_kernels", lambda: (Recorded("rows"), Recorded("blocks")))
    monkeypatch.setattr(device_xxh3, "launch_xxh3_rows", lambda *args, **kwargs: None)
    kv, groups = hybrid(nb=12)
    layout = KVLayout(kv, groups)
    arena = HostArena(layout, 40, copier="regions")
    copier = DeviceCopier(layout, arena.buffer, arena.slot_bytes, arena._pieces, chunk_bytes=3 * arena.slot_bytes,
                          kernels=True, digests_on_device=True)
    copier.kernels.warm_up()
    warmed, launched[:] = set(launched), []
    for (slots, grps, blocks), digests in ((_entries(layout, 10, 1), True), (_entries(layout, 10, 2), False)):
        copier.save(slots, grps, blocks, digests=digests)
        copier.load(slots, grps, blocks, lambda part: np.ones(len(part), dtype=bool))
        copier.load(slots, grps, blocks, None, expected=np.zeros(len(slots), dtype=np.uint64))
    assert launched and set(launched) <= warmed, set(launched) - warmed


def test_slot_runs():
    assert slot_runs(np.array([3, 4, 5, 9, 11, 12])) == [(0, 3, 3), (3, 9, 1), (4, 11, 2)]
    assert slot_runs(np.array([], dtype=np.int64)) == []


class Streams:
    """CUDA's ordering, modelled on CPU: every launch and event record is a node; a node follows
    the one before it on its stream and every event its stream waited for since. ``before(a,
    b)``: ``a`` must complete before ``b`` starts."""

    def __init__(self) -> None:
        self.after = []  # per node, the nodes it directly follows
        self.labels = []
        self.host_waits = []  # the events a host thread waited for, in order
        self.events = []  # every event made, in order
        self.shared_default = False  # every thread's default stream is the caller's (CUDA's legacy one)
        self.caller = Streams.Stream(self, "caller")
        self._threads = threading.local()  # each thread's current streams, as CUDA keeps them
        self._lock = threading.Lock()

    @property
    def current(self) -> list:
        """The calling thread's stack of current streams: the caller's stream on the test's
        thread, a default stream of its own on any other."""
        if not hasattr(self._threads, "stack"):
            main = threading.current_thread() is threading.main_thread()
            first = self.caller if main or self.shared_default else Streams.Stream(self, "default")
            self._threads.stack = [first]
        return self._threads.stack

    class Stream:
        def __init__(self, streams, name: str) -> None:
            self.streams, self.name, self.device = streams, name, torch.device("cpu")
            self.last, self.waits = None, set()

        def wait_event(self, event) -> None:
            self.waits.add(event.node)

        def wait_stream(self, other) -> None:
            if other.last is not None:
                self.waits.add(other.last)

    class Event:
        def __init__(self, streams, blocking: bool = False) -> None:
            self.streams, self.node, self.blocking = streams, None, blocking
            streams.events.append(self)

        def record(self, stream) -> None:
            self.node = self.streams.node(stream, "event")

        def synchronize(self) -> None:
            self.streams.host_waits.append(self.node)

        def query(self) -> bool:
            return False  # nothing runs in the model

    def node(self, stream, label: str) -> int:
        with self._lock:
            follows = stream.waits | ({stream.last} if stream.last is not None else set())
            self.after.append(follows - {None})
            self.labels.append(f"{stream.name}:{label}")
            stream.last, stream.waits = len(self.after) - 1, set()
            return stream.last

    def launch(self, label: str) -> int:
        return self.node(self.current[-1], label)

    def before(self, a: int, b: int) -> bool:
        seen, todo = set(), [b]
        while todo:
            for n in self.after[todo.pop()]:
                if n == a:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    def install(self, monkeypatch, owner, streams: dict) -> dict:
        """Fake streams for ``owner`` (a DeviceCopier or Transfer on CPU with kernels; ``streams``:
        attribute -> name, "save" for the one saves drain on), its launches recorded (not run):
        returns the node ids of each kind of launch, in order."""
        import contextlib

        import kvstride.transfer
        from kvstride.arena import device, device_xxh3

        launches = {"gather": [], "drain": [], "hash": [], "copy in": [], "check": [], "scatter": [],
                    "gathered groups": [], "by kernel": [], "by copy engine": []}

        @contextlib.contextmanager
        def stream(s):
            self.current.append(s)
            try:
                yield s
            finally:
                self.current.pop()

        def blocks(kernels, table, groups, first, count, to_entries, programs, flags=None):
            launches["gather" if to_entries else "scatter"].append(self.launch("blocks"))
            if to_entries:
                launches["gathered groups"].append(set(groups[first:first + count].tolist()))

        def rows(kernels, table, first, count, longest, programs):
            launches["drain" if self.current[-1].name.startswith("save") else "copy in"].append(self.launch("rows"))
            launches["by kernel"].append(launches["drain" if self.current[-1].name.startswith("save") else "copy in"][-1])

        def xxh3(*args, expected=None, **kwargs):
            launches["hash" if expected is None else "check"].append(self.launch("xxh3"))

        def copy_engine(dst, src):  # the copy engine's copies are launches on their stream too
            launches["drain" if self.current[-1].name.startswith("save") else "copy in"].append(self.launch("copy"))
            launches["by copy engine"].append(launches["drain" if self.current[-1].name.startswith("save") else "copy in"][-1])
            dst.copy_(src)

        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current[-1])
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda blocking=False: Streams.Event(self, blocking))
        monkeypatch.setattr(device.BlockKernels, "blocks", blocks)
        monkeypatch.setattr(device.BlockKernels, "rows", rows)
        monkeypatch.setattr(device_xxh3, "launch_xxh3_rows", xxh3)
        for module in (device, kvstride.transfer):
            monkeypatch.setattr(module, "copy_engine", copy_engine)
        for module in (device, kvstride.transfer):
            monkeypatch.setattr(module, "used_on", lambda tensor, stream: None)
        for attribute, name in streams.items():
            setattr(owner.pipeline, attribute, Streams.Stream(self, name))
        return launches


def _ring_rows(monkeypatch) -> list:
    """The staging ring's rows each chunk takes, in order (recorded as the copies take them)."""
    from kvstride.arena.device import StagingRing

    taken, take = [], StagingRing.take

    def recorded_take(ring, count):
        chunk = take(ring, count)
        taken.append(set(range(chunk.start, chunk.end)))
        return chunk

    monkeypatch.setattr(StagingRing, "take", recorded_take)
    return taken


def _assert_gathers_wait_for_reused_rows(before, rows, gather, drain, hash_) -> None:
    """A chunk's gather follows the drain and the hash of every earlier chunk whose staging rows
    it, or an earlier gather of its stream, takes again, and no other chunk's."""
    for i, k in itertools.combinations(range(len(gather)), 2):
        reused = any(rows[i] & rows[j] for j in range(i + 1, k + 1))
        assert before(drain[i], gather[k]) == reused and before(hash_[i], gather[k]) == reused, (i, k)


def _ordered_copier(monkeypatch):
    kv, groups = kvdata.flash_attn(nb=40, bs=64)
    layout = KVLayout(kv, groups)
    arena = HostArena(layout, 40, copier="regions")
    copier = DeviceCopier(layout, arena.buffer, arena.slot_bytes, arena._pieces, chunk_bytes=3 * arena.slot_bytes,
                          kernels=True, dma_runs=0, digests_on_device=True)
    streams = Streams()
    return copier, streams, streams.install(monkeypatch, copier, PIPELINE_STREAMS)


#: A device pipeline's streams (``DevicePipeline``, the arena's and the staging pool's alike), by
#: attribute: the name a modelled stream takes.
PIPELINE_STREAMS = {"gather": "save", "urgent": "save urgent", "drain": "save drain", "scatter": "load",
                    "hash": "hash", "urgent_hash": "hash urgent", "check": "check"}


@pytest.mark.parametrize("dma_runs", [0, 8])
def test_the_host_link_is_the_copy_engines_for_few_runs_of_slots_and_the_kernels_else(monkeypatch, dma_runs):
    """A save's drains and a load's copies over the host link: by the copy engine (one copy a
    run, no SM taken) where a chunk's slots form at most ``dma_runs`` runs, else by the rows
    kernel; each drain follows its chunk's gather. The staging pool's drains are always the copy
    engine's (a chunk is one range of the pool)."""
    kv, groups = kvdata.flash_attn(nb=40, bs=64)
    layout = KVLayout(kv, groups)
    arena = HostArena(layout, 40, copier="regions")
    copier = DeviceCopier(layout, arena.buffer, arena.slot_bytes, arena._pieces, chunk_bytes=3 * arena.slot_bytes,
                          kernels=True, dma_runs=dma_runs)
    streams = Streams()
    launches = streams.install(monkeypatch, copier, PIPELINE_STREAMS)
    slots = np.arange(12)  # one run a chunk
    chunks, _ = copier.save(slots, np.zeros(12, dtype=np.int64), slots + 1)
    assert len(launches["drain"]) == len(chunks) == 5
    assert all(streams.before(g, d) for g, d in zip(launches["gather"], launches["drain"]))
    by_engine = [d in launches["by copy engine"] for d in launches["drain"]]
    assert by_engine == [bool(dma_runs)] * len(chunks)
    copier.load(slots, np.zeros(12, dtype=np.int64), slots + 20, check=lambda part: np.ones(len(part), dtype=bool))
    assert [c in launches["by copy engine"] for c in launches["copy in"]] == [True] * len(launches["copy in"])
    assert len(launches["copy in"]) == (len(chunks) if dma_runs else 0)  # else the scatter reads the slots


def test_a_device_save_is_ordered_against_the_callers_stream_and_its_staging(monkeypatch):
    """A save with its digests on the device, on modelled CUDA streams: the caller's next work
    runs beside the gathers, and once the caller fenced the blocks of one chunk its later work
    follows that chunk's gather (and the earlier ones on the save's stream), not the later
    chunks', nor a drain but those whose staging rows that chunk reused; a chunk's gather
    follows the drain and the hash of the chunks whose staging rows it takes again (two chunks
    of rows, taken in turn), and no other drain; each hash runs beside its drain, not after it;
    a chunk's event follows its drain, the last one every drain and hash."""
    copier, streams, launches = _ordered_copier(monkeypatch)
    rows = _ring_rows(monkeypatch)
    slots = np.arange(12)
    chunks, _ = copier.save(slots, np.zeros(12, dtype=np.int64), slots + 1, digests=True)
    beside = streams.launch("the caller's next kernel")
    assert copier.layout.fence([100, 200]) == 0  # blocks no save reads
    assert copier.layout.fence(slots[chunks[2][0]][:1] + 1) == 1
    later = streams.launch("a kernel that rewrites a block of the third chunk")
    gather, drain, hash_ = launches["gather"], launches["drain"], launches["hash"]
    assert len(gather) == len(drain) == len(hash_) == len(chunks) == 5
    before = streams.before
    assert copier.layout.fence(None) == 4  # blocks unknown: every read still pending (chunks 0, 1, 3, 4)
    for k in range(5):
        assert not before(gather[k], beside)
        assert before(gather[k], later) == (k <= 2)
        assert before(gather[k], drain[k]) and before(gather[k], hash_[k])
        assert not before(drain[k], hash_[k]) and not before(hash_[k], drain[k])
        assert before(drain[k], chunks[k][1].node) and before(hash_[k], chunks[-1][1].node)
    assert any(rows[i] & rows[k] for i, k in itertools.combinations(range(5), 2))  # the ring wrapped
    _assert_gathers_wait_for_reused_rows(before, rows, gather, drain, hash_)
    for i in range(5):  # the fenced work waits for the third chunk's gather, so for those drains alone
        assert before(drain[i], later) == any(rows[i] & rows[j] for j in range(i + 1, 3)), i


def test_a_device_save_that_fails_midway_waits_for_the_chunks_it_queued(monkeypatch):
    """A save whose third chunk's launch raises has two chunks' gathers, drains and hashes
    queued: it waits on the host until they ended before it raises, so that its job is reported
    failed (its slots free for another key's value) only once nothing writes them any more."""
    from kvstride.arena import device

    copier, streams, launches = _ordered_copier(monkeypatch)
    rows = device.BlockKernels.rows

    def third_fails(*args, **kwargs):
        if len(launches["drain"]) == 2:
            raise RuntimeError("a launch failed")
        return rows(*args, **kwargs)

    monkeypatch.setattr(device.BlockKernels, "rows", third_fails)
    slots = np.arange(12)
    with pytest.raises(RuntimeError, match="a launch failed"):
        copier.save(slots, np.zeros(12, dtype=np.int64), slots + 1, digests=True)
    queued = launches["gather"] + launches["drain"] + launches["hash"]
    assert len(launches["drain"]) == 2 and len(launches["gather"]) == 3
    assert all(any(streams.before(node, wait) for wait in streams.host_waits) for node in queued), streams.host_waits


def test_the_events_a_lane_waits_for_are_blocking(monkeypatch):
    """Every event a device save or load records is a blocking one: a lane thread waiting for
    a host-link copy sleeps rather than spins a core."""
    copier, streams, _ = _ordered_copier(monkeypatch)
    slots = np.arange(12)
    copier.save(slots, np.zeros(12, dtype=np.int64), slots + 1, digests=True)
    copier.load(slots, np.zeros(12, dtype=np.int64), slots + 1, None, expected=np.zeros(12, dtype=np.uint64))
    assert streams.events and all(event.blocking for event in streams.events)


def test_a_device_load_checked_on_the_device_is_ordered(monkeypatch):
    """A load checked on the device, on modelled CUDA streams: it follows the caller's pending
    work; a chunk is checked, then scattered, after its copy in; the next chunk copies while one
    is checked (two buffers), but never into a buffer whose chunk is not scattered yet; the
    load's event follows every scatter."""
    copier, streams, launches = _ordered_copier(monkeypatch)
    pending = streams.launch("the caller's pending write")
    after = torch.cuda.Event()
    after.record(streams.current[0])
    slots = np.arange(12)
    _, done = copier.load(slots, np.zeros(12, dtype=np.int64), slots + 1, None, after=after,
                          expected=np.zeros(12, dtype=np.uint64))
    copy_in, check, scatter = launches["copy in"], launches["check"], launches["scatter"]
    assert len(copy_in) == len(check) == len(scatter) == 5
    before = streams.before
    for k in range(5):
        assert before(pending, copy_in[k]) and before(copy_in[k], check[k]) and before(check[k], scatter[k])
        assert before(scatter[k], done.node)
        if k + 1 < 5:
            assert not before(check[k], copy_in[k + 1])  # the next chunk copies meanwhile
        if k >= 2:
            assert before(scatter[k - 2], copy_in[k])


def test_a_staged_gather_is_ordered_against_the_callers_stream_and_its_staging(monkeypatch):
    """The staging pool's device gather with its digests, on modelled CUDA streams: the caller's
    next work runs beside the gathers; once the caller fenced a block of the last chunk, or
    waited for the fence, its later work follows every gather and no drain; a chunk's gather
    follows the drain and the hash of the chunks whose staging rows it takes again, and no
    other; hashes run beside the drains; the fence completes after all of them."""
    from kvstride.transfer import StagingPool, Transfer

    kv, groups = kvdata.flash_attn(nb=40, bs=64)
    layout = KVLayout(kv, groups)
    transfer = Transfer(layout, StagingPool(8 << 20), kernels=True, chunk_bytes=3 * layout.groups[0].block_bytes)
    transfer.digests_on_device = True
    streams = Streams()
    launches = streams.install(monkeypatch, transfer, PIPELINE_STREAMS)
    rows = _ring_rows(monkeypatch)
    fence = transfer.gather(transfer.stage([(0, b) for b in range(1, 13)]), digests=True)
    beside = streams.launch("the caller's next kernel")
    assert layout.fence([12]) == 1  # the last chunk's block
    fenced = streams.launch("a kernel that rewrites block 12")
    fence.wait_stream(streams.current[0])
    later = streams.launch("a kernel after the fence")
    gather, drain, hash_ = launches["gather"], launches["drain"], launches["hash"]
    assert len(gather) == len(drain) == len(hash_) == 5
    before = streams.before
    for k in range(5):
        assert not before(gather[k], beside) and before(gather[k], fenced)
        assert before(gather[k], later) and before(gather[k], drain[k]) and before(gather[k], hash_[k])
        assert not before(drain[k], hash_[k]) and not before(hash_[k], drain[k])
        assert before(drain[k], fence._event.node) and before(hash_[k], fence._event.node)
        assert not before(drain[k], later) or any(rows[k] & rows[j] for j in range(k + 1, 5))
    assert any(rows[i] & rows[k] for i, k in itertools.combinations(range(5), 2))  # the ring wrapped
    _assert_gathers_wait_for_reused_rows(before, rows, gather, drain, hash_)


def _fenced_engine(monkeypatch, path: str):
    """An engine over two groups of one shape on modelled CUDA streams, saving through the
    staging pool or into the arena's slots; (engine, streams, launches, entries: group 0's
    blocks 1-9 then group 1's blocks 20-22)."""
    from test_transfer import BytesStore

    from kvstride import _core
    from kvstride.arena import ArenaSlots
    from kvstride.engine import OffloadEngine
    from kvstride.transfer import StagingPool, Transfer

    kv_a, groups_a = kvdata.flash_attn(nb=40, bs=64, prefix="a")
    kv_b, groups_b = kvdata.flash_attn(nb=40, bs=64, prefix="b")
    layout = KVLayout({**kv_a, **kv_b}, groups_a + groups_b)
    chunk = 3 * layout.groups[0].block_bytes
    planner = _core.KeyPlanner([_core.GroupSpec("full_attention", 64)] * 2, hash_block_size=64, scheduler_block_size=64,
                               namespace="fenced")
    streams = Streams()
    blocks = [(0, b) for b in range(1, 10)] + [(1, b) for b in (20, 21, 22)]
    if path == "staged":
        transfer = Transfer(layout, StagingPool(8 << 20), kernels=True, chunk_bytes=chunk)
        launches = streams.install(monkeypatch, transfer, PIPELINE_STREAMS)
        engine = OffloadEngine(planner, transfer, BytesStore())
        engine._batch_bytes["save"] = transfer.staged_bytes(blocks[-3:])  # batches of three: group 1's alone
        return engine, streams, launches, [(f"{g}-{b}", g, b) for g, b in blocks]
    store = ArenaSlots(16, copier="device")
    engine = OffloadEngine(planner, layout, store)
    arena = store.arena
    arena._device = DeviceCopier(layout, arena.buffer, arena.slot_bytes, arena._pieces, chunk_bytes=chunk, kernels=True)
    launches = streams.install(monkeypatch, arena._device, PIPELINE_STREAMS)
    return engine, streams, launches, [(slot, g, b) for slot, (g, b) in enumerate(blocks)]


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_planned_saves_make_the_callers_stream_wait_only_for_the_groups_it_does_not_fence(monkeypatch, path):
    """The engine's planned saves through the staging pool or into the arena's slots, on
    modelled CUDA streams: a group the caller does not fence (a hand-off state, rewritten in
    place) is gathered first and the caller's stream waits for it at once; the fenced group's
    gathers follow the caller's work queued before the save and run beside its next work until
    ``fence`` names one of their blocks. The others run on streams of their own, so that they
    never queue behind the fenced ones; into the slots, the fenced group's copies are launched
    by the engine's launch lane."""
    engine, streams, launches, entries = _fenced_engine(monkeypatch, path)
    pending = streams.launch("the caller's work queued before the save")
    engine.submit_planned(puts={7: entries}, fenced_groups=[0])
    beside = streams.launch("the caller's next kernel")
    assert engine.wait_idle(30)  # (the launch lane launched what it had)
    assert engine.fence([9]) == 1
    later = streams.launch("a kernel that rewrites a block of group 0")
    gathers, groups = launches["gather"], launches["gathered groups"]
    first = [g == {1} for g in groups].index(False)  # group 1's gathers, then group 0's
    assert first and all(g == {1} for g in groups[:first]) and all(g == {0} for g in groups[first:]), groups
    before = streams.before
    assert all(before(pending, gather) and before(gather, beside) for gather in gathers[:first])
    assert all(before(pending, gather) and not before(gather, beside) for gather in gathers[first:])
    assert all(before(gather, later) for gather in gathers)
    assert all(streams.labels[gather].startswith("save urgent:") for gather in gathers[:first])
    assert all(streams.labels[gather].startswith("save:") for gather in gathers[first:])
    engine.shutdown()


@pytest.mark.parametrize("failing", ["the step's blocks", "every read too"])
def test_a_fence_that_fails_makes_the_step_wait_for_every_read(monkeypatch, failing):
    """A fence that raises fails closed: the caller's stream waits for every save's reads
    (counted, logged once); if that fails too, the host waits for the device. It never returns
    with a read still pending on a block the step writes."""
    engine, streams, launches, entries = _fenced_engine(monkeypatch, "staged")
    engine.submit_planned(puts={7: entries}, fenced_groups=[0, 1])
    assert engine.wait_idle(30)
    reads, fence = engine.layout.pending_reads, engine.layout.pending_reads.fence
    synchronized = []
    monkeypatch.setattr(engine.layout, "synchronize", lambda: synchronized.append(True), raising=False)

    def broken(block_ids, stream):
        if block_ids is not None or failing == "every read too":
            raise RuntimeError("a CUDA error from event.query()")
        return fence(block_ids, stream)

    monkeypatch.setattr(reads, "fence", broken)
    engine.fence([9])
    later = streams.launch("a kernel that rewrites block 9")
    assert engine.counters["fence_errors"] == 1
    if failing == "every read too":
        assert synchronized == [True]
    else:
        assert synchronized == [] and all(streams.before(gather, later) for gather in launches["gather"])
    engine.shutdown()


def test_a_save_whose_blocks_are_fenced_before_the_launch_lane_reached_it_is_cancelled(monkeypatch):
    """A fence on blocks whose copies the launch lane has not started yet cancels them rather
    than waiting (on the host) for the lane: those saves fail, counted, and nothing reads the
    blocks being written again."""
    engine, streams, launches, entries = _fenced_engine(monkeypatch, "direct")
    gate, launch = threading.Event(), engine._launch
    monkeypatch.setattr(engine, "_launch", lambda item: (gate.wait(30), launch(item)))
    engine.submit_planned(puts={7: entries}, fenced_groups=[0])
    assert engine.fence([5]) == 0
    gate.set()
    assert engine.wait_idle(30)
    assert engine.get_finished().jobs_done == {7: "failed"}
    assert engine.counters["saves_cancelled_by_fence"] == 9
    assert all(g == {1} for g in launches["gathered groups"])  # group 0's blocks were never read
    engine.shutdown()


def test_a_fence_on_blocks_whose_copies_are_being_launched_waits_for_the_launch(monkeypatch):
    """A fence on blocks whose copies the launch lane is launching right now waits (on the host)
    until they are launched, then orders the caller's stream after their reads: it neither
    cancels a save already under way nor returns before its reads exist."""
    engine, streams, launches, entries = _fenced_engine(monkeypatch, "direct")
    store = engine.store
    entered, gate, begin = threading.Event(), threading.Event(), store.save_blocks_begin

    def launching(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # the lane, not the urgent copies
            entered.set()
            gate.wait(30)
        return begin(*args, **kwargs)

    monkeypatch.setattr(store, "save_blocks_begin", launching)
    engine.submit_planned(puts={7: entries}, fenced_groups=[0])
    assert entered.wait(30)  # the lane is launching group 0's copies
    threading.Timer(0.2, gate.set).start()
    assert engine.fence([5]) == 1
    later = streams.launch("a kernel that rewrites block 5")
    assert engine.wait_idle(30) and engine.get_finished().jobs_done == {7: "ok"}
    gathers, groups = launches["gather"], launches["gathered groups"]
    assert any(streams.before(gather, later) for gather, g in zip(gathers, groups) if g == {0})
    engine.shutdown()


def test_a_load_into_the_slots_follows_the_callers_event_not_the_work_queued_after_it(monkeypatch):
    """vLLM may compute on CUDA's legacy default stream, which every thread shares. A load out
    of the arena's slots follows the work the caller queued before submitting it, and not what
    it queued afterwards (the next forward): its copies run beside that forward."""
    engine, streams, launches, entries = _fenced_engine(monkeypatch, "direct")
    streams.shared_default = True
    # The layout's tensors are on the CPU: its caller event as on CUDA, on the modelled streams.
    monkeypatch.setattr(engine.layout, "current_stream_event", engine.store.caller_event)
    engine.submit_planned(puts={7: entries})
    assert engine.wait_idle(30) and engine.get_finished().jobs_done == {7: "ok"}
    gate, begin = threading.Event(), engine._begin_scatter
    monkeypatch.setattr(engine, "_begin_scatter", lambda job: (gate.wait(30), begin(job))[1])
    pending = streams.launch("the caller's work before the load")
    engine.submit_planned(gets={"r": [(slot, group, block + 10) for slot, group, block in entries]})
    forward = streams.launch("the next forward, on the same stream")
    gate.set()
    assert engine.wait_idle(30) and engine.get_finished().loads_failed == {}
    writes = launches["copy in"] + launches["scatter"]
    assert writes and all(streams.before(pending, node) and not streams.before(forward, node) for node in writes)
    engine.shutdown()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_a_block_rewritten_right_after_its_save_is_saved_as_it_was():
    """The caller's stream fences the saved blocks and rewrites them at once after ``save``
    returned: the slots hold the bytes from before (the fenced kernels wait for the gathers)."""
    kv, groups = kvdata.flash_attn(nb=64, bs=16, heads=8, dim=128)
    kvdata.fill_random([t for t in kv.values()], seed=3)
    on_host = {k: v.clone() for k, v in kv.items()}  # the same bytes, for the region copier
    kv = {k: v.cuda() for k, v in kv.items()}
    layout = KVLayout(kv, groups)
    arena = HostArena(layout, 64)
    blocks, zeros = np.arange(64), np.zeros(64, dtype=np.int64)
    chunks, _ = arena._device.save(blocks, zeros, blocks)
    layout.fence(blocks)
    for t in kv.values():
        t.zero_()  # queued on the caller's stream right behind the save
    for _, done in chunks:
        done.synchronize()
    regions = HostArena(KVLayout(on_host, groups), 64, copier="regions")
    regions.save(blocks, zeros, blocks)
    assert _values(arena, blocks, zeros) == _values(regions, blocks, zeros)


@cuda
def test_cuda_a_forward_right_after_a_load_sees_the_loaded_bytes():
    kv, groups = kvdata.flash_attn(nb=64, bs=16, heads=8, dim=128)
    kvdata.fill_random([t for t in kv.values()], seed=4)
    kv = {k: v.cuda() for k, v in kv.items()}
    layout = KVLayout(kv, groups)
    arena = HostArena(layout, 64)
    want = [s.clone() for s in layout.storages]
    blocks = np.arange(64)
    arena.save(blocks, np.zeros(64, dtype=np.int64), blocks)
    for t in layout.storages:
        t.zero_()
    assert arena.load(blocks, np.zeros(64, dtype=np.int64), blocks).all()
    got = [s.clone() for s in layout.storages]  # a kernel on the caller's stream right after
    assert all(torch.equal(a, b) for a, b in zip(got, want))


VIRTUAL_MEMORY_KV_CACHE = r"""
import numpy as np, torch
from kvstride.arena import HostArena
from kvstride.layout import KVLayout
from kvstride.transfer import StagingPool, Transfer

# 32 MiB a layer: each spans several of the allocator's physical allocations, mapped back to back.
kv = {f"l{i}": torch.empty(2, 512, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for i in range(4)}
for t in kv.values():
    segments = [s for s in torch.cuda.memory_snapshot() if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]]
    assert segments and all(s.get("is_expandable") for s in segments), segments
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device="cuda"))
want = {name: t.view(torch.uint8).clone() for name, t in kv.items()}
layout = KVLayout(kv, [list(kv)])
slots, blocks, zeros = np.arange(256), np.arange(1, 257), np.zeros(256, dtype=np.int64)


def restored() -> bool:
    torch.cuda.synchronize()
    return all(torch.equal(t.view(torch.uint8), want[name]) for name, t in kv.items())


arena = HostArena(layout, 256)
arena.save(slots, zeros, blocks)
for t in kv.values():
    t[:, 1:257].zero_()
assert not restored()
assert arena.load(slots, zeros, blocks).all()
assert restored(), "the arena's device path"
transfer = Transfer(layout, StagingPool(160 << 20))
batch = transfer.stage([(0, int(b)) for b in blocks])
transfer.gather(batch).wait()
for t in kv.values():
    t[:, 1:257].zero_()
transfer.scatter(batch).wait()
assert restored(), "the staging pool's device path"
print("ok")
"""


@cuda
def test_cuda_a_kv_cache_in_virtual_memory_segments_round_trips():
    """A KV cache allocated as vLLM's CUDA default does, through CUDA's virtual-memory API (here
    PyTorch's expandable segments: physical allocations mapped back to back): the arena's and
    the staging pool's device paths restore every byte."""
    import subprocess
    import sys

    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    done = subprocess.run([sys.executable, "-c", VIRTUAL_MEMORY_KV_CACHE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_an_engine_reports_a_device_save_once_its_copies_landed():
    """Through ``OffloadEngine.submit_planned`` (the connector's worker): the device path's save
    is finished by the save lane (on CUDA: after its copies landed, with the digests), then the
    blocks load back byte for byte into other blocks."""
    import kvstride
    from kvstride.arena import ArenaSlots
    from kvstride.engine import OffloadEngine

    kv, groups = hybrid(nb=16)
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed=5)
    specs = [kvstride.GroupSpec("full_attention", 64), kvstride.GroupSpec("sliding_window", 64, window=128),
             kvstride.GroupSpec("mamba", 64, mamba_mode="align"), kvstride.GroupSpec("circular_buffer", 4)]
    S, H = kvstride.resolve_block_sizes(specs)
    planner = kvstride.KeyPlanner(specs, hash_block_size=H, scheduler_block_size=S, namespace="device-engine")
    store = ArenaSlots(12, copier="device")
    engine = OffloadEngine(planner, layout, store)
    try:
        puts = [(slot, group, block) for slot, (group, block) in enumerate([(0, 1), (0, 2), (1, 3), (2, 4), (2, 5)])]
        saved = _blocks(kv, groups, [g for _, g, _ in puts], [b for _, _, b in puts])
        engine.submit_planned(puts={7: puts})
        assert engine.wait_idle(30)
        assert engine.get_finished().jobs_done == {7: "ok"}
        gets = [(slot, group, block + 8) for slot, group, block in puts]
        engine.submit_planned(gets={"r": gets})
        assert engine.wait_idle(30)
        done = engine.get_finished()
        assert done.loads_done == {"r"} and not done.loads_failed
        assert _blocks(kv, groups, [g for _, g, _ in gets], [b for _, _, b in gets]) == saved
    finally:
        engine.shutdown()


def test_slots_fit_the_stored_groups_only():
    """A scratch ring larger than every stored group's block takes no room in a slot."""
    kv = {"fa": torch.zeros(8, 2, 16, 2, 32, dtype=torch.bfloat16), "ring": torch.zeros(8, 2, 4, 64, 64)}
    layout = KVLayout(kv, [["fa"], ["ring"]])
    assert layout.block_bytes(1) > layout.block_bytes(0)
    arena = HostArena(layout, 4, stored_groups=[0])
    assert arena.slot_bytes == layout.block_bytes(0)
    arena.save([0], [0], [3])
    with pytest.raises(ValueError, match="group 1 is not stored"):
        arena.save([1], [1], [3])
