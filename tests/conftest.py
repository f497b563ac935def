"""Shared fixtures and helpers for the core test suite.

``impl`` runs an example test once against the Rust core (``kvstride``) and once against its
pure-Python twin (``kvstride._educational``, the oracle): both must satisfy SEMANTICS.md.
"""

import hashlib

import cbor2
import pytest
import xxhash

import kvstride
from kvstride import _educational

IMPLS = {"core": kvstride, "twin": _educational}


@pytest.fixture(params=list(IMPLS), ids=list(IMPLS))
def impl(request):
    return IMPLS[request.param]


# ---- reference hashing (SEMANTICS §1), computed here, not by the code under test ----------


def ref_digest(algo, data):
    if algo == "sha256_cbor":
        return hashlib.sha256(data).digest()
    if algo == "xxhash_cbor":
        return xxhash.xxh3_128_digest(data)
    raise AssertionError(algo)


def ref_hash_blocks(algo, none_hash, tokens, block_size, parent=None, extra_keys=None):
    """h[i] = HASH(cbor2.dumps([parent, tokens_i, extra_i], canonical=True))."""
    prev = none_hash if parent is None else parent
    out = []
    for i in range(len(tokens) // block_size):
        extra = None if extra_keys is None else extra_keys[i]
        blk = [int(t) for t in tokens[i * block_size : (i + 1) * block_size]]
        prev = ref_digest(algo, cbor2.dumps([prev, blk, extra], canonical=True))
        out.append(prev)
    return out


# ---- small helpers -------------------------------------------------------------------------


def fake_hashes(n, salt=b"", size=32):
    """n distinct pseudo block hashes (a real chain is not needed by the planner)."""
    return [hashlib.sha256(salt + b"h%d" % i).digest()[:size] for i in range(n)]


def tail_tuple(plan):
    return (plan.outcome, plan.boundary, [tuple(p) for p in plan.puts])


def save_tuple(plan):
    return (plan.end, [tuple(p) for p in plan.puts])


def load_tuple(plan):
    return (plan.hit, plan.start, [tuple(g) for g in plan.gets], [tuple(m) for m in plan.missing])


def FA(impl, b, **kw):
    return impl.GroupSpec("full_attention", b, **kw)


def MLA(impl, b, **kw):
    return impl.GroupSpec("mla", b, **kw)


def MAMBA(impl, b, mode="align", **kw):
    return impl.GroupSpec("mamba", b, mamba_mode=mode, **kw)


def SWA(impl, b, window, **kw):
    return impl.GroupSpec("sliding_window", b, window=window, **kw)


def CHUNKED(impl, b, window, **kw):
    return impl.GroupSpec("chunked_local", b, window=window, **kw)


def RING(impl, b, **kw):
    return impl.GroupSpec("circular_buffer", b, **kw)
