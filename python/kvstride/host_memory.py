"""Host buffers of exactly the size asked, page-locked for the device's copy engine when the KV
cache is on CUDA.

PyTorch's ``pin_memory=True`` allocates through its caching host allocator, which rounds every
allocation up to the next power of two: a 40 GiB arena would pin 64 GiB, a 64 GiB one 128 GiB,
per rank. Here the memory is anonymous, page-aligned ``mmap`` memory of the asked size, touched
once, and registered with CUDA (``cudaHostRegister``, as vLLM's own CPU offloading does) when it
must be pinned; the registration ends when the buffer's tensor and every view of it are gone,
before the memory is unmapped.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

import torch

from kvstride.sizes import format_size

__all__ = ["host_buffer", "pinned_bytes"]

log = logging.getLogger("kvstride")

_pinned_lock = threading.Lock()
_pinned = 0  # bytes this process holds page-locked through host_buffer


def pinned_bytes() -> int:
    """Bytes of host memory this process holds page-locked through :func:`host_buffer`."""
    return _pinned


def _cudart():
    """CUDA's runtime API, as PyTorch exposes it."""
    return torch.cuda.cudart()


def host_buffer(nbytes: int, *, pin: bool, what: str = "host buffer") -> torch.Tensor:
    """A zeroed, page-aligned uint8 tensor of exactly ``nbytes`` bytes, page-locked with
    ``cudaHostRegister`` when ``pin`` (``RuntimeError`` naming the CUDA error when CUDA refuses);
    ``what`` names it in the log line that reports the bytes pinned."""
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"{what}: a host buffer needs a positive size, got {nbytes}")
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region = _region_type(nbytes).from_buffer(mapping)  # keeps the mapping while it lives
    if pin:
        region.register(what)
    tensor = torch.frombuffer(region, dtype=torch.uint8)  # every view of it keeps the region
    tensor.zero_()  # touched once here: the first copies take no page faults
    return tensor


def _region_type(nbytes: int):
    """A ctypes array of ``nbytes`` bytes that ends its CUDA registration when the last tensor
    over it goes, before its mapping is unmapped (``__del__`` runs before the array lets go of
    the mapping it was made from)."""

    class Region(ctypes.c_uint8 * nbytes):
        _registered_with = None  # the CUDA runtime that page-locked it, which unregisters it

        def register(self, what: str) -> None:
            global _pinned
            cudart = _cudart()
            error = int(cudart.cudaHostRegister(ctypes.addressof(self), nbytes, 0))
            if error != 0:
                raise RuntimeError(f"{what}: cudaHostRegister of {format_size(nbytes)} failed with CUDA error {error} "
                                   "(the host's locked-memory limit, ulimit -l, or the device's state)")
            self._registered_with = cudart
            with _pinned_lock:
                _pinned += nbytes
            log.info("kvstride: %s pinned, %s (page-locked: exactly its size)", what, format_size(nbytes))

        def __del__(self) -> None:
            global _pinned
            if self._registered_with is None:
                return
            with _pinned_lock:
                _pinned -= nbytes
            error = int(self._registered_with.cudaHostUnregister(ctypes.addressof(self)))
            if error != 0:
                log.warning("kvstride: cudaHostUnregister failed with CUDA error %s", error)

    return Region
