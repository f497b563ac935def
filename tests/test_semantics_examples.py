"""Every worked example of SEMANTICS.md, plus cases from vLLM's MooncakeStoreConnector (tail
hand-offs E1-E7, lookups E1-E5) and OffloadingConnector (geometry E1-E7, striding X1-X4).
Where SEMANTICS departs from vLLM (Mamba never read from its block table, TP striding phase),
the expected values follow SEMANTICS.
"""

import pytest

from conftest import CHUNKED, FA, MAMBA, MLA, RING, SWA, fake_hashes, load_tuple, save_tuple, tail_tuple

NS = "ns"


def planner(impl, groups, *, pmu=None, dcp=1, namespace=NS, **kw):
    S, H = impl.resolve_block_sizes(groups, prefix_match_unit=pmu, dcp=dcp)
    return impl.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S, namespace=namespace, dcp=dcp, **kw)


def k(p, g, h):
    return p.key(g, h)


# =============================================================================================
# §2 geometry
# =============================================================================================


def test_fa1152_ring4_boots_ring_skipped(impl):
    groups = [FA(impl, 1152), RING(impl, 4)]
    assert impl.resolve_block_sizes(groups) == (1152, 1152)
    assert impl.hashes_per_block(groups, 1152) == [1, 0]
    p = planner(impl, groups)
    assert list(p.hashes_per_block) == [1, 0]
    assert p.alignment == 1152 and p.partial_hits is False
    h = fake_hashes(5)
    n = 5 * 1152 + 7
    tables = [[1, 2, 3, 4, 5, 6], [9]]
    save = p.plan_save(h, tables, n)
    assert save.end == 5 * 1152
    assert [put[1:] for put in save.puts] == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]
    assert [put[0] for put in save.puts] == [k(p, 0, x) for x in h]
    keys = p.lookup_keys(h, n)
    assert keys == [k(p, 0, x) for x in h]
    assert p.longest_hit(h, n, set(keys)) == 5 * 1152
    load = p.plan_load(h, tables, 3 * 1152, local_tokens=1152)
    assert load_tuple(load) == (3456, 1152, [(k(p, 0, h[1]), 0, 2), (k(p, 0, h[2]), 0, 3)], [])
    tail = p.plan_tail(h, tables, [(0, 3, 2304)])
    assert all(put[1] == 0 for put in tail.puts)
    # the ring never appears in any key
    everything = [put[0] for put in save.puts + tail.puts + load.gets] + keys
    assert not any("@group:1@" in key for key in everything)
    # a stride of 0 gives nothing (vLLM's islice(step=0) crash)
    assert impl.stride_keys(h, 0) == []
    assert impl.stride_keys(h, 0, 3) == []


def test_offloading_e1_exact_group_sizes(impl):
    # test_non_prefix_cacheable_group_is_exempt: tokens_per_hash 1152, group sizes [1152, 4]
    groups = [FA(impl, 1152), RING(impl, 4)]
    S, H = impl.resolve_block_sizes(groups)
    assert H == 1152 and S == 1152
    assert [g.block_size for g in groups] == [1152, 4]
    assert [g.prefix_cacheable for g in groups] == [True, False]


def test_fa16_mamba48_align(impl):
    groups = [FA(impl, 16), MAMBA(impl, 48)]
    assert impl.resolve_block_sizes(groups) == (48, 16)
    assert impl.hashes_per_block(groups, 16) == [1, 3]
    p = planner(impl, groups)
    assert p.partial_hits is True and p.alignment == 16


def test_fa16_mamba24_none_is_an_error(impl):
    groups = [FA(impl, 16), MAMBA(impl, 24, mode="none")]
    with pytest.raises(ValueError) as e:
        impl.resolve_block_sizes(groups)
    msg = str(e.value)
    assert "group 0 (full_attention, 16 tokens)" in msg
    assert "48" in msg
    # prefix_match_unit cannot rescue a non-align mamba group: H = S
    with pytest.raises(ValueError):
        impl.resolve_block_sizes(groups, prefix_match_unit=8)


@pytest.mark.parametrize("mode", ["all", "none"])
def test_non_align_mamba_h_equals_s(impl, mode):
    groups = [FA(impl, 48), MAMBA(impl, 48, mode=mode)]
    assert impl.resolve_block_sizes(groups) == (48, 48)
    # prefix_match_unit is ignored when H = S
    assert impl.resolve_block_sizes(groups, prefix_match_unit=16) == (48, 48)
    # a non-cacheable group is never checked, even against H = S
    groups = [FA(impl, 16, prefix_cacheable=False), MAMBA(impl, 48, mode=mode), FA(impl, 48)]
    assert impl.resolve_block_sizes(groups) == (48, 48)
    assert impl.hashes_per_block(groups, 48) == [0, 1, 1]


