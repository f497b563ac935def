"""The connector the way vLLM runs it: the scheduler in an EngineCore process, the model runner
in a Worker process (``distributed_executor_backend="mp"``), so that the connector's two roles
share only what its store shares; and two engines, one after the other, sharing a Mooncake store.

- ``test_server_*``: ``python -m vllm.entrypoints.openai.api_server`` with the connector.
  Token-id prompts go through ``POST /v1/completions``, hits come from ``GET /metrics``, and
  the forced miss of ``tests/vllm_harness.py`` is made from outside through the dev endpoints
  (``VLLM_SERVER_DEV_MODE=1``): ``POST /reset_prefix_cache`` until it succeeds, then
  ``POST /collective_rpc`` into the worker extension ``vllm_harness.KVRandomizer``, which
  overwrites every KV tensor with random values.
- ``test_llm_mp_*``: ``LLM(..., distributed_executor_backend="mp")`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in a subprocess, running ``harness.scenario``.
- ``test_mooncake_shared_across_engines``: engine A computes P1 and exits; engine B, a new
  process, loads it from a ``kvstride store serve`` store.

Every run is compared (tokens, logprobs within 1e-6) with one plain run per model (no
connector, scheduler and worker in one process): vLLM's output under the harness settings does
not depend on the process layout (a plain server, a plain ``mp`` engine and a plain in-process
engine agree), so one reference per model serves every tier and keeps the file fast. Each case
starts vLLM's processes anew (30-50 s on two cores), so by default each tier runs once or a few
times, covering both models and both stores between them; ``KVSTRIDE_SERVE_ALL=1`` runs the
whole matrix.

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

import pytest

pytest.importorskip("vllm")

import vllm_harness as harness  # noqa: E402
from kvstride.stores.mooncake_master import _free_port  # noqa: E402

TESTS = Path(__file__).resolve().parent
MODELS = ["llama", "gemma3"]  # one KV-cache group; four (3 sliding-window + 1 full)
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"  # tokens; the /metrics series ends in _total

# Each case starts three vLLM processes (30-50 s on two cores). By default every tier runs,
# with both models and both stores between them; KVSTRIDE_SERVE_ALL=1 runs every combination.
ALL = os.environ.get("KVSTRIDE_SERVE_ALL") == "1"
_MORE = pytest.mark.skipif(not ALL, reason="one of every combination: KVSTRIDE_SERVE_ALL=1")


def _cases(default, more):
    return [*default, *(pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=_MORE) for c in more)]


SERVER_CASES = _cases([("llama", "embedded"), ("gemma3", "mooncake")], [("gemma3", "embedded"), ("llama", "mooncake")])
MP_CASES = _cases([("gemma3", "embedded")], [("gemma3", "mooncake"), ("llama", "embedded"), ("llama", "mooncake")])
SHARED_CASES = _cases(["gemma3"], ["llama"])


# ---- processes ---------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM to ``proc`` (vLLM shuts its EngineCore and Worker down), then SIGKILL to its
    process group (``start_new_session``: only processes this file started) if it hangs, or
    to stragglers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(10)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def base_env(workdir, pytestconfig) -> Dict[str, str]:
    """The environment of every process started here: equal block-hash seeds (vLLM seeds its
    hashes from PYTHONHASHSEED), vLLM's sockets and temp files under ``workdir``, the tests
    folder importable (the worker extension, ``vllm_harness``). vLLM's cache (its model-class
    inspection, ~10 s per architecture, keyed by vLLM's own source) is the caller's
    VLLM_CACHE_ROOT, else pytest's cache folder, else ``workdir``."""
    env = dict(os.environ)
    for name in ("VLLM_RPC_BASE_PATH", "TMPDIR"):
        (workdir / name.lower()).mkdir()
        env[name] = str(workdir / name.lower())
    if not env.get("VLLM_CACHE_ROOT"):
        cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
        env["VLLM_CACHE_ROOT"] = str(cache.mkdir("vllm-cache") if cache else workdir / "vllm-cache")
    env.pop("MOONCAKE_CONFIG_PATH", None)
    env.update(
        PYTHONHASHSEED="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_SERVER_DEV_MODE="1",
        MC_LOG_LEVEL="ERROR",
        PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p),
    )
    return env


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: harness.MODELS[name].build(root / name) for name in MODELS}


