"""Bad arguments: ValueError for wrong values (with a message naming them), TypeError for wrong
types, and the documented behaviour for empty or short inputs. Runs on the core and the twin."""

import re

import numpy as np
import pytest

from conftest import FA, MAMBA, MLA, RING, SWA, fake_hashes, load_tuple, save_tuple, tail_tuple


def raises(exc, pattern):
    return pytest.raises(exc, match=re.compile(pattern, re.S))


def fa4_mamba16(impl, **kw):
    return impl.KeyPlanner([FA(impl, 4), MAMBA(impl, 16)], hash_block_size=4, scheduler_block_size=16, namespace="ns", **kw)


# ---- constructors ---------------------------------------------------------------------------


def test_unknown_kind_algo_mode(impl):
    with raises(ValueError, r"unknown group kind.*'?\"?attention2"):
        impl.GroupSpec("attention2", 16)
    with raises(ValueError, r"unknown hash algorithm.*md5"):
        impl.BlockHasher("md5")
    with raises(ValueError, r"unknown hash algorithm"):
        impl.BlockHasher("sha256")  # the pickle variant is not supported
    with raises(ValueError, r"unknown mamba_mode.*fast"):
        impl.GroupSpec("mamba", 16, mamba_mode="fast")


@pytest.mark.parametrize("bad", [0, -1, -16])
def test_non_positive_sizes(impl, bad):
    with raises(ValueError, r"block_size.*positive"):
        impl.GroupSpec("full_attention", bad)
    with raises(ValueError, r"window.*positive"):
        impl.GroupSpec("sliding_window", 16, window=bad)
    with raises(ValueError, r"window"):
        impl.GroupSpec("chunked_local", 16, window=bad)
    with raises(ValueError, r"dcp.*positive"):
        impl.resolve_block_sizes([FA(impl, 16)], dcp=bad)
    with raises(ValueError, r"dcp.*positive"):
        impl.hashes_per_block([FA(impl, 16)], 16, dcp=bad)
    with raises(ValueError, r"prefix_match_unit.*positive"):
        impl.resolve_block_sizes([FA(impl, 16), MAMBA(impl, 16)], prefix_match_unit=bad)
    with raises(ValueError, r"block_size.*positive"):
        impl.BlockHasher().hash_blocks([1, 2, 3], bad)
    with raises(ValueError, r"block_size.*positive"):
        impl.BlockHasher().hash_blocks_batch([[1, 2, 3]], bad)
    with raises(ValueError, r"hash_block_size.*positive"):
        impl.hashes_per_block([FA(impl, 16)], bad)
    with raises(ValueError, r"num_kv_heads"):
        impl.GroupSpec("full_attention", 16, num_kv_heads=bad)
    with raises(ValueError, r"hash_block_size"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=bad, scheduler_block_size=16, namespace="ns")
    with raises(ValueError, r"scheduler_block_size"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=bad, namespace="ns")
    with raises(ValueError, r"dcp"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace="ns", dcp=bad)
    with raises(ValueError, r"tp_size"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m"), tp_size=bad)


def test_window_kind_needs_window(impl):
    for kind in ("sliding_window", "chunked_local"):
        with raises(ValueError, rf"{kind}.*window"):
            impl.GroupSpec(kind, 16)


@pytest.mark.parametrize("kind", ["full_attention", "mla", "mamba", "circular_buffer"])
def test_window_on_non_window_kind(impl, kind):
    with raises(ValueError, rf"window=8.*{kind}"):
        impl.GroupSpec(kind, 16, window=8)


def test_negative_stride_arguments(impl):
    with raises(ValueError, r"hashes_per_chunk.*(>= 0|non-negative)"):
        impl.stride_keys(fake_hashes(4), -1)
    with raises(ValueError, r"start_chunk.*(>= 0|non-negative)"):
        impl.stride_keys(fake_hashes(4), 1, -1)


# ---- the resolve error ---------------------------------------------------------------------


def test_resolve_error_names_every_offending_group(impl):
    groups = [FA(impl, 16), MAMBA(impl, 24, mode="none"), FA(impl, 48), RING(impl, 4)]
    with pytest.raises(ValueError) as e:
        impl.resolve_block_sizes(groups)
    msg = str(e.value)
    assert "group 0 (full_attention, 16 tokens)" in msg
    assert "group 1 (mamba, 24 tokens)" in msg
    assert "group 2" not in msg and "group 3" not in msg  # fine / not participating
    assert "H=48" in msg
    assert re.search(r"gcd\D{0,12}8\b", msg), msg  # advice: what would work


def test_resolve_error_with_prefix_match_unit(impl):
    groups = [FA(impl, 64), MLA(impl, 96), MAMBA(impl, 128)]
    with pytest.raises(ValueError) as e:
        impl.resolve_block_sizes(groups, prefix_match_unit=64)
    msg = str(e.value)
    assert "group 1 (mla, 96 tokens)" in msg
    assert "group 0" not in msg and "group 2" not in msg
    assert "H=64" in msg
    assert re.search(r"gcd\D{0,12}32\b", msg), msg
    assert "prefix_match_unit" in msg or "H that divides" in msg


def test_resolve_error_dcp_sizes(impl):
    # dcp scales attention sizes: FA 16 * 2 = 32; mamba 24 stays 24 -> gcd 8, ok; pmu 16 fails both
    groups = [FA(impl, 16), MAMBA(impl, 24)]
    assert impl.resolve_block_sizes(groups, dcp=2) == (96, 8)
    with pytest.raises(ValueError) as e:
        impl.resolve_block_sizes(groups, dcp=2, prefix_match_unit=16)
    assert "group 1 (mamba, 24 tokens)" in str(e.value)
    assert "group 0" not in str(e.value)


def test_hashes_per_block_error(impl):
    with pytest.raises(ValueError) as e:
        impl.hashes_per_block([FA(impl, 16), FA(impl, 24), RING(impl, 4)], 16)
    assert "group 1 (full_attention, 24 tokens)" in str(e.value)
    assert "group 2" not in str(e.value)


# ---- KeyPlanner configuration -------------------------------------------------------------


def test_planner_s_not_multiple_of_h(impl):
    with raises(ValueError, r"scheduler_block_size=24.*hash_block_size=16"):
        impl.KeyPlanner([FA(impl, 8)], hash_block_size=16, scheduler_block_size=24, namespace="ns")


def test_planner_group_not_a_multiple_of_h(impl):
    with raises(ValueError, r"group 1 \(full_attention, 6 tokens\)"):
        impl.KeyPlanner([FA(impl, 16), FA(impl, 6)], hash_block_size=4, scheduler_block_size=48, namespace="ns")


def test_planner_group_not_dividing_s(impl):
    with raises(ValueError, r"group 1 \(mamba, 32 tokens\).*scheduler_block_size=16|scheduler_block_size=16.*group 1 \(mamba, 32 tokens\)"):
        impl.KeyPlanner([FA(impl, 16), MAMBA(impl, 32)], hash_block_size=16, scheduler_block_size=16, namespace="ns")
    # a skipped group need not divide S
    p = impl.KeyPlanner([FA(impl, 16), RING(impl, 5)], hash_block_size=16, scheduler_block_size=16, namespace="ns")
    assert list(p.hashes_per_block) == [1, 0]


def test_planner_str_namespace_with_tp(impl):
    with raises(ValueError, r"tp_size=2.*Namespace"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace="ns", tp_size=2)


@pytest.mark.parametrize("rank", [2, 3, 7])
def test_planner_tp_rank_out_of_range(impl, rank):
    with raises(ValueError, rf"tp_rank={rank}.*tp_size=2"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m"), tp_size=2, tp_rank=rank)
    with raises(ValueError, r"tp_rank"):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m"), tp_size=2, tp_rank=-1)


def test_namespace_rank_disagreeing_with_the_planner(impl):
    """B1: a Namespace naming one TP/PP rank and a planner given another is refused, naming
    both (it used to key silently as the planner's rank, default 0)."""
    fa = [FA(impl, 16)]
    with raises(ValueError, r"tp_rank=0.*tp_rank=1"):
        impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m", tp_rank=1), tp_size=2, tp_rank=0)
    with raises(ValueError, r"pp_rank=2.*pp_rank=1"):
        impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m", pp_rank=1), pp_rank=2)
    # The Namespace's rank must fit tp_size like the planner's own.
    with raises(ValueError, r"tp_rank=1.*tp_size=1"):
        impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m", tp_rank=1))
    with raises(ValueError, r"pp_rank=1.*Namespace"):
        impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace="ns", pp_rank=1)
    with raises(ValueError, r"pp_rank"):
        impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m"), pp_rank=-1)


def test_planner_wrong_namespace_type(impl):
    with pytest.raises(TypeError):
        impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace=3)