def dsv4(impl):
    return [
        MLA(impl, 256),
        SWA(impl, 64, window=128),
        CHUNKED(impl, 64, window=256),
        RING(impl, 4, prefix_cacheable=True),
        FA(impl, 8),
    ]


def test_dsv4_five_groups(impl):
    groups = dsv4(impl)
    assert impl.resolve_block_sizes(groups) == (256, 4)
    assert impl.hashes_per_block(groups, 4) == [64, 16, 16, 1, 2]
    p = planner(impl, groups)
    assert list(p.hashes_per_block) == [64, 16, 16, 1, 2]
    h = fake_hashes(200)
    assert impl.stride_keys(h, 64) == [h[63], h[127], h[191]]
    assert impl.stride_keys(h, 16) == h[15::16]
    assert impl.stride_keys(h, 2, 5) == h[11::2]


def test_ring4_ring8_nothing_cacheable(impl):
    groups = [RING(impl, 4), RING(impl, 8)]
    assert impl.resolve_block_sizes(groups) == (8, 4)
    assert impl.hashes_per_block(groups, 4) == [1, 2]


def test_fa1536_mamba1536_prefix_match_unit(impl):
    groups = [FA(impl, 1536), MAMBA(impl, 1536)]
    assert impl.resolve_block_sizes(groups, prefix_match_unit=128) == (1536, 128)
    assert impl.resolve_block_sizes(groups) == (1536, 1536)
    p = planner(impl, groups, pmu=128)
    assert p.partial_hits is True and p.alignment == 128
    assert list(p.hashes_per_block) == [12, 12]
    p2 = planner(impl, groups)
    assert p2.partial_hits is False and p2.alignment == 1536


def test_single_group_and_dcp(impl):
    assert impl.resolve_block_sizes([FA(impl, 16)]) == (16, 16)
    assert impl.resolve_block_sizes([FA(impl, 16)], dcp=4) == (64, 64)
    assert impl.resolve_block_sizes([FA(impl, 16)], prefix_match_unit=16) == (16, 16)
    with pytest.raises(ValueError):
        impl.resolve_block_sizes([FA(impl, 16)], prefix_match_unit=8)
    # offloading E6: DCP=2 scales attention but not mamba: (32, 16)
    groups = [FA(impl, 16), MAMBA(impl, 16)]
    assert impl.resolve_block_sizes(groups, dcp=2) == (32, 16)
    assert impl.hashes_per_block(groups, 16, dcp=2) == [2, 1]


def test_single_group_dcp_rule1(impl):
    # SEMANTICS §2 rule 1: "One group: S = H = block_size · dcp". Mamba state is not sharded
    # by DCP (rule 2), so a lone mamba group keeps its size: (32, 32) could not key it at all.
    assert impl.resolve_block_sizes([FA(impl, 16)], dcp=2) == (32, 32)
    assert impl.resolve_block_sizes([MAMBA(impl, 16)], dcp=2) == (16, 16)
    assert impl.hashes_per_block([MAMBA(impl, 16)], 16, dcp=2) == [1]


def test_offloading_e3_prime_and_e4(impl):
    assert impl.resolve_block_sizes([FA(impl, 48), MAMBA(impl, 48)], prefix_match_unit=16) == (48, 16)
    assert impl.hashes_per_block([FA(impl, 48), MAMBA(impl, 48)], 16) == [3, 3]
    groups = [FA(impl, 12), MLA(impl, 16)]
    assert impl.resolve_block_sizes(groups) == (48, 4)
    assert impl.hashes_per_block(groups, 4) == [3, 4]


def glm(impl):
    return [
        MLA(impl, 3584),
        SWA(impl, 4, window=4, prefix_cacheable=False),  # KpoolTailSpec: not cacheable
        MAMBA(impl, 3584),
        MAMBA(impl, 3584),
        MAMBA(impl, 3584),
        MAMBA(impl, 3584),
        FA(impl, 64),  # drafter
    ]


