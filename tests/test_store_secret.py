"""Issue 17 on a real Mooncake master: a client without the deployment secret cannot make an
engine load a value it wrote, cannot compute the engine's keys, and (the negative control) the
same attack on an engine without a secret IS loaded, so the attack is real.

The attacker is a plain MooncakeStore client of the same master, without the secret. It learns
the victim's keys the strongest way (it is handed them: Mooncake's master lists every key on its
metrics port), removes each value and writes a wrong but finite payload of the same size under
it, with every unkeyed header field recomputed (magic, version, the layout fingerprint printed in
every key, the key digest, the length and the payload's XXH3-64)."""

from __future__ import annotations

import json
import urllib.request
import uuid

import numpy as np
import pytest
import torch

from kvstride import _core
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores import FORMAT_VERSION, FORMAT_VERSION_MAC, HEADER_BYTES, MooncakeStore, Status
from kvstride.transfer import StagingPool, Transfer
from mooncake_fixture import mooncake_master  # noqa: F401

BLOCK = 16
BLOCKS = 6
FP = b"secretfp"
SECRET = bytes(range(7, 39))
SENTINEL = 0xEE


class Engine:
    """One full-attention fp16 group, a registered pool, an engine on its own store client."""

    def __init__(self, master, secret, namespace) -> None:
        self.store = MooncakeStore(master, segment_bytes=32 << 20, fingerprint=FP, secret=secret)
        self.kv = torch.zeros(64, 2, BLOCK, 4, 32, dtype=torch.float16)
        self.layout = KVLayout({"attn": self.kv}, [["attn"]])
        self.planner = _core.KeyPlanner([_core.GroupSpec("full_attention", BLOCK)], hash_block_size=BLOCK,
                                        scheduler_block_size=BLOCK, namespace=namespace, secret=secret)
        self.pool = StagingPool(1 << 20)
        self.pool.register(self.store.register_buffer)
        self.engine = OffloadEngine(self.planner, Transfer(self.layout, self.pool), self.store)

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()


