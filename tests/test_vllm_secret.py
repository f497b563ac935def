"""Issue 17 in a real vLLM 0.32 CPU engine on a real Mooncake master: an attacker client without
the deployment secret rewrites every stored value (a wrong but finite payload, every unkeyed
header field recomputed) after each forced miss. With ``secret_file`` the engine rejects every
forged value (counted, removed) and recomputes: P2 and the exact repeat are bit-identical to a
run without a connector. The negative control, the same attack on an engine without a secret,
changes the output: the attack is real. And nothing such an engine prints, counts or sends
between its processes holds the secret."""

from __future__ import annotations

import logging
import os
import pickle
import urllib.request

import numpy as np
import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import LLM  # noqa: E402

import kvstride.vllm as kv_vllm  # noqa: E402
import kvstride.vllm.connector as kv_connector  # noqa: E402
from kvstride.vllm import checks as kv_checks  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstride.secret import generate_secret_file, load_secret  # noqa: E402
from kvstride.stores import HEADER_BYTES, MooncakeStore, Status  # noqa: E402
from vllm_fixtures import model_dirs, plain_outputs  # noqa: E402,F401  (fixtures)
from mooncake_fixture import mooncake_master  # noqa: E402,F401  (fixtures)


class Attacker:
    """A plain client of the master, without the secret. It lists the store's keys the way any
    client can (the master's metrics port serves /get_all_keys) and rewrites each value."""

    def __init__(self, master) -> None:
        self.master = master
        self.store = MooncakeStore(master, segment_bytes=0)
        self.rewritten = 0

    def keys(self, prefix: str) -> list:
        url = f"http://{self.master.host}:{self.master.metrics_port}/get_all_keys"
        return [k for k in urllib.request.urlopen(url, timeout=10).read().decode().split() if k.startswith(prefix)]

    def rewrite_all(self, prefix: str) -> None:
        raw = self.store.client
        for key in self.keys(prefix):
            value = raw.get(key)
            if len(value) <= HEADER_BYTES:
                continue
            # Every unkeyed field recomputed: the fingerprint (printed in every key) from the old
            # header, then put() writes magic, version, key digest, length and XXH3-64.
            self.store.fingerprint = bytes(value[8:16])
            forged = np.full(len(value) - HEADER_BYTES, 0x3C, np.uint8)  # finite in fp32, bf16, fp16
            assert raw.remove(key, True) == 0
            assert self.store.put([key], [[forged]]) == [Status.OK]
            self.rewritten += 1

    def close(self) -> None:
        self.store.close()


def _phases_with_attack(llm, attacker, prefix):
    idle = harness.free_blocks(llm)
    p1, p2 = harness.prompts()
    out = {}
    for seed, (phase, prompt) in enumerate((("p1", p1), ("p2", p2), ("repeat", p1))):
        if seed:
            harness.drain_and_forget(llm, seed)
            attacker.rewrite_all(prefix)
        out[phase] = harness.generate(llm, prompt)
    harness.assert_idle(llm, idle)
    return out


def _worker(llm):
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return get_kv_transfer_group().side


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_next"])
@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "control-no-secret"])
def test_forged_values(model_dirs, plain_outputs, mooncake_master, tmp_path, name, with_secret):
    prefix = f"atk{os.getpid()}{name}{int(with_secret)}"
    store = {"store": "mooncake", "mooncake_master": mooncake_master.address, "mooncake_local_hostname": "127.0.0.1",
             "store_name": prefix, "cache_prefix": prefix}
    if with_secret:
        key = tmp_path / "deploy.key"
        generate_secret_file(key)
        store["secret_file"] = str(key)
    attacker = Attacker(mooncake_master)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=store))
    try:
        worker = _worker(llm)
        got = _phases_with_attack(llm, attacker, prefix)
        counters = dict(worker.counters)
        rejected = worker.store.counters.get("mac_rejected", 0)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
        attacker.close()
    assert attacker.rewritten > 0
    if with_secret:
        assert rejected > 0 and counters.get("loads_failed", 0) >= 1, (rejected, counters)
        assert counters.get("mac_rejected") == rejected, counters  # in vLLM's stats as a failure
        assert harness.mismatches(got, plain_outputs(name)) == []
    else:
        assert counters.get("get_ok", 0) > 0 and not counters.get("loads_failed"), counters
        assert harness.mismatches(got, plain_outputs(name)) != [], "the forged KV changed nothing: no real attack"