def test_glm_e7_group_mix(impl):
    groups = glm(impl)
    assert impl.resolve_block_sizes(groups) == (3584, 64)
    assert impl.hashes_per_block(groups, 64) == [56, 0, 56, 56, 56, 56, 1]
    p = planner(impl, groups)
    assert list(p.hashes_per_block) == [56, 0, 56, 56, 56, 56, 1]
    assert p.partial_hits is True
    h = fake_hashes(120)
    assert impl.stride_keys(h, 56) == [h[55], h[111]]
    assert impl.stride_keys(h, 1) == h
    n = 120 * 64
    keys = p.lookup_keys(h, n)
    assert keys and not any("@group:1@" in key for key in keys)
    save = p.plan_save(h, [list(range(1, 10))] * 7, n)
    assert save.puts and not any(put[1] == 1 for put in save.puts)


# =============================================================================================
# §3 striding and keys
# =============================================================================================


def test_stride_fa12_fa16_table(impl):
    # offloading X2 (test_two_groups_different_block_sizes): H=4, g0 K=3, g1 K=4
    groups = [FA(impl, 12), FA(impl, 16)]
    assert impl.hashes_per_block(groups, 4) == [3, 4]
    h = fake_hashes(12)
    # 25 tokens: h0..h5
    g0 = impl.stride_keys(h[:6], 3)
    g1 = impl.stride_keys(h[:6], 4)
    assert g0 == [h[2], h[5]] and g1 == [h[3]]
    # 32 tokens: h0..h7
    assert impl.stride_keys(h[:8], 3, len(g0)) == []
    g1 += impl.stride_keys(h[:8], 4, len(g1))
    assert g1 == [h[3], h[7]]
    # 36 tokens: h0..h8
    g0 += impl.stride_keys(h[:9], 3, len(g0))
    assert g0 == [h[2], h[5], h[8]]
    assert impl.stride_keys(h[:9], 4, len(g1)) == []
    # 48 tokens: h0..h11
    g0 += impl.stride_keys(h[:12], 3, len(g0))
    g1 += impl.stride_keys(h[:12], 4, len(g1))
    assert g0 == [h[2], h[5], h[8], h[11]] and g1 == [h[3], h[7], h[11]]
    # same hash, different key
    p = impl.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=48, namespace=NS)
    assert p.key(0, h[11]) != p.key(1, h[11])
    assert p.key_bytes(0, h[11]) != p.key_bytes(1, h[11])


def test_stride_single_group_incremental(impl):
    # offloading X1: T=16, H=16, blocks_per_chunk 4 -> K=4
    h = fake_hashes(16)
    assert impl.stride_keys(h[:10], 4) == [h[3], h[7]]
    assert impl.stride_keys(h, 4, 2) == [h[11], h[15]]
    assert impl.stride_keys(h, 4, 4) == []
    assert impl.stride_keys(h, 4, 100) == []
    assert impl.stride_keys([], 3) == []
    assert impl.stride_keys(h, 1) == h
    assert impl.stride_keys(h, 1, 5) == h[5:]