@pytest.fixture(scope="module")
def store_serve(workdir, base_env):
    """``kvstride store serve``: a Mooncake master plus the segment the engines' objects live
    in (the engines are pure clients); yields the engines' config file (MOONCAKE_CONFIG_PATH)."""
    config, log_path = workdir / "mooncake.json", workdir / "store-serve.log"
    argv = [sys.executable, "-m", "kvstride.cli", "store", "serve", "--bytes", "256M", "--config-out", str(config)]
    argv += ["--log-dir", str(workdir)]  # the master's warnings, next to the engines' logs
    argv += ["--lease-ttl", str(MOONCAKE_READ_BOUND_S)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=base_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not config.exists():
            assert proc.poll() is None, f"store serve exited with {proc.returncode}: {_tail(log_path)}"
            assert time.monotonic() < deadline, f"store serve wrote no {config}: {_tail(log_path)}"
            time.sleep(0.05)
        assert json.loads(config.read_text())["global_segment_size"] == 0
        assert list(workdir.glob("master-*.log")), "store serve --log-dir kept no master log"
        yield config
    finally:
        _stop(proc)


#: Mooncake's read lease (store serve's ``--lease-ttl``) and the engines' ``load_timeout_s`` in
#: these tests, which check the bytes a load brings, not its deadline (``test_engine``'s store
#: that never answers, ``test_store_serve``'s stalled holder and ``test_vllm_disk``'s disk that
#: does not answer check those). Both default to 10 s, and this 2-core machine has stalled a TP=2
#: engine's first reads from the holder for 10 s: the loads were recomputed and counted failed.
MOONCAKE_READ_BOUND_S = 60


def _store(kind: str, tag: str) -> dict:
    """``kv_connector_extra_config`` for a store kind. Mooncake is configured the way vLLM's
    MooncakeStoreConnector is, by the file in ``MOONCAKE_CONFIG_PATH`` (:func:`_env`): store
    serve's, whose segment 0 makes the engines pure clients, so what they store lives in store
    serve's segment and outlives them. ``tag`` keeps the tests' keys apart in that store."""
    if kind == "embedded":
        return {"store": "embedded", "store_bytes": 64 << 20}
    return {"store": "mooncake", "cache_prefix": tag, "load_timeout_s": MOONCAKE_READ_BOUND_S}


def _env(base_env, kind: str, store_serve, **extra) -> Dict[str, str]:
    env = dict(base_env, **extra)
    if kind == "mooncake":
        env["MOONCAKE_CONFIG_PATH"] = str(store_serve)
    return env


def _transfer_config(extra: dict) -> dict:
    """``--kv-transfer-config`` (what ``harness.connector_config`` builds for ``LLM``)."""
    return {
        "kv_connector": "KVStrideConnector", "kv_connector_module_path": "kvstride.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }


def _assert_hits(hits: Dict[str, float], name: str, detail) -> None:
    """No hit before anything was stored; afterwards at least vLLM's MooncakeStoreConnector's."""
    want = harness.PEER_HITS[name]
    assert hits.get("p1", 0) == 0, (hits, detail)
    for phase in ("p2", "repeat"):
        if phase in hits:
            assert hits[phase] >= want, f"{phase}: {hits[phase]:.0f} external hit tokens < {want}: {hits}, {detail}"


def _outputs(raw: dict) -> Dict[str, harness.Output]:
    return {phase: harness.Output(o["tokens"], o["logprobs"]) for phase, o in raw.items()}


def _mismatches(got: Dict[str, harness.Output], want: Dict[str, harness.Output]) -> List[str]:
    """``harness.mismatches`` over the phases that ran."""
    return harness.mismatches(got, {phase: want[phase] for phase in got})


# ---- engines in a subprocess (LLM) ----------------------------------------------------------------

ENGINE_SCRIPT = textwrap.dedent(
    '''
    """Runs the engine jobs of argv[1] (JSON) one after the other; writes their results to argv[2]."""
    import json
    import sys

    import cloudpickle

    import kvstride.vllm as kv_vllm
    import vllm_harness as harness

    # collective_rpc(harness.randomize_kv) in "mp": the function is pickled by value, so it does
    # not depend on the EngineCore and Worker processes finding vllm_harness by name.
    cloudpickle.register_pickle_by_value(harness)


    def metric_sums(llm):
        """Each metric summed over its labels; kvstride's failures also by outcome."""
        sums = {}
        for m in llm.get_metrics():
            if hasattr(m, "value"):
                sums[m.name] = sums.get(m.name, 0) + m.value
                if "outcome" in m.labels:
                    name = f"{m.name}{{outcome={m.labels['outcome']}}}"
                    sums[name] = sums.get(name, 0) + m.value
        return sums


    def run(job):
        from vllm import LLM

        model = harness.MODELS[job["model"]]
        kwargs = harness.engine_kwargs(
            model, job["path"], connector=job["connector"], backend=job["backend"], **job.get("overrides", {})
        )
        kwargs["tensor_parallel_size"] = job.get("tp", 1)
        llm = LLM(**kwargs, disable_log_stats=False)  # stats on: LLM.get_metrics()
        idle = harness.free_blocks(llm)  # None unless the scheduler runs in this process
        try:
            hits, last = {}, [0]

            def after(phase):
                now = metric_sums(llm).get("vllm:external_prefix_cache_hits", 0)
                hits[phase], last[0] = now - last[0], now

            if job["phases"] == "scenario":
                out = harness.scenario(llm, after=after)
            else:  # each phase after a forced miss (a new engine: only its store can hit)
                p1, p2 = harness.prompts()
                out = {}
                lora = None
                if job.get("lora"):  # [name, id, path]: every phase's request runs that adapter
                    from vllm.lora.request import LoRARequest

                    lora = LoRARequest(*job["lora"])
                for seed, phase in enumerate(job["phases"], 1):
                    harness.drain_and_forget(llm, seed)
                    out[phase] = harness.generate(llm, {"p1": p1, "p2": p2, "repeat": p1}[phase], lora_request=lora)
                    after(phase)
                harness.assert_idle(llm, idle)  # every block back, reset_prefix_cache() succeeds
            kvstride = {k: v for k, v in metric_sums(llm).items() if k.startswith("vllm:kvstride_")}
        finally:
            harness.close(llm)
            kv_vllm.drop_shared_stores()
        outputs = {p: {"tokens": o.tokens, "logprobs": o.logprobs} for p, o in out.items()}
        return {"outputs": outputs, "hits": hits, "kvstride": kvstride}


    if __name__ == "__main__":  # spawned EngineCore / Worker processes re-import this file
        results = [run(job) for job in json.loads(sys.argv[1])]
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    '''
)


def _run_engines(workdir: Path, env: Dict[str, str], jobs: List[dict], label: str, timeout: float = 300) -> List[dict]:
    """Run ``jobs`` (ENGINE_SCRIPT) in a new process; their results."""
    script = workdir / "engines.py"
    if not script.exists():
        script.write_text(ENGINE_SCRIPT)
    out, log_path = workdir / f"{label}.json", workdir / f"{label}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(jobs), str(out)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _stop(proc)
    assert proc.returncode == 0 and out.exists(), f"{label}: exit {proc.returncode}: {_tail(log_path)}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(workdir, base_env, model_dirs) -> Dict[str, Dict[str, harness.Output]]:
    """Each model's P1 and P2 without a connector, in-process (one subprocess for all models).
    Without a connector the repeat of P1 after a forced miss is P1 computed again: P1's output."""
    env = dict(base_env, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    jobs = [dict(model=n, path=model_dirs[n], backend="uni", connector=None, phases=["p1", "p2"]) for n in MODELS]
    results = _run_engines(workdir, env, jobs, "reference")
    out = {n: _outputs(r["outputs"]) for n, r in zip(MODELS, results)}
    for o in out.values():
        o["repeat"] = o["p1"]
    return out


# ---- the OpenAI server ------------------------------------------------------------------------------


def _cli(kwargs: dict) -> List[str]:
    """``LLM(**kwargs)`` as ``vllm serve`` flags (None is spelt "None")."""
    argv = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        else:
            argv += [flag, "None" if value is None else str(value)]
    return argv


class Server:
    """A running ``vllm.entrypoints.openai.api_server`` on a loopback port."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc, self.url, self.log_path = proc, f"http://127.0.0.1:{port}", log_path

    def _call(self, path: str, body: Optional[dict] = None, timeout: float = 120):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
        return raw if path == "/metrics" else json.loads(raw or "null")

    def wait_healthy(self, timeout: float = 300) -> None:
        harness.wait_healthy(self.proc, self.url, timeout, lambda: _tail(self.log_path))

    def complete(self, prompt: List[int]) -> harness.Output:
        """A token-id prompt, greedy (``harness.generate``'s sampling); token ids and the
        sampled tokens' logprobs."""
        r = self._call("/v1/completions", {
            "prompt": list(prompt), "max_tokens": harness.MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # logprobs without a tokenizer (--skip-tokenizer-init)
        })
        choice = r["choices"][0]
        return harness.Output(list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]])

    def drain(self, timeout: float = 60) -> None:
        """``POST /reset_prefix_cache`` until it succeeds (no request holds a block). The answer
        comes after the outputs of earlier steps, so /metrics then counts them."""
        deadline = time.monotonic() + timeout
        while not self._call("/reset_prefix_cache", {})["success"]:
            assert time.monotonic() < deadline, "reset_prefix_cache never succeeded: some request still holds blocks"
            time.sleep(0.05)

    def randomize_kv(self, seed: int) -> None:
        """Every worker's KV tensors overwritten (``vllm_harness.KVRandomizer``)."""
        results = self._call("/collective_rpc", {"method": "randomize_kv_cache", "args": [str(seed)]})["results"]
        assert results and all(int(n) > 0 for n in results), results

    def metrics(self) -> Dict[str, float]:
        """``GET /metrics``: each series' value summed over its labels."""
        return harness.metric_sums_of(self._call("/metrics"))


@contextmanager
def served(workdir: Path, env: Dict[str, str], name: str, path: str, connector: Optional[dict] = None):
    """The server for model ``name`` with the harness's engine settings, scheduler and worker in
    processes of their own (``--distributed-executor-backend mp``; a one-device server would
    otherwise run ``uni``: the worker inside the EngineCore process)."""
    argv = [*_cli(harness.engine_kwargs(harness.MODELS[name], path, backend="mp")),
            "--worker-extension-cls", "vllm_harness.KVRandomizer"]
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(_transfer_config(connector))]
    with api_server(workdir, env, name, argv) as server:
        yield server


@contextmanager
def api_server(workdir: Path, env: Dict[str, str], name: str, argv: List[str]):
    """``vllm.entrypoints.openai.api_server`` with ``argv`` on a free loopback port, healthy,
    its log in ``workdir``; stopped on exit."""
    port = _free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv,
            "--host", "127.0.0.1", "--port", str(port)]
    log_path = workdir / f"server-{name}-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        server = Server(proc, port, log_path)
        server.wait_healthy()
        yield server
    finally:
        _stop(proc)


