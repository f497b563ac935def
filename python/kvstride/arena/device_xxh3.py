"""XXH3-64 of values in device memory, computed by the GPU: the same digest the host computes
(``xxh3_64`` with the default secret and no seed, XXH3's long-input path), so that a value saved
with its digest taken on the device reads back on the host, the disk tier or the CPU path alike,
and a load checks its bytes in device staging before they reach a KV block.

One program hashes one value: XXH3 folds each 1 KiB block into eight accumulators and scrambles
them, so a value is a chain of blocks, but the 16 stripes of a block are one tile. The
accumulators are kept as their even and odd lanes, because a stripe's word ``i`` feeds lanes
``i`` and ``i ^ 1``; a block is read 16 bytes a thread. Only values longer than 240 bytes take
XXH3's long path, and the kernel reads whole 8-byte words from 16-byte aligned addresses: other
values (``eligible``) stay with the host.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

__all__ = ["LAUNCHES", "WARPS", "eligible", "keys_for", "launch_xxh3_rows", "warm_up"]

#: Warps of a program: 64 threads for a block's 128 words, two (16 bytes) a thread.
WARPS = 2

#: Held around every launch of this package's Triton kernels: the caller's thread and the
#: engine's lanes launch beside each other, and Triton's JIT, which compiles and caches a
#: kernel on its first call, is not safe to enter from two threads at once.
LAUNCHES = threading.RLock()

_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d3165526 29d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e".replace(" ", ""))
_PRIME32_1, _PRIME32_2, _PRIME32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_PRIME64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_AVALANCHE = 0x165667919E3779F9
_LASTACC_START, _MERGEACCS_START = 7, 11



def _words(offset: int, count: int = 8) -> list:
    return [int.from_bytes(_SECRET[offset + 8 * i:offset + 8 * i + 8], "little") for i in range(count)]


def eligible(length: int) -> bool:
    """Whether the kernel hashes values of ``length`` bytes (XXH3's long path, whole words)."""
    return length > 240 and length % 8 == 0


@functools.lru_cache(maxsize=None)
def keys_for(device: torch.device) -> torch.Tensor:
    """The kernel's constants on ``device`` (int64 bit patterns of the uint64 values): the
    secret's 24 aligned words (from 0), the last stripe's 8 and the merge's 8 (from 24 and 32;
    unaligned in the secret), the initial accumulators (from 40), then the multipliers (48)."""
    initial = [_PRIME32_3, _PRIME64[0], _PRIME64[1], _PRIME64[2], _PRIME64[3], _PRIME32_2, _PRIME64[4], _PRIME32_1]
    values = (_words(0, 24) + _words(len(_SECRET) - 64 - _LASTACC_START) + _words(_MERGEACCS_START) + initial
              + [_PRIME64[0], _AVALANCHE, _PRIME32_1])
    return torch.from_numpy(np.array(values, dtype=np.uint64).view(np.int64)).to(device)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["origin_addr", "stride", "first"])
    def xxh3_rows_kernel(origin, origin_addr, table, stride, first, address_row, length_row, keys, expected, out,
                         CHECK: tl.constexpr):
        # One program a row of ``table``: the value at its address, of its length in bytes. Writes
        # the digest, or with CHECK whether it equals ``expected`` at the row (1) or not (0).
        row = first + tl.program_id(0)
        length = tl.load(table + length_row * stride + row).to(tl.uint64, bitcast=True)
        base = tl.multiple_of((tl.load(table + address_row * stride + row) - origin_addr) // 8, 2)  # 16-byte aligned
        stripe = tl.arange(0, 16)[:, None]
        word = tl.arange(0, 8)[None, :]
        lane = 2 * tl.arange(0, 4)  # the even lanes; lane + 1 the odd ones
        key_even, key_odd = tl.split(tl.reshape(tl.load(keys + stripe + word).to(tl.uint64, bitcast=True), (16, 4, 2)))
        even = tl.load(keys + 40 + lane).to(tl.uint64, bitcast=True)
        odd = tl.load(keys + 40 + lane + 1).to(tl.uint64, bitcast=True)
        scramble_even = tl.load(keys + 16 + lane).to(tl.uint64, bitcast=True)
        scramble_odd = tl.load(keys + 17 + lane).to(tl.uint64, bitcast=True)
        prime32_1 = tl.load(keys + 48 + 2).to(tl.uint64, bitcast=True)
        blocks = ((length - 1) // 1024).to(tl.int64)
        for block in range(blocks):
            words = tl.load(origin + (base + block * 128 + stripe * 8 + word)).to(tl.uint64, bitcast=True)
            words_even, words_odd = tl.split(tl.reshape(words, (16, 4, 2)))
            even += tl.sum(words_odd, axis=0) + tl.sum(((words_even ^ key_even) & 0xFFFFFFFF) * ((words_even ^ key_even) >> 32), axis=0)
            odd += tl.sum(words_even, axis=0) + tl.sum(((words_odd ^ key_odd) & 0xFFFFFFFF) * ((words_odd ^ key_odd) >> 32), axis=0)
            even = ((even ^ (even >> 47)) ^ scramble_even) * prime32_1
            odd = ((odd ^ (odd >> 47)) ^ scramble_odd) * prime32_1
        # The last, partial block's whole stripes, then the value's last 64 bytes.
        stripes = (((length - 1) % 1024) // 64).to(tl.int64)
        inside = stripe < stripes
        words = tl.load(origin + (base + blocks * 128 + stripe * 8 + word), mask=inside, other=0).to(tl.uint64, bitcast=True)
        words_even, words_odd = tl.split(tl.reshape(words, (16, 4, 2)))
        zero = tl.zeros_like(words_even)
        even += tl.sum(words_odd, axis=0) + tl.sum(tl.where(inside, ((words_even ^ key_even) & 0xFFFFFFFF) * ((words_even ^ key_even) >> 32), zero), axis=0)
        odd += tl.sum(words_even, axis=0) + tl.sum(tl.where(inside, ((words_odd ^ key_odd) & 0xFFFFFFFF) * ((words_odd ^ key_odd) >> 32), zero), axis=0)
        at = base + (length.to(tl.int64) - 64) // 8 + lane
        words_even = tl.load(origin + at).to(tl.uint64, bitcast=True)
        words_odd = tl.load(origin + at + 1).to(tl.uint64, bitcast=True)
        mixed_even = words_even ^ tl.load(keys + 24 + lane).to(tl.uint64, bitcast=True)
        mixed_odd = words_odd ^ tl.load(keys + 24 + lane + 1).to(tl.uint64, bitcast=True)
        even += words_odd + (mixed_even & 0xFFFFFFFF) * (mixed_even >> 32)
        odd += words_even + (mixed_odd & 0xFFFFFFFF) * (mixed_odd >> 32)
        # Merge: the 128-bit products of lane pairs, folded, over 32-bit halves.
        a = even ^ tl.load(keys + 32 + lane).to(tl.uint64, bitcast=True)
        b = odd ^ tl.load(keys + 32 + lane + 1).to(tl.uint64, bitcast=True)
        low_low = (a & 0xFFFFFFFF) * (b & 0xFFFFFFFF)
        high_low = (a >> 32) * (b & 0xFFFFFFFF)
        cross = (low_low >> 32) + (high_low & 0xFFFFFFFF) + (a & 0xFFFFFFFF) * (b >> 32)
        upper = (high_low >> 32) + (cross >> 32) + (a >> 32) * (b >> 32)
        lower = (cross << 32) | (low_low & 0xFFFFFFFF)
        result = length * tl.load(keys + 48).to(tl.uint64, bitcast=True) + tl.sum(lower ^ upper, axis=0)
        result ^= result >> 37
        result *= tl.load(keys + 48 + 1).to(tl.uint64, bitcast=True)
        result ^= result >> 32
        if CHECK:
            tl.store(out + row, (result == tl.load(expected + row).to(tl.uint64, bitcast=True)).to(tl.int64))
        else:
            tl.store(out + row, result.to(tl.int64, bitcast=True))

    return xxh3_rows_kernel


def warm_up(device: torch.device) -> None:
    """Compile the kernel in both modes (digests, checks) on one 256-byte value: Triton compiles
    on a kernel's first launch, under ``LAUNCHES``."""
    value = torch.zeros(256, dtype=torch.uint8, device=device)
    table = torch.tensor([[value.data_ptr()], [value.numel()]], dtype=torch.int64, device=device)
    digest = torch.zeros(1, dtype=torch.int64, device=device)
    launch_xxh3_rows(value, table, 0, 1, 0, 1, digest)
    launch_xxh3_rows(value, table, 0, 1, 0, 1, torch.zeros_like(digest), expected=digest)


def launch_xxh3_rows(origin: torch.Tensor, table: torch.Tensor, first: int, count: int, address_row: int,
                     length_row: int, out: torch.Tensor, expected: torch.Tensor = None) -> None:
    """On the current stream: the XXH3-64 of the values in columns ``first`` to ``first + count``
    of ``table`` (int64; row ``address_row`` their addresses, 8-byte aligned, ``length_row`` their
    lengths in bytes, each ``eligible``), relative to ``origin`` (a device tensor, 16-byte aligned), into ``out``
    (int64, indexed by column); with ``expected`` (int64 digests, by column), 1 where a value's
    digest equals it, else 0."""
    if not count:
        return
    with LAUNCHES:
        _kernel()[(count,)](origin.view(torch.int64), origin.data_ptr(), table, table.shape[1], first, address_row,
                            length_row, keys_for(origin.device), out if expected is None else expected, out,
                            CHECK=expected is not None, num_warps=WARPS)