def test_key_text_and_binary(impl):
    h = bytes(range(32))
    p = impl.KeyPlanner([FA(impl, 16), MAMBA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace="prefix@model@tp_rank:0@pcp0@dcp0@pp_rank:0")
    assert p.key(0, h) == "prefix@model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + h.hex()
    assert p.key(1, h[:16]) == "prefix@model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@" + h[:16].hex()
    assert p.key_bytes(0, h) == h + b"\x00\x00\x00\x00"
    assert p.key_bytes(1, h) == h + (1).to_bytes(4, "big")
    q = impl.KeyPlanner([FA(impl, 4)] * 3, hash_block_size=4, scheduler_block_size=4, namespace=NS)
    assert q.key_bytes(2, h[:16]) == h[:16] + b"\x00\x00\x00\x02"


def test_namespace_text(impl):
    assert impl.Namespace("m").text() == "m@tp_rank:0@pcp0@dcp0@pp_rank:0"
    ns = impl.Namespace("m", cache_prefix="p", fingerprint="0123456789abcdef", tp_rank=1, pcp_rank=2, dcp_rank=3, pp_rank=4)
    assert ns.text() == "p@m@fp:0123456789abcdef@tp_rank:1@pcp2@dcp3@pp_rank:4"
    assert ns.text(tp_rank=7) == "p@m@fp:0123456789abcdef@tp_rank:7@pcp2@dcp3@pp_rank:4"
    assert ns.text(dcp_rank=0) == "p@m@fp:0123456789abcdef@tp_rank:1@pcp2@dcp0@pp_rank:4"
    # empty cache_prefix / fingerprint are left out: byte-identical to vLLM's keys
    assert impl.Namespace("m", cache_prefix="", fingerprint="").text() == "m@tp_rank:0@pcp0@dcp0@pp_rank:0"
    assert impl.Namespace("m", cache_prefix="cp").text() == "cp@m@tp_rank:0@pcp0@dcp0@pp_rank:0"
    assert impl.Namespace("m", fingerprint="ff").text() == "m@fp:ff@tp_rank:0@pcp0@dcp0@pp_rank:0"


def test_namespace_key_in_planner(impl):
    ns = impl.Namespace("model", cache_prefix="c", fingerprint="fp1")
    p = impl.KeyPlanner([FA(impl, 16)], hash_block_size=16, scheduler_block_size=16, namespace=ns)
    h = bytes(32)
    assert p.key(0, h) == "c@model@fp:fp1@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + "00" * 32


def test_planner_keys_as_the_namespace_rank(impl):
    """B1: a planner not given tp_rank / pp_rank keys as its Namespace's ranks (it used to key
    every rank as tp_rank:0, so TP ranks overwrote each other's head shards)."""
    h = bytes(range(32))
    fa = [FA(impl, 16)]
    for rank in range(2):
        ns = impl.Namespace("m", fingerprint="ab", tp_rank=rank, pp_rank=3)
        p = impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=ns, tp_size=2)
        assert p.key(0, h) == f"m@fp:ab@tp_rank:{rank}@pcp0@dcp0@pp_rank:3@group:0@{h.hex()}"
        # The same rank given on both sides is fine; a rank given to the planner alone too.
        both = impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=ns, tp_size=2, tp_rank=rank, pp_rank=3)
        assert both.key(0, h) == p.key(0, h)
        alone = impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m", fingerprint="ab"), tp_size=2, tp_rank=rank, pp_rank=3)
        assert alone.key(0, h) == p.key(0, h)
    # Neither side names a rank: 0.
    p0 = impl.KeyPlanner(fa, hash_block_size=16, scheduler_block_size=16, namespace=impl.Namespace("m"), tp_size=2)
    assert p0.key(0, h).startswith("m@tp_rank:0@pcp0@dcp0@pp_rank:0@")
    assert str(impl.Namespace("m")) == "m@tp_rank:0@pcp0@dcp0@pp_rank:0"


def test_saved_offset_after_load(impl):
    """B10: after a load of m tokens a request's saves start at floor(m / S) * S."""
    p = impl.KeyPlanner([FA(impl, 16), MAMBA(impl, 64)], hash_block_size=16, scheduler_block_size=64, namespace="ns")
    assert p.alignment == 16
    assert [p.saved_offset_after_load(m) for m in (0, 48, 64, 112, 128)] == [0, 0, 64, 64, 128]


def test_tp_replication_mla_gqa_mamba(impl):
    # T-W test_group_tp_replication_factors_mixed_mla_gqa_mamba: factors (4, 2, 1)
    groups = [MLA(impl, 16), FA(impl, 16, num_kv_heads=2), MAMBA(impl, 16)]
    ns = impl.Namespace("m")
    h = bytes(range(32))
    for rank in range(4):
        p = impl.KeyPlanner(groups, hash_block_size=16, scheduler_block_size=16, namespace=ns, tp_size=4, tp_rank=rank)
        assert [p.replication(g) for g in range(3)] == [4, 2, 1]
        assert p.key(0, h) == f"{ns.text(tp_rank=0)}@group:0@{h.hex()}"
        assert p.key(1, h) == f"{ns.text(tp_rank=rank // 2)}@group:1@{h.hex()}"
        assert p.key(2, h) == f"{ns.text(tp_rank=rank)}@group:2@{h.hex()}"
    # rank 3: MLA key tp 0, GQA key tp 1, Mamba key tp 3
    p3 = impl.KeyPlanner(groups, hash_block_size=16, scheduler_block_size=16, namespace=ns, tp_size=4, tp_rank=3)
    assert "@tp_rank:0@" in p3.key(0, h) and "@tp_rank:1@" in p3.key(1, h) and "@tp_rank:3@" in p3.key(2, h)
    # dcp > 1: replication 1 everywhere
    pd = impl.KeyPlanner(groups, hash_block_size=16, scheduler_block_size=64, namespace=ns, tp_size=4, tp_rank=3, dcp=4)
    assert [pd.replication(g) for g in range(3)] == [1, 1, 1]
    # num_kv_heads >= tp_size: replication 1
    pk = impl.KeyPlanner([FA(impl, 16, num_kv_heads=8)], hash_block_size=16, scheduler_block_size=16, namespace=ns, tp_size=4, tp_rank=1)
    assert pk.replication(0) == 1