class _AllRecords(logging.Handler):
    """Every record of every logger, formatted with its exception text, once (a record reaches
    the handler on each logger it propagates through)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.texts = []
        self._seen = {}  # id -> record, kept alive so that no id is reused

    def emit(self, record):
        if id(record) not in self._seen:
            self._seen[id(record)] = record
            self.texts.append(self.format(record))


def test_the_secret_never_leaves_its_file(model_dirs, mooncake_master, tmp_path, monkeypatch):
    """An engine run with a secret, forged values included (so that rejections are logged and
    counted): no log record at any level, repr, exception text, metric or connector metadata
    passed between vLLM's processes holds the secret, raw, hex or base64."""
    prefix = f"leak{os.getpid()}"
    key = tmp_path / "deploy.key"
    generate_secret_file(key)
    secret = load_secret(key)
    store = {"store": "mooncake", "mooncake_master": mooncake_master.address, "mooncake_local_hostname": "127.0.0.1",
             "store_name": prefix, "cache_prefix": prefix, "secret_file": str(key)}
    records = _AllRecords()
    loggers = [logging.getLogger(), logging.getLogger("vllm"), logging.getLogger("kvstride")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(records)
        lg.setLevel(logging.DEBUG)
    sent = []  # what vLLM pickles between the scheduler and the workers, both ways
    for method in ("build_connector_meta", "build_connector_worker_meta"):
        real = getattr(kv_vllm.KVStrideConnector, method)
        monkeypatch.setattr(kv_vllm.KVStrideConnector, method,
                            lambda self, *a, _real=real, **k: sent.append(_real(self, *a, **k)) or sent[-1])
    monkeypatch.setattr(kv_checks, "_warned_keys", set())  # logged once per process: this test's engine's
    configs = []  # each side's resolved configuration (kvstride.vllm.config.ConnectorConfig)
    real_resolve = kv_connector.resolve_config
    monkeypatch.setattr(kv_connector, "resolve_config", lambda *a, **k: configs.append(real_resolve(*a, **k)) or configs[-1])
    attacker = Attacker(mooncake_master)
    texts = []
    try:
        llm = LLM(**harness.engine_kwargs(harness.MODELS["llama"], model_dirs["llama"], connector=store),
                  disable_log_stats=False)  # the metrics too
        try:
            _phases_with_attack(llm, attacker, prefix)
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
            worker = _worker(llm)
            objects = [scheduler, scheduler.side, worker, worker.store, worker.engine, worker.planner,
                       scheduler.get_kv_connector_stats(), worker.get_kv_connector_stats()]
            objects += configs
            texts += [repr(o) for o in objects] + [str(o) for o in objects]
            texts += [repr(getattr(o, "__dict__", {})) for o in objects[:3]]
            texts += [repr(dict(worker.counters)), repr(dict(worker.store.counters))]
            texts += [f"{m.name} {getattr(m, 'value', '')} {getattr(m, 'labels', '')}" for m in llm.get_metrics()]
        finally:
            harness.close(llm)
            kv_vllm.drop_shared_stores()
            attacker.close()
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(records)
            lg.setLevel(level)
    with pytest.raises(ValueError) as refused:  # a key file others can read: the error names the path only
        key.chmod(0o644)
        LLM(**harness.engine_kwargs(harness.MODELS["llama"], model_dirs["llama"], connector=store))
    texts.append(str(refused.value))
    assert attacker.rewritten > 0 and any("MAC" in t for t in records.texts), "no rejection was logged"
    assert sum("reaches the Mooncake data port" in t for t in records.texts) == 1  # the trust model, once
    assert sent and len(configs) == 2 and len(records.texts) > 20  # vLLM's and kvstride's records, DEBUG included
    blob = "\n".join(texts + records.texts).encode() + b"".join(pickle.dumps(m) for m in sent if m is not None)
    for form in harness.secret_forms(secret):
        assert form not in blob