def _serve_scenario(server: Server):
    """P1, then P2 after a forced miss, through HTTP; returns (outputs, external hit tokens per
    phase, the final /metrics). (No repeat of P1: ``test_vllm.py`` covers it, this is time.)"""
    p1, p2 = harness.prompts()
    out, hits, seen = {}, {}, 0.0
    for seed, (phase, prompt) in enumerate((("p1", p1), ("p2", p2))):
        if seed:
            server.randomize_kv(seed)  # after the drain below: nothing in vLLM's cache is valid
        out[phase] = server.complete(prompt)
        server.drain()
        now = server.metrics()[EXTERNAL_HITS + "_total"]
        hits[phase], seen = now - seen, now
    return out, hits, server.metrics()


# ---- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, kind", SERVER_CASES)
def test_server_hits_and_matches_plain(workdir, base_env, model_dirs, reference, store_serve, name, kind):
    """Under ``vllm serve`` (scheduler and worker in two processes) P2 hits the store after a
    forced miss, vLLM's /metrics and kvstride's series show it, and the output equals the
    plain run's in tokens and logprobs."""
    connector = _store(kind, f"server-{name}-{os.getpid()}")
    with served(workdir, _env(base_env, kind, store_serve), name, model_dirs[name], connector) as server:
        got, hits, metrics = _serve_scenario(server)
        exported = server._call("/metrics")
    _assert_monitoring_series_exist(metrics, exported)
    kvstride = {k: v for k, v in metrics.items() if k.startswith("vllm:kvstride_")}
    # kvstride's own series are exported (build_prom_metrics) whether or not anything hit.
    assert {"vllm:kvstride_lookups_total", "vllm:kvstride_bytes_loaded_total"} <= set(kvstride), sorted(metrics)
    assert kvstride["vllm:kvstride_lookups_total"] >= 2, kvstride
    _assert_hits(hits, name, kvstride)
    assert kvstride["vllm:kvstride_bytes_loaded_total"] > 0, kvstride
    # What the connector cost vLLM's threads, from the scheduler's process and the worker's.
    assert kvstride.get("vllm:kvstride_scheduler_seconds_total", 0) > 0, kvstride
    assert kvstride.get("vllm:kvstride_worker_step_seconds_total", 0) > 0, kvstride
    assert kvstride.get("vllm:kvstride_failures_total", 0) == 0, kvstride
    assert _mismatches(got, reference[name]) == []