def test_tp_put_striding_phase(impl):
    # b % r == (tp_rank + g) % r; group 0 GQA (r=2), group 1 MLA (r=2)
    groups = [FA(impl, 4, num_kv_heads=1), MLA(impl, 4)]
    ns = impl.Namespace("m")
    h = fake_hashes(6)
    tables = [[1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]]
    for rank in range(2):
        p = impl.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=4, namespace=ns, tp_size=2, tp_rank=rank)
        save = p.plan_save(h, tables, 24)
        want = []
        for g in range(2):
            for b in range(6):
                if b % 2 == (rank + g) % 2:
                    want.append((p.key(g, h[b]), g, tables[g][b]))
        assert [tuple(x) for x in save.puts] == want
        assert save.end == 24


# =============================================================================================
# §4 normal save (rules, no worked example in SEMANTICS)
# =============================================================================================


def test_save_mamba_never_read_from_block_table(impl):
    p = planner(impl, [FA(impl, 4), MAMBA(impl, 16)])
    h = fake_hashes(8)
    save = p.plan_save(h, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [21, 22, 23]], 35)
    assert save.end == 32
    assert [tuple(x) for x in save.puts] == [(p.key(0, h[b]), 0, b + 1) for b in range(8)]
    # with an offset: only blocks past it; NULL ids skipped
    save2 = p.plan_save(h, [[1, 2, 3, 4, 0, 6, 7, 8], [21, 22]], 35, saved_offset=16)
    assert [tuple(x) for x in save2.puts] == [(p.key(0, h[b]), 0, b + 1) for b in (5, 6, 7)]
    # existing keys dropped
    save3 = p.plan_save(h, [[1, 2, 3, 4, 5, 6, 7, 8], []], 32, saved_offset=16, exists={p.key(0, h[5])})
    assert [tuple(x) for x in save3.puts] == [(p.key(0, h[b]), 0, b + 1) for b in (4, 6, 7)]
    # nothing new: end stays at the offset
    assert save_tuple(p.plan_save(h, [[1], [2]], 20, saved_offset=16)) == (16, [])


# =============================================================================================
# §5 partial tail
# =============================================================================================


def fa4_mamba16(impl):
    p = planner(impl, [FA(impl, 4), MAMBA(impl, 16)])
    assert (p.scheduler_block_size, p.hash_block_size, p.alignment) == (16, 4, 4)
    return p


def test_semantics_tail_example_1(impl):  # = mooncake §3.6 E2
    p = fa4_mamba16(impl)
    h = fake_hashes(3)
    plan = p.plan_tail(h, [[1, 2, 3], [4]], [(1, 7, 12)])
    assert tail_tuple(plan) == ("planned", 12, [
        (p.key(0, h[0]), 0, 1), (p.key(0, h[1]), 0, 2), (p.key(0, h[2]), 0, 3), (p.key(1, h[2]), 1, 7)])


def test_semantics_tail_example_2(impl):  # = mooncake §3.6 E6
    p = fa4_mamba16(impl)
    h = fake_hashes(8)
    plan = p.plan_tail(h, [[1, 2, 3, 4, 5, 6, 7, 8], [4, 9]], [(1, 77, 28)], saved_offset=16)
    assert tail_tuple(plan) == ("planned", 28, [
        (p.key(0, h[4]), 0, 5), (p.key(0, h[5]), 0, 6), (p.key(0, h[6]), 0, 7), (p.key(1, h[6]), 1, 77)])


