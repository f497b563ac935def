"""Differential tests: the Rust core (``kvstride``) against its pure-Python twin
(``kvstride._educational``) on random group mixes, plus properties of SEMANTICS.md checked
through the public API."""

import hashlib

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import IMPLS, load_tuple, save_tuple, tail_tuple

CORE, TWIN = IMPLS["core"], IMPLS["twin"]
KINDS = ["full_attention", "mla", "sliding_window", "chunked_local", "mamba", "circular_buffer"]
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))


def outcome(fn, *args, **kw):
    """('ok', value) or ('err', exception type): both sides must agree on either."""
    try:
        return ("ok", fn(*args, **kw))
    except (ValueError, TypeError, IndexError) as e:
        return ("err", type(e).__name__)


# ---- strategies -----------------------------------------------------------------------------


@st.composite
def group_params(draw):
    kind = draw(st.sampled_from(KINDS))
    unit = draw(st.sampled_from([1, 2, 4, 8]))
    block = unit * draw(st.sampled_from([1, 1, 2, 3, 4, 6]))
    window = draw(st.integers(1, 48)) if kind in ("sliding_window", "chunked_local") else None
    mode = draw(st.sampled_from(["align"] * 4 + ["all", "none"]))
    pc = draw(st.sampled_from([None, None, None, True, False]))
    heads = draw(st.sampled_from([None, None, 1, 2, 4, 8]))
    return dict(kind=kind, block_size=block, window=window, mamba_mode=mode, prefix_cacheable=pc, num_kv_heads=heads)


def make_groups(impl, params):
    return [
        impl.GroupSpec(p["kind"], p["block_size"], window=p["window"], mamba_mode=p["mamba_mode"],
                       prefix_cacheable=p["prefix_cacheable"], num_kv_heads=p["num_kv_heads"])
        for p in params
    ]


@st.composite
def config(draw):
    params = draw(st.lists(group_params(), min_size=1, max_size=4))
    dcp = draw(st.sampled_from([1, 1, 1, 2]))
    pmu = draw(st.sampled_from([None, None, None, 1, 2, 4, 8, 16]))
    tp_size = draw(st.sampled_from([1, 1, 2, 4]))
    tp_rank = draw(st.integers(0, tp_size - 1))
    partial = draw(st.sampled_from([None, None, None, True, False]))
    str_ns = tp_size == 1 and draw(st.booleans())
    return dict(params=params, dcp=dcp, pmu=pmu, tp_size=tp_size, tp_rank=tp_rank, partial=partial, str_ns=str_ns)


def build(impl, cfg, S, H, tp_rank=None):
    groups = make_groups(impl, cfg["params"])
    ns = "cp@m@tp_rank:0@pcp0@dcp0@pp_rank:0" if cfg["str_ns"] else impl.Namespace("m", fingerprint="f00d", pp_rank=1)
    return impl.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S, namespace=ns,
                           partial_hits=cfg["partial"], dcp=cfg["dcp"], tp_size=cfg["tp_size"],
                           tp_rank=cfg["tp_rank"] if tp_rank is None else tp_rank)


def resolve_both(cfg):
    a = outcome(CORE.resolve_block_sizes, make_groups(CORE, cfg["params"]), prefix_match_unit=cfg["pmu"], dcp=cfg["dcp"])
    b = outcome(TWIN.resolve_block_sizes, make_groups(TWIN, cfg["params"]), prefix_match_unit=cfg["pmu"], dcp=cfg["dcp"])
    assert a == b, (cfg, a, b)
    return a


def fake_hashes(n, salt):
    return [hashlib.sha256(b"%d:%d" % (salt, i)).digest()[: (16 if salt % 3 == 0 else 32)] for i in range(n)]