MONITORING = Path(__file__).resolve().parents[1] / "docs" / "monitoring"


def _assert_monitoring_series_exist(metrics: Dict[str, float], exported: str) -> None:
    """Every series the shipped alert rules and dashboard name is on a real server's /metrics,
    with the ``model_name`` label they select on, and both files parse."""
    import re

    import yaml

    rules = (MONITORING / "kvstride-alerts.yml").read_text()
    dashboard = (MONITORING / "kvstride-dashboard.json").read_text()
    assert [rule["alert"] for group in yaml.safe_load(rules)["groups"] for rule in group["rules"]]
    assert json.loads(dashboard)["panels"]
    named = set(re.findall(r"vllm:[a-z_]+", rules + dashboard))
    assert named and named <= set(metrics), sorted(named - set(metrics))
    for series in named:
        assert re.search(rf'^{series}{{[^}}]*model_name="', exported, re.M), series


@pytest.mark.parametrize("name, kind", MP_CASES)
def test_llm_mp_hits_and_matches_plain(workdir, base_env, model_dirs, reference, store_serve, name, kind):
    """``LLM(distributed_executor_backend="mp")`` in its own process: the harness scenario
    (forced misses through ``collective_rpc``) hits the store and matches the plain run."""
    connector = _store(kind, f"mp-{name}-{os.getpid()}")
    job = dict(model=name, path=model_dirs[name], backend="mp", connector=connector, phases="scenario")
    # collective_rpc with a function (harness.randomize_kv) needs pickle between the processes.
    env = _env(base_env, kind, store_serve, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    (result,) = _run_engines(workdir, env, [job], f"mp-{name}-{kind}")
    _assert_hits(result["hits"], name, result["kvstride"])
    assert result["kvstride"].get("vllm:kvstride_failures", 0) == 0, result["kvstride"]
    assert _mismatches(_outputs(result["outputs"]), reference[name]) == []


@pytest.mark.parametrize("name", SHARED_CASES)
def test_mooncake_shared_across_engines(workdir, base_env, model_dirs, reference, store_serve, name):
    """Engine A computes P1 and exits; engine B, a new process with the same PYTHONHASHSEED,
    gets P2 (after overwriting its KV cache) from what A left in ``kvstride store serve``,
    with the plain run's tokens and logprobs."""
    connector = _store("mooncake", f"shared-{name}-{os.getpid()}")
    env = _env(base_env, "mooncake", store_serve, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    job = dict(model=name, path=model_dirs[name], backend="uni", connector=connector)
    (a,) = _run_engines(workdir, env, [dict(job, phases=["p1"])], f"shared-{name}-a")
    assert a["hits"] == {"p1": 0}, a  # (its puts may finish after the last stats: B's hits tell)
    (b,) = _run_engines(workdir, env, [dict(job, phases=["p2"])], f"shared-{name}-b")
    _assert_hits(b["hits"], name, b["kvstride"])
    assert b["kvstride"].get("vllm:kvstride_failures", 0) == 0, b["kvstride"]
    got = {**_outputs(a["outputs"]), **_outputs(b["outputs"])}
    assert _mismatches(got, reference[name]) == []


def _tp2_env(base_env, kind: str, store_serve) -> Dict[str, str]:
    """TP=2 on the CPU build: collective_rpc(randomize_kv) needs pickle between the processes,
    and two ranks on one NUMA node need an explicit OpenMP binding (one core each)."""
    return _env(base_env, kind, store_serve, VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND="0|1")


TP_MODEL = "gemma3"  # 2 KV heads: one per rank at TP=2


@pytest.fixture(scope="module")
def plain_tp2(workdir, base_env, model_dirs):
    """The scenario of a model on a plain TP=2 engine: the reference of every TP=2 run (TP
    changes vLLM's reduction order, so a TP=1 run is not); computed once per model."""
    cache: Dict[str, Dict[str, harness.Output]] = {}

    def get(model: str = TP_MODEL) -> Dict[str, harness.Output]:
        if model not in cache:
            job = dict(model=model, path=model_dirs[model], backend="mp", tp=2, phases="scenario", connector=None)
            (plain,) = _run_engines(workdir, _tp2_env(base_env, "embedded", None), [job], f"tp2-plain-{model}")
            cache[model] = _outputs(plain["outputs"])
        return cache[model]

    return get


def test_tensor_parallel_two_ranks(workdir, base_env, model_dirs, store_serve, plain_tp2):
    """TP=2 on the CPU build (two Worker processes, each with its own arena shard): a save is
    readable only once both ranks wrote it, and the hit both ranks load matches a plain TP=2
    run (TP changes vLLM's reduction order, so the reference is TP=2 too). The CPU build binds
    one OpenMP thread set per rank; on one NUMA node that needs an explicit binding."""
    job = dict(model=TP_MODEL, path=model_dirs[TP_MODEL], backend="mp", tp=2, phases="scenario")
    env = _tp2_env(base_env, "embedded", store_serve)
    (result,) = _run_engines(workdir, env, [{**job, "connector": _store("embedded", "tp2")}], f"tp2-{TP_MODEL}")
    _assert_hits(result["hits"], TP_MODEL, result["kvstride"])
    assert result["kvstride"].get("vllm:kvstride_failures", 0) == 0, result["kvstride"]
    assert _mismatches(_outputs(result["outputs"]), plain_tp2()) == []


def test_tensor_parallel_disk_tier_across_a_restart(workdir, base_env, model_dirs, plain_tp2, tmp_path):
    """TP=2 with the embedded store's disk tier: engine A runs the scenario, writing every
    value through to each rank's record file; engine B, a new process on the same folder with
    an empty memory tier, hits P2 and the repeat from disk on both ranks, bit-identical with a
    plain TP=2 run."""
    folder = tmp_path / "disk"
    folder.mkdir()
    connector = {"store": "embedded", "store_bytes": "8MiB", "disk_path": str(folder), "disk_bytes": "64MiB"}
    job = dict(model=TP_MODEL, path=model_dirs[TP_MODEL], backend="mp", tp=2, connector=connector)
    env = _tp2_env(base_env, "embedded", None)
    (a,) = _run_engines(workdir, env, [dict(job, phases="scenario")], "tp2-disk-a")
    assert _mismatches(_outputs(a["outputs"]), plain_tp2()) == [], "engine A (TP=2, disk tier)"
    assert {"kvstride-rank0-of-2.records", "kvstride-rank1-of-2.records"} <= set(os.listdir(folder))
    (b,) = _run_engines(workdir, env, [dict(job, phases=["p2", "repeat"])], "tp2-disk-b")
    # A stored P2 whole: both prompts hit all but their last block.
    assert b["hits"] == {"p2": harness.PROMPT_TOKENS - 32, "repeat": harness.PROMPT_TOKENS - 32}, b
    assert b["kvstride"].get("vllm:kvstride_loads_from_disk", 0) == 2, b["kvstride"]
    assert b["kvstride"].get("vllm:kvstride_failures", 0) == 0, b["kvstride"]
    assert _mismatches(_outputs(b["outputs"]), {k: plain_tp2()[k] for k in ("p2", "repeat")}) == []


#: External hit tokens of the scenario's phases after a forced miss, when the store holds
#: everything computed before: P2 shares P1's first 384 tokens; a prompt stored whole hits all
#: but its last block (a 32-token block must be computed to keep one token for vLLM).
SCENARIO_HITS = {"p1": 0, "p2": harness.SHARED_TOKENS, "repeat": harness.PROMPT_TOKENS - 32}


@pytest.mark.parametrize("model", ["gemma3", "llama"])
def test_tensor_parallel_mooncake_within_across_engines_and_tp_sizes(
    workdir, base_env, model_dirs, reference, store_serve, plain_tp2, model
):
    """TP=2 on one Mooncake store (``kvstride store serve``), each rank keying its own head
    shard (SEMANTICS §3: with 2 KV heads over 2 ranks no two ranks share a key), with no load
    failure anywhere:
    - engine A (TP=2) runs the scenario: P2 and the repeat hit what A stored, bit-identical
      with a plain TP=2 run;
    - engine B (TP=2, a new process) hits what A stored for P2 (P2 whole: all but its last
      block), bit-identical with the plain TP=2 run;
    - engine C (TP=1, a new process) on the same store either misses or loads the right
      shard, never a TP=2 rank's: its P2 equals a plain TP=1 run's.
    (These loads used to stall for 10-50 s and fail on Mooncake's read lease: a staging pool
    first touched by the two ranks' first loads at once froze this 2-core VM; the pool is
    touched when it is made now. A 10 s stall of engine B's first reads was seen once since:
    see ``MOONCAKE_READ_BOUND_S``.)"""
    tag = f"tp2-mooncake-{model}-{os.getpid()}"
    job = dict(model=model, path=model_dirs[model], connector=_store("mooncake", tag))
    env = _tp2_env(base_env, "mooncake", store_serve)
    (a,) = _run_engines(workdir, env, [dict(job, backend="mp", tp=2, phases="scenario")], f"tp2-mooncake-{model}-a")
    assert a["hits"] == SCENARIO_HITS, f"engine A: hits {a['hits']}, kvstride {a['kvstride']}"
    assert _mismatches(_outputs(a["outputs"]), plain_tp2(model)) == [], "engine A (TP=2, Mooncake)"
    (b,) = _run_engines(workdir, env, [dict(job, backend="mp", tp=2, phases=["p2"])], f"tp2-mooncake-{model}-b")
    assert b["hits"] == {"p2": harness.PROMPT_TOKENS - 32}, f"engine B: hits {b['hits']}, kvstride {b['kvstride']}"
    assert _mismatches(_outputs(b["outputs"]), plain_tp2(model)) == [], "engine B (TP=2, a new process)"
    env1 = _env(base_env, "mooncake", store_serve, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    (c,) = _run_engines(workdir, env1, [dict(job, backend="uni", phases=["p2"])], f"tp1-mooncake-{model}-c")
    assert _mismatches(_outputs(c["outputs"]), reference[model]) == [], f"engine C (TP=1): hits {c['hits']}"
    for engine, r in (("A", a), ("B", b), ("C", c)):
        assert r["kvstride"].get("vllm:kvstride_failures", 0) == 0, f"engine {engine}: {r['kvstride']}"


def test_mooncake_shared_across_engines_with_vllm_default_hash(workdir, base_env, model_dirs, reference, store_serve):
    """vLLM's default ``prefix_caching_hash_algo`` (``sha256``, pickle-based) with a fixed
    PYTHONHASHSEED: engines of the same vLLM and Python share a Mooncake store as with vLLM's
    own connector. Engine A computes P1 and exits; engine B, a new process, hits exactly the
    384 tokens P2 shares with it and matches the plain run."""
    name = "llama"
    connector = _store("mooncake", f"sha256-{name}-{os.getpid()}")
    env = _env(base_env, "mooncake", store_serve, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    job = dict(model=name, path=model_dirs[name], backend="uni", connector=connector,
               overrides={"prefix_caching_hash_algo": "sha256"})
    (a,) = _run_engines(workdir, env, [dict(job, phases=["p1"])], f"sha256-{name}-a")
    (b,) = _run_engines(workdir, env, [dict(job, phases=["p2"])], f"sha256-{name}-b")
    assert b["hits"] == {"p2": harness.SHARED_TOKENS}, b
    assert b["kvstride"].get("vllm:kvstride_failures", 0) == 0, b["kvstride"]
    got = {**_outputs(a["outputs"]), **_outputs(b["outputs"])}
    assert _mismatches(got, reference[name]) == []


def test_mooncake_new_checkpoint_at_the_same_path(workdir, base_env, reference, store_serve, tmp_path_factory):
    """A rollout: engine A computes P1 into ``kvstride store serve`` and exits; a fine-tune (the
    same config, every weight moved) replaces the checkpoint at the same path; engine B, a new
    process, hits nothing and matches a plain run of the new weights in tokens and logprobs. The
    control: an engine on the unchanged weights, also a new process, hits A's KV and matches
    the plain run; and the fine-tune's own output differs from the old weights' (had B loaded
    A's KV, it would show)."""
    path = harness.llama(tmp_path_factory.mktemp("rollout") / "prod")
    connector = _store("mooncake", f"rollout-{os.getpid()}")
    env = _env(base_env, "mooncake", store_serve, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    job = dict(model="llama", path=path, backend="uni", connector=connector, phases=["p1"])
    (a,) = _run_engines(workdir, env, [job], "rollout-a")
    (same,) = _run_engines(workdir, env, [job], "rollout-same-weights")
    assert same["hits"]["p1"] >= harness.SHARED_TOKENS, same
    assert _mismatches(_outputs(same["outputs"]), reference["llama"]) == []
    harness.llama_finetuned(Path(path))
    b, plain = _run_engines(workdir, env, [job, dict(job, connector=None)], "rollout-b")
    assert b["hits"] == {"p1": 0}, b
    assert b["kvstride"].get("vllm:kvstride_failures", 0) == 0, b["kvstride"]
    assert _mismatches(_outputs(b["outputs"]), _outputs(plain["outputs"])) == []
    assert _mismatches(_outputs(plain["outputs"]), reference["llama"]) != [], "the fine-tune changed no output"


@pytest.mark.parametrize("kind", ["mooncake", "disk"])
def test_a_lora_adapter_retrained_at_the_same_name_and_path(workdir, base_env, store_serve, tmp_path_factory, kind):
    """An adapter redeployed as operators ship them: engine A serves adapter v1 of
    /adapters/sql and stores its KV (``kvstride store serve``, or the disk tier); a new engine
    on v1's bytes hits it and matches a plain run of v1 (the control). v2, retrained, replaces
    it at the same name and path (vLLM's block hashes are the same); engine B, a new process,
    hits nothing, fails nothing and matches a plain run of v2 in tokens and logprobs, which
    differs from v1's (had B loaded A's KV, it would show)."""
    root = tmp_path_factory.mktemp(f"lora-{kind}")
    base = harness.llama(root / "llama")
    adapter = root / "adapters" / "sql"
    harness.lora_adapter(adapter, base, version=1)
    if kind == "mooncake":
        connector = _store("mooncake", f"lora-{os.getpid()}")
    else:
        (root / "disk").mkdir()
        connector = {"store": "embedded", "store_bytes": "8MiB", "disk_path": str(root / "disk"), "disk_bytes": "64MiB"}
    env = _env(base_env, kind, store_serve, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    job = dict(model="llama", path=base, backend="uni", connector=connector, phases=["p1"],
               lora=["sql", 1, str(adapter)], overrides=harness.LORA_ENGINE)
    plain_v1, a, same = _run_engines(workdir, env, [dict(job, connector=None), job, job], f"lora-{kind}-v1")
    assert a["hits"] == {"p1": 0}, a
    assert same["hits"]["p1"] >= harness.SHARED_TOKENS, same
    for run in (a, same):
        assert run["kvstride"].get("vllm:kvstride_failures", 0) == 0, run["kvstride"]
        assert _mismatches(_outputs(run["outputs"]), _outputs(plain_v1["outputs"])) == []
    harness.lora_adapter(adapter, base, version=2)
    b, plain_v2 = _run_engines(workdir, env, [job, dict(job, connector=None)], f"lora-{kind}-v2")
    assert b["hits"] == {"p1": 0}, b
    assert b["kvstride"].get("vllm:kvstride_failures", 0) == 0, b["kvstride"]
    assert _mismatches(_outputs(b["outputs"]), _outputs(plain_v2["outputs"])) == []
    assert _mismatches(_outputs(plain_v2["outputs"]), _outputs(plain_v1["outputs"])) != [], "v2 changed no output"


def test_server_with_the_disk_tier_hits_across_a_restart(workdir, base_env, model_dirs, reference, tmp_path):
    """``vllm serve`` with the embedded store's disk tier, as operators restart it: server A
    computes P1 (written through to disk; P2 after it lets A's scheduler learn that the write
    finished) and stops; server B, a new server on the same folder with an empty memory tier,
    hits P1 from disk and matches the plain run in tokens and logprobs."""
    name = "llama"
    folder = tmp_path / "disk"
    folder.mkdir()
    connector = {"store": "embedded", "store_bytes": "8MiB", "disk_path": str(folder), "disk_bytes": "64MiB"}
    p1, p2 = harness.prompts()
    with served(workdir, base_env, name, model_dirs[name], connector) as a:
        first = a.complete(p1)
        a.drain()
        a.complete(p2)
        a.drain()
        written = a.metrics()
    assert written.get("vllm:kvstride_disk_bytes_written_total", 0) > 0, written
    assert _mismatches({"p1": first}, reference[name]) == []
    with served(workdir, base_env, name, model_dirs[name], connector) as b:
        again = b.complete(p1)
        b.drain()
        metrics = b.metrics()
    kvstride = {k: v for k, v in metrics.items() if k.startswith("vllm:kvstride_")}
    assert metrics[EXTERNAL_HITS + "_total"] >= harness.PEER_HITS[name], kvstride
    assert kvstride.get("vllm:kvstride_loads_from_disk_total", 0) >= 1, kvstride
    assert kvstride.get("vllm:kvstride_failures_total", 0) == 0, kvstride
    assert _mismatches({"p1": again}, reference[name]) == []


@pytest.fixture
def peer_master(workdir, tmp_path):
    """A bare ``mooncake_master`` for vLLM's MooncakeStoreConnector in its default mode (the
    engine brings its own segment), as ``benches/vllm_connectors.py`` runs it; yields its
    MOONCAKE_CONFIG_PATH: the master and the transport, the rest left to vLLM's defaults. One per
    test, so that no server finds objects listed there by an earlier one, since exited."""
    from kvstride.cli import STORE_SERVE_CLIENT_TTL_S
    from kvstride.stores import start_master

    master = start_master(client_ttl_s=STORE_SERVE_CLIENT_TTL_S, extra_args=["--minloglevel=1"], log_dir=str(workdir))
    config = tmp_path / "mooncake-peer.json"
    config.write_text(json.dumps({"master_server_address": master.address, "protocol": "tcp", "device_name": "",
                                  "metadata_server": "P2PHANDSHAKE"}))
    try:
        yield config
    finally:
        master.stop()


@pytest.mark.parametrize("connector", ["kvstride", "MooncakeStoreConnector"])
@pytest.mark.parametrize("block_size, hit", [(256, 512), (None, 0)])
def test_a_hybrid_prompt_sent_again_hits_under_vllm_defaults_given_the_block_size(workdir, base_env, tmp_path,
                                                                                  request, connector, block_size, hit):
    """The README's check on a Mamba hybrid (Qwen3-Next's shape) under ``vllm serve`` with vLLM's
    scheduling and caching defaults and the README's connector line: a 700-token prompt, a
    prefix-cache reset, the same prompt again. With ``--block-size 256`` (the block vLLM's CPU
    workers give this model) it hits its first two blocks. Without it vLLM's scheduler ends the
    prompt's chunk inside a Mamba state block and keeps no state to store: no hit, and kvstride
    says why once. vLLM's MooncakeStoreConnector in its default mode hits the same, as it too
    needs that state."""
    path = harness.MODELS["qwen3_next"].build(tmp_path / "qwen3_next")
    env, transfer = base_env, _transfer_config({"store": "embedded"})
    if connector != "kvstride":
        env = dict(base_env, MOONCAKE_CONFIG_PATH=str(request.getfixturevalue("peer_master")))
        transfer = {"kv_connector": connector, "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {}}
    argv = [
        "--model", path, "--load-format", "safetensors", "--skip-tokenizer-init", "--enforce-eager",
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(96 << 20),
        "--kv-transfer-config", json.dumps(transfer),
    ]
    if block_size:
        argv += ["--block-size", str(block_size)]
    with api_server(workdir, env, f"hybrid-{connector}", argv) as server:
        prompt = [(7 * i + 3) % 500 + 3 for i in range(700)]
        hits = []
        for _ in range(2):
            before = server.metrics().get(EXTERNAL_HITS + "_total", 0.0)
            server.complete(prompt)
            server.drain()
            hits.append(server.metrics()[EXTERNAL_HITS + "_total"] - before)
    said = server.log_path.read_text().count("inside a 256-token Mamba state block")
    assert hits == [0, hit] and said == int(connector == "kvstride" and not hit), (hits, said)