def test_group_index_out_of_range(impl):
    p = fa4_mamba16(impl)
    with pytest.raises(IndexError):
        p.key(2, b"x" * 32)
    with pytest.raises(IndexError):
        p.replication(5)


# ---- planner calls --------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [4, 8, 17, -16])
def test_saved_offset_not_a_multiple_of_s(impl, offset):
    p = fa4_mamba16(impl)
    h = fake_hashes(8)
    with raises(ValueError, rf"saved_offset={offset}" if offset > 0 else r"saved_offset"):
        p.plan_save(h, [[1, 2], [3]], 32, saved_offset=offset)


@pytest.mark.parametrize("offset", [4, 8, 17])
def test_tail_plans_from_any_saved_offset(impl, offset):
    # §5's ranges hold for any offset: blocks from min(o // B_g, last) to last.
    p = fa4_mamba16(impl)
    h = fake_hashes(8)
    plan = p.plan_tail(h, [[1, 2, 3, 4, 5, 6, 7, 8], [3]], [(1, 7, 28)], saved_offset=offset)
    fa_blocks = [block for _, group, block in plan.puts if group == 0]
    assert fa_blocks == list(range(offset // 4 + 1, 8))
    with raises(ValueError, r"saved_offset"):
        p.plan_tail(h, [[1, 2], [3]], [(1, 7, 12)], saved_offset=-16)


def test_block_ids_wrong_number_of_tables(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(4)
    for tables in ([[1, 2]], [[1], [2], [3]], []):
        with raises(ValueError, rf"block_ids has {len(tables)} tables for 2 groups"):
            p.plan_save(h, tables, 16)
        with raises(ValueError, rf"block_ids has {len(tables)} tables for 2 groups"):
            p.plan_tail(h, tables, [(1, 7, 12)])
        with raises(ValueError, rf"block_ids has {len(tables)} tables for 2 groups"):
            p.plan_load(h, tables, 12)


def test_block_ids_negative(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(4)
    with raises(ValueError, r"-1"):
        p.plan_save(h, [[1, -1, 3, 4], [5]], 16)
    with raises(ValueError, r"-3"):
        p.plan_tail(h, [[1, 2, 3], [-3]], [(1, 7, 12)])
    with raises(ValueError, r"-2"):
        p.plan_load(h, [[-2], [1]], 4)


def test_extra_keys_length_mismatch(impl):
    h = impl.BlockHasher(seed="0")
    with raises(ValueError, r"extra_keys has 1 entries"):
        h.hash_blocks(list(range(8)), 4, extra_keys=[None])
    with raises(ValueError, r"extra_keys has 3 entries"):
        h.hash_blocks(list(range(9)), 4, extra_keys=[None, ("a",), None])
    with raises(ValueError, r"extra_keys has 1 entries"):
        h.hash_blocks([1, 2, 3], 4, extra_keys=[None])
    assert h.hash_blocks([1, 2, 3], 4, extra_keys=[]) == []


def test_hashes_shorter_than_tokens(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(3)  # 12 tokens' worth
    allkeys = {p.key(g, x) for g in range(2) for x in h}
    # lookup caps at len(h) * H
    assert p.lookup_keys(h, 100) == p.lookup_keys(h, 12) == p.lookup_keys(h, 13)
    assert p.longest_hit(h, 100, allkeys) == 12
    # plan_load with a hit beyond the hashes
    with raises(ValueError, r"hit_tokens=16"):
        p.plan_load(h, [[1, 2, 3, 4], [5]], 16)
    # a tail boundary whose hash is not computed yet
    plan = p.plan_tail(h, [[1, 2, 3, 4], [5]], [(1, 7, 16)])
    assert tail_tuple(plan) == ("hash_pending", 16, [])
    # a save never goes past the known hashes
    save = p.plan_save(h, [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10]], 40)
    assert save.end <= 12 and all(put[0] in allkeys for put in save.puts)


def test_plan_load_bad_hits(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(5)
    with raises(ValueError, r"hit_tokens=6"):
        p.plan_load(h, [[1], [2]], 6)  # not a multiple of the alignment
    with raises(ValueError, r"local_tokens=13"):
        p.plan_load(h, [[1], [2]], 12, local_tokens=13)


def test_bitmap_length_mismatch(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(3)
    n = len(p.lookup_keys(h, 13))
    for bad in (0, n - 1, n + 1):
        with raises(ValueError, rf"bitmap has {bad} entries"):
            p.longest_hit_bitmap(h, 13, [True] * bad)
    assert p.longest_hit_bitmap(h, 13, [True] * n) == 12


# ---- wrong types ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["abcd", ["a", "b"], [1.0, 2.0], [1, 2.5], [None, 1], b"abcd", [1, "2"], [True, 2]],
                         ids=["str", "list-str", "floats", "int-float", "none", "bytes", "int-str", "bool"])
def test_token_type_errors(impl, bad):
    with pytest.raises(TypeError):
        impl.BlockHasher(seed="0").hash_blocks(bad, 1)


def test_other_hashing_type_errors(impl):
    h = impl.BlockHasher(seed="0")
    with pytest.raises(TypeError):
        h.hash_blocks(np.array([1.0, 2.0]), 1)
    with pytest.raises(TypeError):
        h.hash_blocks_batch([[1, 2], ["x"]], 1)
    with pytest.raises(TypeError):
        h.hash_blocks([1, 2], 1.5)
    with pytest.raises(TypeError):
        h.hash_blocks([1, 2], 1, parent="abc")
    with pytest.raises(TypeError):
        h.hash_blocks([1, 2], 1, extra_keys=[{1}, None])


HASH_CALLS = {
    "lookup_keys": lambda p, h: p.lookup_keys(h, 4),
    "longest_hit": lambda p, h: p.longest_hit(h, 4, set()),
    "plan_save": lambda p, h: p.plan_save(h, [[1], [2]], 4),
    "plan_tail": lambda p, h: p.plan_tail(h, [[1], [2]], [(1, 7, 4)]),
    "plan_load": lambda p, h: p.plan_load(h, [[1], [2]], 4),
    "key": lambda p, h: p.key(0, h[0]),
}


@pytest.mark.parametrize("call", list(HASH_CALLS))
@pytest.mark.parametrize("bad", [["ab"], [1, 2], [None], ["00" * 32]], ids=["str", "int", "none", "hex"])
def test_hash_type_errors(impl, call, bad):
    with pytest.raises(TypeError):
        HASH_CALLS[call](fa4_mamba16(impl), bad)


@pytest.mark.parametrize("bad", [["ab"], [1, 2], [None], ["00" * 32]], ids=["str", "int", "none", "hex"])
def test_stride_keys_hash_type_errors(impl, bad):
    with pytest.raises(TypeError):
        impl.stride_keys(bad, 1)


def test_group_type_errors(impl):
    for bad in ([1], ["full_attention"], [FA(impl, 16), (16,)], [None]):
        with pytest.raises(TypeError):
            impl.resolve_block_sizes(bad)
        with pytest.raises(TypeError):
            impl.hashes_per_block(bad, 16)
        with pytest.raises(TypeError):
            impl.KeyPlanner(bad, hash_block_size=16, scheduler_block_size=16, namespace="ns")
    with pytest.raises(TypeError):
        impl.GroupSpec("full_attention", 16.0)
    with pytest.raises(TypeError):
        impl.GroupSpec(3, 16)
    other = __import__("kvstride") if impl.__name__.endswith("_educational") else __import__("kvstride._educational", fromlist=["x"])
    with pytest.raises(TypeError):  # a GroupSpec of the other implementation is not a GroupSpec here
        impl.resolve_block_sizes([other.GroupSpec("full_attention", 16)])


def test_block_id_type_errors(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(4)
    with pytest.raises(TypeError):
        p.plan_save(h, [[1.5], [2]], 16)
    with pytest.raises(TypeError):
        p.plan_save(h, [["1"], [2]], 16)


# ---- empty inputs -------------------------------------------------------------------------


def test_hashes_per_block_no_groups(impl):
    with raises(ValueError, r"(?i)group"):
        impl.hashes_per_block([], 16)


def test_empty_inputs(impl):
    h = impl.BlockHasher(seed="0")
    assert h.hash_blocks([], 4) == []
    assert h.hash_blocks(np.array([], dtype=np.int64), 4) == []
    assert h.hash_blocks_batch([], 4) == []
    assert h.hash_blocks_batch([[], [1]], 4) == [[], []]
    assert impl.stride_keys([], 1) == []
    for fn in (lambda g: impl.resolve_block_sizes(g),
               lambda g: impl.KeyPlanner(g, hash_block_size=16, scheduler_block_size=16, namespace="ns")):
        with raises(ValueError, r"(?i)group"):
            fn([])
    p = fa4_mamba16(impl)
    assert p.lookup_keys([], 64) == []
    assert p.longest_hit([], 64, set()) == 0
    assert p.longest_hit_bitmap([], 64, []) == 0
    assert save_tuple(p.plan_save([], [[], []], 64)) == (0, [])
    assert save_tuple(p.plan_save(fake_hashes(8), [[], []], 32)) == (32, [])
    assert tail_tuple(p.plan_tail([], [[], []], [(1, 7, 12)]))[::2] == ("none", [])
    assert tail_tuple(p.plan_tail(fake_hashes(3), [[1, 2, 3], [4]], []))[::2] == ("none", [])
    assert load_tuple(p.plan_load([], [[], []], 0)) == (0, 0, [], [])
    assert load_tuple(p.plan_load(fake_hashes(3), [[1], [2]], 0)) == (0, 0, [], [])
    assert p.lookup_keys(fake_hashes(3), 0) == []
    assert p.longest_hit(fake_hashes(3), 3, {p.key(0, x) for x in fake_hashes(3)}) == 0
    swa = impl.KeyPlanner([SWA(impl, 16, window=32)], hash_block_size=16, scheduler_block_size=16, namespace="ns")
    assert swa.lookup_keys([], 5) == []