@st.composite
def scenario(draw, repeats=False):
    """A resolvable config, both planners, hashes, tables, hand-offs, offsets. ``repeats``:
    sometimes repeat a hash (so that two blocks map to one key)."""
    cfg = draw(config())
    res = resolve_both(cfg)
    assume(res[0] == "ok")
    S, H = res[1]
    assume(S <= 96 and S // H <= 24)
    core, twin = build(CORE, cfg, S, H), build(TWIN, cfg, S, H)
    nh = draw(st.integers(0, min(40, 4 * S // H + 6)))
    hashes = fake_hashes(nh, draw(st.integers(0, 10**6)))
    if repeats and nh and draw(st.booleans()):  # repeated hashes -> duplicate keys
        i, j = draw(st.integers(0, nh - 1)), draw(st.integers(0, nh - 1))
        hashes[i] = hashes[j]
    maxb = nh * H + 2
    tables = []
    for spec in make_groups(CORE, cfg["params"]):
        e = spec.block_size * (1 if spec.kind == "mamba" else cfg["dcp"])
        length = draw(st.integers(0, maxb // e + 2))
        tables.append(draw(st.lists(st.one_of(st.just(0), st.integers(1, 50)), min_size=length, max_size=length)))
    ngroups = len(cfg["params"])
    a = core.alignment
    boundary = draw(st.one_of(st.integers(0, nh + 2).map(lambda u: u * a), st.integers(-0, nh * H + 8)))
    nhand = draw(st.integers(0, 3))
    hand = []
    for _ in range(nhand):
        g = draw(st.integers(0, ngroups - 1))
        b = draw(st.one_of(st.just(0), st.integers(1, 60)))
        bd = boundary if draw(st.integers(0, 4)) else draw(st.integers(0, nh * H + 8))
        hand.append((g, b, bd))
    offset = S * draw(st.integers(0, nh * H // S + 1))
    n = draw(st.integers(0, nh * H + 2 * S))
    return dict(cfg=cfg, S=S, H=H, core=core, twin=twin, hashes=hashes, tables=tables, hand=hand, offset=offset, n=n)


# ---- geometry -------------------------------------------------------------------------------


@SETTINGS
@given(cfg=config(), h=st.integers(1, 64))
def test_resolve_and_hashes_per_block_agree(cfg, h):
    res = resolve_both(cfg)
    gc, gt = make_groups(CORE, cfg["params"]), make_groups(TWIN, cfg["params"])
    a = outcome(CORE.hashes_per_block, gc, h, dcp=cfg["dcp"])
    b = outcome(TWIN.hashes_per_block, gt, h, dcp=cfg["dcp"])
    assert a == b
    if res[0] == "ok":
        S, H = res[1]
        hc = CORE.hashes_per_block(gc, H, dcp=cfg["dcp"])
        assert hc == TWIN.hashes_per_block(gt, H, dcp=cfg["dcp"])
        assert S % H == 0
        # planners agree on construction and geometry
        pc, pt = outcome(build, CORE, cfg, S, H), outcome(build, TWIN, cfg, S, H)
        assert pc[0] == pt[0]
        if pc[0] == "ok":
            pc, pt = pc[1], pt[1]
            assert list(pc.hashes_per_block) == list(pt.hashes_per_block) == hc
            assert (pc.alignment, pc.partial_hits) == (pt.alignment, pt.partial_hits)
            assert [pc.replication(g) for g in range(len(gc))] == [pt.replication(g) for g in range(len(gc))]
            x = bytes(range(32))
            assert [pc.key(g, x) for g in range(len(gc))] == [pt.key(g, x) for g in range(len(gc))]
            assert [pc.key_bytes(g, x) for g in range(len(gc))] == [pt.key_bytes(g, x) for g in range(len(gc))]
    # construction agrees for arbitrary (S, H) too
    for S, H in ((h * 2, h), (h, h), (48, 16)):
        assert outcome(build, CORE, cfg, S, H)[0] == outcome(build, TWIN, cfg, S, H)[0]


@SETTINGS
@given(n=st.integers(0, 60), k=st.integers(0, 9), start=st.integers(0, 30))
def test_stride_keys_agree(n, k, start):
    h = fake_hashes(n, 7)
    got = CORE.stride_keys(h, k, start)
    assert got == TWIN.stride_keys(h, k, start)
    assert got == ([] if k == 0 else h[start * k + k - 1 :: k])
    # incremental: a second call from the number of keys already derived only appends
    if k:
        first = CORE.stride_keys(h[: n // 2], k)
        assert first + CORE.stride_keys(h, k, len(first)) == CORE.stride_keys(h, k)
        assert CORE.stride_keys(h, k, len(CORE.stride_keys(h, k))) == []


# ---- plans ----------------------------------------------------------------------------------


@SETTINGS
@given(sc=scenario(), data=st.data())
def test_plans_agree(sc, data):
    check_plans_agree(sc, data)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(sc=scenario(repeats=True), data=st.data())
def test_plans_agree_with_repeated_hashes(sc, data):
    check_plans_agree(sc, data)


def check_plans_agree(sc, data):
    core, twin, h, tables = sc["core"], sc["twin"], sc["hashes"], sc["tables"]
    n, o = sc["n"], sc["offset"]
    # striding by each group's hashes_per_block
    for k in core.hashes_per_block:
        s = data.draw(st.integers(0, 5))
        assert CORE.stride_keys(h, k, s) == TWIN.stride_keys(h, k, s)

    exists_pool = set(core.lookup_keys(h, n + 64))
    exists = set(data.draw(st.lists(st.sampled_from(sorted(exists_pool)), max_size=10))) if exists_pool else set()

    a = outcome(lambda p: save_tuple(p.plan_save(h, tables, n, saved_offset=o, exists=exists)), core)
    b = outcome(lambda p: save_tuple(p.plan_save(h, tables, n, saved_offset=o, exists=exists)), twin)
    assert a == b, ("plan_save", a, b)
    if a[0] == "ok":
        keys = [put[0] for put in a[1][1]]
        assert len(keys) == len(set(keys))
        assert not keys or not exists & set(keys)

    # §8 admission: the boundaries, their hashes, and a save that keeps only their window tails
    interval = data.draw(st.one_of(st.none(), st.integers(0, 3).map(lambda k: k * core.scheduler_block_size)))
    marks = core.boundary_hashes(h, n)
    assert marks == twin.boundary_hashes(h, n)
    seen = data.draw(st.lists(st.booleans(), min_size=len(marks), max_size=len(marks)))
    admitted = core.hit_boundaries(n, retention_interval=interval, seen=seen)
    assert admitted == twin.hit_boundaries(n, retention_interval=interval, seen=seen)
    assert (admitted is None) == (interval is None)
    if admitted is not None:
        assert all(0 < x <= n and x % core.alignment == 0 for x in admitted)
    a = outcome(lambda p: save_tuple(p.plan_save(h, tables, n, saved_offset=o, exists=exists, boundaries=admitted)), core)
    b = outcome(lambda p: save_tuple(p.plan_save(h, tables, n, saved_offset=o, exists=exists, boundaries=admitted)), twin)
    assert a == b, ("plan_save admitted", admitted, a, b)

    a = outcome(lambda p: tail_tuple(p.plan_tail(h, tables, sc["hand"], saved_offset=o, exists=exists)), core)
    b = outcome(lambda p: tail_tuple(p.plan_tail(h, tables, sc["hand"], saved_offset=o, exists=exists)), twin)
    assert a == b, ("plan_tail", sc["hand"], a, b)
    if a[0] == "ok":
        keys = [put[0] for put in a[1][2]]
        assert len(keys) == len(set(keys))
        groups_in_order = [put[1] for put in a[1][2]]
        assert groups_in_order == sorted(groups_in_order)

    lk = core.lookup_keys(h, n)
    assert lk == twin.lookup_keys(h, n)
    assert len(lk) == len(set(lk))
    # the core and the twin see the same present sets
    bits = data.draw(st.lists(st.booleans(), min_size=len(lk), max_size=len(lk)))
    present = {key for key, bit in zip(lk, bits) if bit}
    if data.draw(st.booleans()):
        present = set(lk) - set(data.draw(st.lists(st.sampled_from(lk), max_size=3))) if lk else set()
        bits = [key in present for key in lk]
    hit = core.longest_hit(h, n, present)
    assert hit == twin.longest_hit(h, n, present), (lk, present)
    assert core.longest_hit_bitmap(h, n, bits) == twin.longest_hit_bitmap(h, n, bits) == hit
    assert hit % core.alignment == 0 and hit <= len(h) * core.hash_block_size
    assert hit == 0 or hit < n

    # load plans for the hit and for other valid hits
    H, a_ = core.hash_block_size, core.alignment
    hits = {hit, data.draw(st.integers(0, len(h) * H // a_)) * a_}
    for m in hits:
        c = data.draw(st.integers(0, m))
        x = outcome(lambda p: load_tuple(p.plan_load(h, tables, m, local_tokens=c)), core)
        y = outcome(lambda p: load_tuple(p.plan_load(h, tables, m, local_tokens=c)), twin)
        assert x == y, ("plan_load", m, c, x, y)
        # A hit's boundary set: per group, what a load of it from nothing reads.
        whole = core.plan_load(h, tables, m)
        per_group = [0] * len(core.hashes_per_block)
        for g in [get[1] for get in whole.gets] + [miss[0] for miss in whole.missing]:
            per_group[g] += 1
        assert list(core.hit_set_blocks(m)) == twin.hit_set_blocks(m) == per_group, ("hit_set_blocks", m)
    bad_m = data.draw(st.integers(0, len(h) * H + 3 * a_))
    x = outcome(lambda p: load_tuple(p.plan_load(h, tables, bad_m)), core)
    y = outcome(lambda p: load_tuple(p.plan_load(h, tables, bad_m)), twin)
    assert x == y, ("plan_load", bad_m, x, y)
    dx = CORE.dedup_gets(x[1][2]) if x[0] == "ok" else None
    dy = TWIN.dedup_gets(y[1][2]) if y[0] == "ok" else None
    if dx is not None:
        assert (list(dx[0]), [list(w) for w in dx[1]]) == (list(dy[0]), [list(w) for w in dy[1]])


# ---- properties -----------------------------------------------------------------------------


def _needed(kind, window, B, X):
    if X <= 0:
        return []
    lo = max(0, X - window + 1) if kind == "sliding_window" else (X // window) * window
    if lo >= X:
        return []
    return list(range(lo // B, (X - 1) // B + 1))


def ref_servable(p, specs, sizes, h, X, present):
    """SEMANTICS §6 literally, for a tp_size=1 planner."""
    if X == 0:
        return True
    H = p.hash_block_size
    if X % p.alignment or X // H > len(h):
        return False

    def has(g, t):
        return p.key(g, h[t // H - 1]) in present

    for g, spec in enumerate(specs):
        if p.hashes_per_block[g] == 0:
            continue
        B = sizes[g]
        if spec.kind == "mamba":
            ok = has(g, X)
        elif spec.kind in ("sliding_window", "chunked_local"):
            ok = all(has(g, min((b + 1) * B, X)) for b in _needed(spec.kind, spec.window, B, X))
        else:  # full_attention, mla (and a participating ring, keyed like full attention)
            ok = all(has(g, (b + 1) * B) for b in range(X // B)) and (X % B == 0 or has(g, X))
        if not ok:
            return False
    return True


def ref_servable_one(p, specs, sizes, h, X, present):
    """ref_servable restricted to the groups left in ``specs`` (None = left out)."""
    if X == 0:
        return True

    class Only:
        def __init__(self, p, keep):
            self.hash_block_size, self.alignment, self.key = p.hash_block_size, p.alignment, p.key
            self.hashes_per_block = [k if keep[i] else 0 for i, k in enumerate(p.hashes_per_block)]

    keep = [s is not None for s in specs]
    full = [s if s is not None else specs[[i for i, x in enumerate(keep) if x][0]] for s in specs]
    return ref_servable(Only(p, keep), full, sizes, h, X, present)


def ref_hit(p, specs, sizes, h, n, present):
    a, H = p.alignment, p.hash_block_size

    def best(T):
        X = T
        while X > 0 and not ref_servable(p, specs, sizes, h, X, present):
            X -= a
        return max(X, 0)

    if n == 0:
        return 0
    hit = best(min(n, len(h) * H) // a * a)
    if hit >= n:
        hit = best(min(n - 1, len(h) * H) // a * a)
    return hit


@SETTINGS
@given(sc=scenario(), data=st.data())
def test_longest_hit_is_what_every_group_serves(sc, data):
    assume(sc["cfg"]["tp_size"] == 1)
    specs = make_groups(CORE, sc["cfg"]["params"])
    dcp = sc["cfg"]["dcp"]
    sizes = [s.block_size * (1 if s.kind == "mamba" else dcp) for s in specs]
    h, n = sc["hashes"], sc["n"]
    for impl_name, p in (("core", sc["core"]), ("twin", sc["twin"])):
        lk = p.lookup_keys(h, n)
        bits = data.draw(st.lists(st.booleans(), min_size=len(lk), max_size=len(lk)))
        present = {key for key, bit in zip(lk, bits) if bit or data.draw(st.integers(0, 3))}
        hit = p.longest_hit(h, n, present)
        # never a length some group cannot serve, and the largest one they all can
        assert ref_servable(p, specs, sizes, h, hit, present), (impl_name, hit)
        assert hit == ref_hit(p, specs, sizes, h, n, present), (impl_name, hit)
        # each group alone: hit never exceeds what that group can serve on its own
        for g in range(len(specs)):
            if p.hashes_per_block[g]:
                alone = [s if i == g else None for i, s in enumerate(specs)]
                X = hit
                assert ref_servable_one(p, alone, sizes, h, X, present), (impl_name, g, hit)


@SETTINGS
@given(sc=scenario(), data=st.data())
def test_tail_puts_make_the_boundary_servable(sc, data):
    cfg, S, H = sc["cfg"], sc["S"], sc["H"]
    core = sc["core"]
    a = core.alignment
    specs = make_groups(CORE, cfg["params"])
    dcp = cfg["dcp"]
    sizes = [s.block_size * (1 if s.kind == "mamba" else dcp) for s in specs]
    h = sc["hashes"]
    assume(len(h) * H >= a)
    boundary = data.draw(st.integers(1, len(h) * H // a)) * a
    o = sc["offset"]
    assume(o < boundary)
    # every block a lookup might need has a source; every participating mamba group a hand-off
    tables = [[10 * (g + 1) + b + 1 for b in range(boundary // sizes[g] + 2)] for g in range(len(specs))]
    hand = [(g, 500 + g, boundary) for g, s in enumerate(specs) if s.kind == "mamba"]
    for impl in (CORE, TWIN):
        present = set()
        for rank in range(cfg["tp_size"]):
            p = build(impl, cfg, S, H, tp_rank=rank)
            tail = p.plan_tail(h, tables, hand, saved_offset=o)
            if hand:
                # "none" only when no block is needed at all (e.g. a 1-token sliding window)
                assert tail.outcome in ("planned", "all_present", "none"), (tail.outcome, hand)
            present |= {put[0] for put in tail.puts}
            present |= {put[0] for put in p.plan_save(h, tables, o, saved_offset=0).puts}
        p = build(impl, cfg, S, H)
        if not any(s.kind == "mamba" and p.hashes_per_block[g] for g, s in enumerate(specs)) and not hand:
            # no hand-offs at all: nothing is written by a tail (outcome none); skip
            continue
        assert p.longest_hit(h, boundary + 1, present) == boundary, (impl.__name__, boundary, o)


@SETTINGS
@given(sc=scenario())
def test_save_then_lookup_serves_the_save_end(sc):
    """Without mamba groups, the normal-save puts of every rank make the save end servable."""
    cfg, S, H = sc["cfg"], sc["S"], sc["H"]
    specs = make_groups(CORE, cfg["params"])
    assume(not any(s.kind == "mamba" for s in specs))
    dcp = cfg["dcp"]
    sizes = [s.block_size * (1 if s.kind == "mamba" else dcp) for s in specs]
    h = sc["hashes"]
    n = len(h) * H
    tables = [[7 + b for b in range(n // sizes[g] + 1)] for g in range(len(specs))]
    for impl in (CORE, TWIN):
        present = set()
        end = None
        for rank in range(cfg["tp_size"]):
            p = build(impl, cfg, S, H, tp_rank=rank)
            plan = p.plan_save(h, tables, n, saved_offset=0)
            end = plan.end
            present |= {put[0] for put in plan.puts}
        p = build(impl, cfg, S, H)
        assert end == n // S * S
        if end:
            assert p.longest_hit(h, end + 1, present) == end, impl.__name__


@SETTINGS
@given(sc=scenario(), data=st.data())
def test_admitted_save_serves_every_admitted_boundary(sc, data):
    """Without mamba groups, a prompt saved step by step under §8 admission serves a hit at
    each admitted boundary (its window tails are all stored), and stores no window block that
    none of them needs."""
    cfg, S, H = sc["cfg"], sc["S"], sc["H"]
    specs = make_groups(CORE, cfg["params"])
    assume(not any(s.kind == "mamba" for s in specs))
    assume(cfg["tp_size"] == 1)
    dcp = cfg["dcp"]
    sizes = [s.block_size * dcp for s in specs]
    h = sc["hashes"]
    n = len(h) * H
    tables = [[7 + b for b in range(n // sizes[g] + 1)] for g in range(len(specs))]
    step = S * data.draw(st.integers(1, 3))
    interval = data.draw(st.integers(0, 2)) * S
    for impl in (CORE, TWIN):
        p = build(impl, cfg, S, H)
        seen = data.draw(st.lists(st.booleans(), min_size=n // p.alignment, max_size=n // p.alignment))
        admitted = p.hit_boundaries(n, retention_interval=interval, seen=seen)
        present, offset = set(), 0
        for computed in list(range(step, n, step)) + [n]:
            plan = p.plan_save(h, tables, computed, saved_offset=offset, boundaries=admitted)
            present |= {put[0] for put in plan.puts}
            offset = plan.end
        for x in admitted:
            # A normal save ends on scheduler blocks (a boundary inside one is a partial
            # tail's, §5); the last token is computed (§6): a lookup of x + 1 tokens.
            if x < n and x % S == 0:
                assert p.longest_hit(h, x + 1, present) >= x, (impl.__name__, x, admitted)
        dense = p.plan_save(h, tables, n).puts
        assert present <= {put[0] for put in dense}
        for g, spec in enumerate(specs):
            if spec.kind in ("sliding_window", "chunked_local"):
                B = sizes[g]
                needed = {b for x in admitted for b in _needed(spec.kind, spec.window, B, x)}
                wanted = {p.key(g, h[(b + 1) * B // H - 1]) for b in needed if (b + 1) * B <= n}
                group_keys = {put[0] for put in dense if put[1] == g}
                assert present & group_keys == wanted & group_keys, (impl.__name__, g, admitted)


@pytest.mark.parametrize("name", ["core", "twin"])
def test_no_duplicates_with_repeated_hashes(name):
    impl = IMPLS[name]
    groups = [impl.GroupSpec("full_attention", 4), impl.GroupSpec("mamba", 16), impl.GroupSpec("sliding_window", 4, window=9)]
    p = impl.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=16, namespace="ns")
    h = [b"x" * 32] * 12
    tables = [list(range(1, 13)), [5, 6, 7], list(range(21, 33))]
    for plan in (p.plan_save(h, tables, 48), p.plan_tail(h, tables, [(1, 9, 44)])):
        keys = [put[0] for put in plan.puts]
        assert len(keys) == len(set(keys))
    lk = p.lookup_keys(h, 48)
    assert len(lk) == len(set(lk)) == 3