def test_tail_outcomes(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(3)
    t = [[1, 2, 3], [4]]
    assert tail_tuple(p.plan_tail([], t, [(1, 7, 12)])) [0] == "none"
    assert tail_tuple(p.plan_tail([], t, [(1, 7, 12)]))[2] == []
    assert tail_tuple(p.plan_tail(h, t, []))[0::2] == ("none", [])
    for bad in (6, 0, 13):
        plan = p.plan_tail(h, t, [(1, 7, bad)])
        assert plan.outcome == "invalid_boundary" and list(plan.puts) == []
    plan = p.plan_tail(h, t, [(1, 7, 12), (0, 3, 8)])
    assert plan.outcome == "divergent_boundaries" and list(plan.puts) == []
    plan = p.plan_tail(h, t, [(1, 7, 16)])
    assert plan.outcome == "hash_pending" and list(plan.puts) == []
    assert p.plan_tail(h, t, [(1, 7, 12)], exists={p.key(0, x) for x in h} | {p.key(1, h[2])}).outcome == "all_present"
    # no source block at all: NULL hand-off, NULL FA table
    plan = p.plan_tail(h, [[0, 0, 0], [4]], [(1, 0, 12)])
    assert (plan.outcome, list(plan.puts)) == ("none", [])
    # the last hand-off for a group wins
    plan = p.plan_tail(h, t, [(1, 7, 12), (1, 8, 12)])
    assert tuple(plan.puts[-1]) == (p.key(1, h[2]), 1, 8)
    # a NULL hand-off does not override an earlier block
    plan = p.plan_tail(h, t, [(1, 7, 12), (1, 0, 12)])
    assert tuple(plan.puts[-1]) == (p.key(1, h[2]), 1, 7)


def test_tail_without_partial_hits_alignment_is_s(impl):
    p = planner(impl, [FA(impl, 16), MAMBA(impl, 16)])
    assert p.partial_hits is False and p.alignment == 16
    h = fake_hashes(8)
    assert p.plan_tail(h, [[1, 2], [3]], [(1, 7, 12)]).outcome == "invalid_boundary"
    plan = p.plan_tail(h, [[1, 2], [3]], [(1, 7, 32)])
    assert tail_tuple(plan) == ("planned", 32, [(p.key(0, h[0]), 0, 1), (p.key(0, h[1]), 0, 2), (p.key(1, h[1]), 1, 7)])


def test_mooncake_tail_e1(impl):
    p = planner(impl, [FA(impl, 16), MAMBA(impl, 16)], pmu=4)
    assert p.partial_hits is True
    h = fake_hashes(5)
    plan = p.plan_tail(h, [[1], [2]], [(1, 7, 12)])
    assert tail_tuple(plan) == ("planned", 12, [(p.key(0, h[2]), 0, 1), (p.key(1, h[2]), 1, 7)])


def test_mooncake_tail_e3_realistic(impl):
    p = planner(impl, [FA(impl, 1536), MAMBA(impl, 1536)], pmu=128)
    h = fake_hashes(900 // 128)
    assert len(h) == 7
    assert save_tuple(p.plan_save(h, [[5], [6]], 900)) == (0, [])
    plan = p.plan_tail(h, [[5], [6]], [(1, 42, 896)])
    assert tail_tuple(plan) == ("planned", 896, [(p.key(0, h[6]), 0, 5), (p.key(1, h[6]), 1, 42)])


def test_mooncake_tail_e4_saved_offset_and_interior(impl):
    p = planner(impl, [FA(impl, 1152), MAMBA(impl, 1152)], pmu=64)
    h = fake_hashes(3000 // 64)
    assert len(h) == 46
    tables = [[11, 12, 13], [21, 22, 23]]  # mamba interior slots hold stale, non-NULL ids (F8)
    plan = p.plan_tail(h, tables, [(1, 99, 2944)], saved_offset=2304)
    assert tail_tuple(plan) == ("planned", 2944, [(p.key(0, h[45]), 0, 13), (p.key(1, h[45]), 1, 99)])
    plan = p.plan_tail(h, tables, [(1, 99, 2944)], saved_offset=0)
    # SEMANTICS departs from vLLM: mamba blocks 0,1 are never read from the block table
    assert tail_tuple(plan) == ("planned", 2944, [
        (p.key(0, h[17]), 0, 11), (p.key(0, h[35]), 0, 12), (p.key(0, h[45]), 0, 13), (p.key(1, h[45]), 1, 99)])


def test_mooncake_tail_e5_tp_striding(impl):
    groups = [MLA(impl, 16), MAMBA(impl, 16)]
    ns = impl.Namespace("m")
    h = fake_hashes(10)
    tables = [[1, 2, 3], [0, 0, 9]]
    out = {}
    for rank in range(2):
        p = impl.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=16, namespace=ns, tp_size=2, tp_rank=rank)
        assert p.replication(0) == 2 and p.replication(1) == 1
        out[rank] = (p, p.plan_tail(h, tables, [(1, 42, 40)]))
    p0, t0 = out[0]
    p1, t1 = out[1]
    mla0 = f"{ns.text(tp_rank=0)}@group:0@"
    # rank 0: MLA phase (0+0)%2 = 0 -> blocks 0, 2 -> h[3], h[9]; Mamba h[9] from CoW 42, tp_rank:0
    assert tail_tuple(t0) == ("planned", 40, [
        (mla0 + h[3].hex(), 0, 1), (mla0 + h[9].hex(), 0, 3), (f"{ns.text(tp_rank=0)}@group:1@{h[9].hex()}", 1, 42)])
    # rank 1: MLA phase 1 -> block 1 -> h[7]; Mamba h[9] under tp_rank:1
    assert tail_tuple(t1) == ("planned", 40, [
        (mla0 + h[7].hex(), 0, 2), (f"{ns.text(tp_rank=1)}@group:1@{h[9].hex()}", 1, 42)])


def test_mooncake_tail_e7_dedup_and_exists(impl):
    ns = "vllm-mooncake-store:test-model"
    p = impl.KeyPlanner([FA(impl, 4)], hash_block_size=4, scheduler_block_size=4, namespace=ns)
    h = [b"a0", b"a1", b"a2"]
    plan = p.plan_tail(h, [[1, 2, 3]], [(0, 0, 12)], exists={f"{ns}@group:0@6130"})
    assert tail_tuple(plan) == ("planned", 12, [(f"{ns}@group:0@6131", 0, 2), (f"{ns}@group:0@6132", 0, 3)])
    plan = p.plan_tail(h, [[0, 2, 3]], [(0, 0, 12)])
    assert tail_tuple(plan) == ("planned", 12, [(f"{ns}@group:0@6131", 0, 2), (f"{ns}@group:0@6132", 0, 3)])
    plan = p.plan_tail(h, [[1, 2, 3]], [(0, 0, 12)], exists={f"{ns}@group:0@613{i}" for i in range(3)})
    assert tail_tuple(plan) == ("all_present", 12, [])
    # duplicate hashes give duplicate keys: put once (first block wins)
    plan = p.plan_tail([b"a0", b"a0", b"a2"], [[1, 2, 3]], [(0, 0, 12)])
    assert tail_tuple(plan) == ("planned", 12, [(f"{ns}@group:0@6130", 0, 1), (f"{ns}@group:0@6132", 0, 3)])


# =============================================================================================
# §6 lookup
# =============================================================================================


def test_semantics_lookup_example_1(impl):  # = mooncake §4.5 E1
    p = planner(impl, [FA(impl, 16), MAMBA(impl, 16)], pmu=4)
    h = fake_hashes(3)
    present = {p.key(0, h[2]), p.key(1, h[2])}
    assert p.longest_hit(h, 13, present) == 12
    assert p.longest_hit(h, 12, present) == 0
    keys = p.lookup_keys(h, 13)
    assert len(keys) == 6 and set(keys) == {p.key(g, x) for g in range(2) for x in h}
    bitmap = [key in present for key in keys]
    assert sum(bitmap) == 2
    assert p.longest_hit_bitmap(h, 13, bitmap) == 12
    assert p.longest_hit_bitmap(h, 12, [key in present for key in p.lookup_keys(h, 12)]) == 0


def test_semantics_lookup_example_2(impl):  # = mooncake §4.5 E2
    p = planner(impl, [FA(impl, 32), MAMBA(impl, 32)], pmu=16)
    assert p.alignment == 16
    h = fake_hashes(4)
    present = {p.key(0, h[1]), p.key(0, h[2]), p.key(1, h[1])}
    assert p.longest_hit(h, 64, present) == 32
    assert p.longest_hit(h, 64, present | {p.key(1, h[2])}) == 48


def test_mooncake_lookup_e3(impl):
    p = planner(impl, [FA(impl, 1536), MAMBA(impl, 1536)], pmu=128)
    h = fake_hashes(7)
    tail = p.plan_tail(h, [[5], [6]], [(1, 42, 896)])
    present = {put[0] for put in tail.puts}
    consumer = h + fake_hashes(1, salt=b"other")  # 1000 tokens: 7 shared hashes, then its own
    assert p.longest_hit(consumer[:7], 1000, present) == 896
    assert p.longest_hit(h, 896, present) == 0
    assert p.longest_hit(h, 897, present) == 896


def test_mooncake_lookup_e4(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(3)
    present = {p.key(0, h[0]), p.key(0, h[2]), p.key(1, h[2])}
    assert p.longest_hit(h, 13, present) == 0
    assert p.longest_hit(h, 13, present | {p.key(0, h[1])}) == 12


def test_mooncake_lookup_e5_swa(impl):
    p = planner(impl, [SWA(impl, 16, window=32), FA(impl, 16)])
    assert (p.scheduler_block_size, p.hash_block_size, p.alignment) == (16, 16, 16)
    h = fake_hashes(4)
    everything = set(p.lookup_keys(h, 65)) | {p.key(g, x) for g in range(2) for x in h}
    assert p.longest_hit(h, 65, everything) == 64
    assert p.longest_hit(h, 64, everything) == 48
    deleted = everything - {p.key(0, h[0]), p.key(0, h[1])}
    assert p.longest_hit(h, 65, deleted) == 64
    assert p.longest_hit(h, 64, deleted) == 0


def test_mooncake_lookup_sharded_mamba(impl):
    groups = [FA(impl, 32), MAMBA(impl, 32)]
    ns = impl.Namespace("m")
    p = impl.KeyPlanner(groups, hash_block_size=16, scheduler_block_size=32, namespace=ns, tp_size=2, tp_rank=0)
    h = fake_hashes(2)
    present = {f"{ns.text(tp_rank=t)}@group:0@{x.hex()}" for t in range(2) for x in h}
    present |= {f"{ns.text(tp_rank=t)}@group:1@{h[1].hex()}" for t in range(2)}
    assert set(present) <= set(p.lookup_keys(h, 33))
    assert p.longest_hit(h, 33, present) == 32
    missing = present - {f"{ns.text(tp_rank=1)}@group:1@{h[1].hex()}"}
    assert p.longest_hit(h, 33, missing) == 0


def test_lookup_zero_and_caps(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(3)
    allkeys = set(p.lookup_keys(h, 100))
    assert p.longest_hit(h, 0, allkeys) == 0
    assert p.lookup_keys([], 40) == []
    assert p.longest_hit([], 40, allkeys) == 0
    # capped at len(h) * H even for a longer request
    assert p.longest_hit(h, 100, allkeys) == 12
    assert p.longest_hit(h, 12, allkeys) == 8


# =============================================================================================
# §7 load plan (rules)
# =============================================================================================


def test_load_plan_fa_and_mamba(impl):
    p = fa4_mamba16(impl)
    h = fake_hashes(5)
    plan = p.plan_load(h, [[1, 2, 3, 4, 5], [8, 9]], 12)
    assert load_tuple(plan) == (12, 0, [
        (p.key(0, h[0]), 0, 1), (p.key(0, h[1]), 0, 2), (p.key(0, h[2]), 0, 3), (p.key(1, h[2]), 1, 8)], [])
    # local prefix: start = floor(c / S) * S
    plan = p.plan_load(h, [[1, 2, 3, 4, 5], [8, 9]], 20, local_tokens=17)
    assert load_tuple(plan) == (20, 16, [(p.key(0, h[4]), 0, 5), (p.key(1, h[4]), 1, 9)], [])
    # NULL destinations are reported as missing
    plan = p.plan_load(h, [[1, 0, 3], [0]], 12)
    assert load_tuple(plan)[2:] == ([(p.key(0, h[0]), 0, 1), (p.key(0, h[2]), 0, 3)], [(0, 1), (1, 0)])


def test_load_plan_swa_window_tail(impl):
    p = planner(impl, [SWA(impl, 16, window=32), FA(impl, 16)])
    h = fake_hashes(6)
    plan = p.plan_load(h, [[1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]], 96)
    gets = [tuple(x) for x in plan.gets]
    # needed(96) = [65, 96): blocks 4, 5
    assert [x for x in gets if x[1] == 0] == [(p.key(0, h[4]), 0, 5), (p.key(0, h[5]), 0, 6)]
    assert [x for x in gets if x[1] == 1] == [(p.key(1, h[b]), 1, 11 + b) for b in range(6)]


def test_dedup_gets(impl):
    gets = [("a", 0, 1), ("b", 0, 2), ("a", 1, 3), ("c", 1, 4), ("b", 1, 5)]
    keys, where = impl.dedup_gets(gets)
    assert list(keys) == ["a", "b", "c"]
    assert [list(w) for w in where] == [[0, 2], [1, 4], [3]]
