"""The staging pool's shares (loads keep room that saves cannot take) and the default pool size
``staging_bytes_for`` (what one step can save on this rank, plus the loads' share)."""

from __future__ import annotations

import pytest
import torch

from kvstride import _core
from kvstride.layout import KVLayout
from kvstride.transfer import LOAD_SHARE, StagingPool, Transfer, staging_bytes_for

NB = 512


def test_loads_and_saves_allocate_from_their_own_shares():
    pool = StagingPool(4096, load_bytes=1024, pin=False)
    assert (pool.share("save"), pool.share("load"), pool.share()) == (3072, 1024, 4096)
    assert pool.alloc(3072, "save") == 0
    assert pool.alloc(64, "save") is None  # the loads' share is not for saves
    assert pool.alloc(1024, "load") == 3072
    assert pool.alloc(64, "load") is None and pool.alloc(64) is None
    pool.release(0, 3072)
    assert pool.alloc(2048, "load") is None  # nor the saves' share for loads
    assert pool.alloc(2048) == 0  # a caller of no lane takes any room
    pool.release(3072, 1024)
    pool.release(0, 2048)
    assert pool.free_bytes == 4096 and pool.alloc(4096) == 0


def test_default_load_share_and_one_shared_region():
    pool = StagingPool(1 << 20, pin=False)
    assert pool.share("load") == int((1 << 20) * LOAD_SHARE) and pool.share("save") == (1 << 20) - pool.share("load")
    shared = StagingPool(4096, load_bytes=0, pin=False)
    assert shared.share("save") == shared.share("load") == 4096
    assert shared.alloc(4096, "load") == 0 and shared.alloc(64, "save") is None
    with pytest.raises(ValueError, match="load_bytes"):
        StagingPool(4096, load_bytes=4096, pin=False)


def _rig(tp_size=1, ring=False):
    groups = [_core.GroupSpec("full_attention", 16, num_kv_heads=1), _core.GroupSpec("mamba", 64, mamba_mode="align")]
    kv = {
        "attn": torch.empty(NB, 2, 16, 4, 32, dtype=torch.float16),
        "mamba": [torch.empty(NB, 3, 8, dtype=torch.float16), torch.empty(NB, 2, 16, dtype=torch.float32)],
    }
    names = [["attn"], ["mamba"]]
    if ring:
        groups.append(_core.GroupSpec("circular_buffer", 4))
        kv["ring"] = torch.empty(NB, 4, 2, 64, dtype=torch.float16)
        names.append(["ring"])
    planner = _core.KeyPlanner(
        groups, hash_block_size=16, scheduler_block_size=64, namespace=_core.Namespace("m"), tp_size=tp_size, tp_rank=0
    )
    return planner, KVLayout(kv, names)


@pytest.mark.parametrize("header_room", [0, 64])
@pytest.mark.parametrize("tokens", [1, 16, 100, 512, 2048])
def test_the_default_pool_holds_any_single_step(tokens, header_room):
    """Whatever the request had computed before, one step of ``tokens`` tokens (its normal save
    and a partial tail at its end) fits the save share at once, and one block of every group
    fits the loads' share; also with room for the value header staged before each block."""
    planner, layout = _rig()
    pool = StagingPool(staging_bytes_for(layout, tokens, planner, header_room), pin=False)
    transfer = Transfer(layout, pool)
    transfer.header_room = header_room
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range((4096 + tokens) // 16)]
    tables = [list(range(1, NB)), list(range(1, NB))]
    for computed in range(0, 640, 40):
        n = computed + tokens
        offset = computed // 64 * 64
        puts = list(planner.plan_save(hashes, tables, n, saved_offset=offset).puts)
        boundary = n // 16 * 16
        if boundary:
            puts += planner.plan_tail(hashes, tables, [(1, 7, boundary)], saved_offset=offset).puts
        blocks = list({key: (g, b) for key, g, b in puts}.values())
        assert transfer.staged_bytes(blocks) <= pool.share("save"), (computed, tokens)
    largest = max(transfer.staged_bytes([(g, 1)]) for g in range(2))
    assert pool.share("load") >= largest


def test_default_pool_counts_only_what_this_rank_stores():
    planner, layout = _rig()
    size = staging_bytes_for(layout, 1024, planner)
    # A scratch ring is never stored: it adds nothing.
    ring_planner, ring_layout = _rig(ring=True)
    assert staging_bytes_for(ring_layout, 1024, ring_planner) == size
    # With TP striding this rank puts about half of the replicated attention blocks.
    tp_planner, _ = _rig(tp_size=2)
    assert tp_planner.replication(0) == 2
    assert staging_bytes_for(layout, 1024, tp_planner) < size
    with pytest.raises(ValueError, match="tokens_per_step"):
        staging_bytes_for(layout, 0, planner)
