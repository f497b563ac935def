"""Host buffers of exactly the configured size (``kvstride.host_memory``): the embedded store's
arena and the Mooncake staging pool never allocate through PyTorch's caching host allocator,
which rounds a pinned allocation up to the next power of two (40 GiB pins 64 GiB).

Without CUDA here, CUDA's runtime is stood in for by a recorder of ``cudaHostRegister`` /
``cudaHostUnregister`` calls (the calls the code makes are what is checked); on a CUDA host the
last test registers real memory and checks that PyTorch's pinned allocator holds none of it.
"""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from kvstride import host_memory
from kvstride.arena.slots import HostArena
from kvstride.transfer import StagingPool

# Sizes that a power-of-two allocator would round up (by almost half of them).
ODD_SIZES = [(5 << 20) + 4096, 9 << 20]


class RecordingRuntime:
    """CUDA's host-registration calls, recorded; every call succeeds."""

    def __init__(self) -> None:
        self.registered = {}  # ptr -> bytes
        self.calls = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        assert ptr not in self.registered, "a range registered twice"
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        assert self.registered.pop(ptr, None) is not None, "a range unregistered that was not registered"
        return 0


@pytest.fixture
def runtime(monkeypatch):
    """The stand-in runtime, and PyTorch's pinned allocations refused: any path through the
    caching host allocator fails the test."""
    recorder = RecordingRuntime()
    monkeypatch.setattr(host_memory, "_cudart", lambda: recorder)
    empty, zeros = torch.empty, torch.zeros

    def refuse_pinned(real):
        def call(*args, **kwargs):
            assert not kwargs.get("pin_memory"), "allocated through PyTorch's caching host allocator"
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "empty", refuse_pinned(empty))
    monkeypatch.setattr(torch, "zeros", refuse_pinned(zeros))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pytest.fail("Tensor.pin_memory called"))
    return recorder


@pytest.mark.parametrize("nbytes", ODD_SIZES)
def test_a_host_buffer_is_exactly_its_size_page_aligned_zeroed_and_registered_once(runtime, nbytes):
    before = host_memory.pinned_bytes()
    buffer = host_memory.host_buffer(nbytes, pin=True, what="test buffer")
    assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % mmap.PAGESIZE == 0
    assert not buffer.any()
    assert runtime.calls == [("register", buffer.data_ptr(), nbytes, 0)]
    assert host_memory.pinned_bytes() == before + nbytes
    view = buffer[4096:].view(torch.int32)  # a view keeps the registration
    ptr = buffer.data_ptr()
    del buffer
    gc.collect()
    assert runtime.registered == {ptr: nbytes}
    view.fill_(7)
    del view
    gc.collect()
    assert runtime.registered == {} and host_memory.pinned_bytes() == before


@pytest.mark.parametrize("nbytes", ODD_SIZES)
def test_the_staging_pool_pins_exactly_its_capacity(runtime, nbytes):
    pool = StagingPool(nbytes, pin=True)
    assert pool.pinned and pool.tensor.numel() == pool.capacity
    assert runtime.calls == [("register", pool.ptr, pool.capacity, 0)]
    del pool
    gc.collect()
    assert runtime.registered == {}


@pytest.mark.parametrize("align", [64, 4096])
def test_the_arena_pins_exactly_its_slots(runtime, align):
    slots, slot_bytes = 37, 20480
    arena = HostArena(None, slots, slot_bytes=slot_bytes, align=align, pin=True)
    assert arena.pinned and arena.nbytes == slots * slot_bytes and arena.ptr % align == 0
    ((_, ptr, nbytes, _),) = runtime.calls
    assert ptr == arena.ptr and nbytes == slots * slot_bytes
    del arena
    gc.collect()
    assert runtime.registered == {}


def test_nothing_is_pinned_for_a_kv_cache_in_host_memory(runtime):
    pool = StagingPool(1 << 20, pin=False)
    arena = HostArena(None, 4, slot_bytes=4096)
    assert not pool.pinned and not arena.pinned and runtime.calls == []


def test_a_refused_registration_names_the_cuda_error(monkeypatch):
    class Refusing(RecordingRuntime):
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(host_memory, "_cudart", Refusing)
    with pytest.raises(RuntimeError, match="the staging pool: cudaHostRegister of 1 MiB failed with CUDA error 2"):
        StagingPool(1 << 20, pin=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_buffer_is_pinned_outside_pytorchs_host_allocator():
    nbytes = ODD_SIZES[0]
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    pool = StagingPool(nbytes, pin=True)
    assert pool.tensor.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    pool.tensor.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.tensor.cuda(), device)