def _tokens(seed):
    return torch.randint(1, 50_000, (BLOCKS * BLOCK,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(master, secret, attack: bool):
    """Save a prompt's blocks, optionally let the attacker rewrite every stored value, then look
    the prompt up and load it into fresh blocks. Returns what the test checks."""
    ns = f"victim-{uuid.uuid4().hex[:8]}"
    victim = Engine(master, secret, ns)
    attacker = MooncakeStore(master, segment_bytes=0, fingerprint=FP)  # no secret
    try:
        hashes = _core.BlockHasher("sha256_cbor", seed="0").hash_blocks(_tokens(1), BLOCK)
        src, dst = list(range(1, 1 + BLOCKS)), list(range(20, 20 + BLOCKS))
        victim.kv[1 : 1 + BLOCKS].normal_(generator=torch.Generator().manual_seed(3))
        victim.engine.submit(saves=[SaveRequest("p1", hashes, [src], num_tokens=BLOCKS * BLOCK)])
        assert victim.engine.wait_idle(30)
        keys = [victim.planner.key(0, h) for h in hashes]
        assert victim.store.exists(keys) == [True] * BLOCKS
        header = victim.store.client.get(keys[0])[:HEADER_BYTES]
        assert int.from_bytes(header[4:6], "little") == (FORMAT_VERSION_MAC if secret else FORMAT_VERSION)
        forged = torch.full((2, BLOCK, 4, 32), 0.5, dtype=torch.float16)  # wrong but finite KV
        if attack:
            for key in keys:
                assert attacker.client.remove(key, True) == 0
            assert attacker.put(keys, [[forged.view(torch.uint8).numpy()]] * BLOCKS) == [Status.OK] * BLOCKS
        # The unkeyed planner an attacker would build from the tokens: none of its keys exist.
        unkeyed = _core.KeyPlanner([_core.GroupSpec("full_attention", BLOCK)], hash_block_size=BLOCK,
                                   scheduler_block_size=BLOCK, namespace=ns)
        guessed = attacker.exists([unkeyed.key(0, h) for h in hashes])
        n = BLOCKS * BLOCK
        hit = victim.engine.lookup([("p2", hashes, n + 1)])["p2"]
        victim.kv[dst[0] : dst[-1] + 1].view(torch.uint8).fill_(SENTINEL)
        victim.engine.submit(loads=[LoadRequest("p2", hashes, [dst], hit)])
        assert victim.engine.wait_idle(30)
        done = victim.engine.get_finished()
        loaded = [bool(torch.equal(victim.kv[d], victim.kv[s])) for s, d in zip(src, dst)]
        forged_in = [bool(torch.equal(victim.kv[d], forged)) for d in dst]
        untouched = [bool((victim.kv[d].view(torch.uint8) == SENTINEL).all()) for d in dst]
        return dict(hit=hit, done=done, loaded=loaded, forged_in=forged_in, untouched=untouched,
                    counters=dict(victim.store.counters), guessed=guessed, after=victim.store.exists(keys))
    finally:
        attacker.close()
        victim.close()


def test_forged_values_are_never_loaded_with_a_secret(mooncake_master):
    r = _run(mooncake_master, SECRET, attack=True)
    assert r["hit"] == BLOCKS * BLOCK  # the attacker's values exist under the keys
    assert r["done"].loads_failed == {"p2": {(0, d) for d in range(20, 20 + BLOCKS)}}  # vLLM recomputes them
    assert not any(r["forged_in"]) and all(r["untouched"])  # no forged byte reached a KV block
    assert r["counters"]["mac_rejected"] == BLOCKS  # each rejection counted
    assert r["after"] == [False] * BLOCKS  # and removed, so the next save rewrites them
    assert r["guessed"] == [False] * BLOCKS  # keys computed from the tokens without the secret


def test_control_the_same_attack_without_a_secret_is_loaded(mooncake_master):
    r = _run(mooncake_master, None, attack=True)
    assert r["hit"] == BLOCKS * BLOCK
    assert r["done"].loads_done == {"p2"} and not r["done"].loads_failed
    assert all(r["forged_in"]) and not any(r["loaded"])  # the forged KV is in the engine's blocks
    assert r["guessed"] == [True] * BLOCKS  # without a secret keys are a function of the tokens
    assert "mac_rejected" not in r["counters"]


def test_no_attack_with_a_secret_loads_byte_for_byte(mooncake_master):
    r = _run(mooncake_master, SECRET, attack=False)
    assert r["done"].loads_done == {"p2"} and not r["done"].loads_failed and all(r["loaded"])
    assert "mac_rejected" not in r["counters"]


def test_store_level_get_rejects_forged_and_tampered_values(mooncake_master):
    """The path without fused digests (CUDA KV caches, direct callers): the store checks the MAC
    itself, for a value written without the secret and for a genuine header over other bytes."""
    victim = MooncakeStore(mooncake_master, segment_bytes=16 << 20, fingerprint=FP, secret=SECRET)
    attacker = MooncakeStore(mooncake_master, segment_bytes=0, fingerprint=FP)
    try:
        vals = [np.full(4096, i, np.uint8) for i in range(3)]
        keys = [f"mac-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
        assert victim.put(keys, [[v] for v in vals]) == [Status.OK] * 3
        out = [np.zeros(4096, np.uint8) for _ in range(3)]
        assert victim.get(keys, [[o] for o in out]) == [Status.OK] * 3
        assert all(np.array_equal(a, b) for a, b in zip(vals, out))
        # 0: rewritten without the secret; 1: a genuine header moved onto other bytes.
        attacker.client.remove(keys[0], True)
        assert attacker.put([keys[0]], [[np.full(4096, 9, np.uint8)]]) == [Status.OK]
        raw = bytearray(victim.client.get(keys[1]))
        raw[HEADER_BYTES + 7] ^= 1
        assert victim.client.upsert(keys[1], bytes(raw)) == 0
        # A value copied under another key keeps a MAC over its own key: rejected too.
        assert victim.client.upsert(keys[2], victim.client.get(keys[1].replace("-1", "-0")) or bytes(raw)) == 0
        out = [np.zeros(4096, np.uint8) for _ in range(3)]
        assert victim.get(keys, [[o] for o in out]) == [Status.CORRUPT] * 3
        assert victim.counters["mac_rejected"] == 3
        assert victim.exists(keys) == [False] * 3
        # A store without the secret refuses to read MAC'd values rather than trusting them blindly.
        k = f"mac-{uuid.uuid4().hex[:8]}"
        assert victim.put([k], [[vals[0]]]) == [Status.OK]
        assert attacker.get([k], [[np.zeros(4096, np.uint8)]]) == [Status.CORRUPT]
    finally:
        attacker.close()
        victim.close()


def test_a_version_2_value_is_a_miss_and_removed(mooncake_master):
    """Version 2 (a keyed BLAKE3 payload tag) is no longer read: such a value, even one whose
    header MAC was genuine then, is CORRUPT and removed, so the next save rewrites it as version 3."""
    store = MooncakeStore(mooncake_master, segment_bytes=16 << 20, fingerprint=FP, secret=SECRET)
    try:
        val = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
        key = f"v2-{uuid.uuid4().hex[:8]}"
        assert store.put([key], [[val]]) == [Status.OK]
        raw = bytearray(store.client.get(key))
        assert int.from_bytes(raw[4:6], "little") == FORMAT_VERSION_MAC == 3
        raw[4:6] = (2).to_bytes(2, "little")
        assert store.client.upsert(key, bytes(raw)) == 0
        out = np.zeros(4096, np.uint8)
        assert store.get([key], [[out]]) == [Status.CORRUPT]
        assert store.exists([key]) == [False]
        assert store.put([key], [[val]]) == [Status.OK]
        assert store.get([key], [[out]]) == [Status.OK] and np.array_equal(out, val)
    finally:
        store.close()
