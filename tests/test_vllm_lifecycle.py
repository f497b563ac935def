"""Engines that come and go in one process (issue "Save-side lifetimes", item 5): a connector's
shutdown closes what it opened, so building and closing ``LLM(...)`` again and again does not
grow Mooncake clients, kvstride threads or memory.

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import threading

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from vllm import LLM  # noqa: E402

from kvstride.vllm import store_registry  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstride.stores import MooncakeStore  # noqa: E402
from mooncake_fixture import mooncake_master  # noqa: E402,F401  (fixture)

ROUNDS = 4
#: Resident memory an engine round may leave behind once the process has warmed up (vLLM's
#: own caches, allocator slack). A Mooncake client left open keeps its 256 MiB segment.
RSS_SLACK = 48 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _kvstride_threads() -> list:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvstride"))


def _open_clients() -> int:
    import gc

    return sum(1 for o in gc.get_objects() if isinstance(o, MooncakeStore) and not o.closed)


def test_repeated_engines_leak_nothing(tmp_path, mooncake_master):
    """Each round: an engine with the connector on a Mooncake store (each connector a client
    with a segment of its own), one request, shutdown. After the first round, no round leaves
    a client open, a kvstride thread running, or more than ``RSS_SLACK`` of memory."""
    path = harness.MODELS["llama"].build(tmp_path / "llama")
    connector = {
        "store": "mooncake", "mooncake_master": mooncake_master.address, "mooncake_local_hostname": "127.0.0.1",
        "mooncake_segment_bytes": 256 << 20, "store_name": "lifecycle",
    }
    p1, _ = harness.prompts()
    before = _kvstride_threads()  # the master fixture's own (its spawner)
    seen = []
    for _ in range(ROUNDS):
        llm = LLM(**harness.engine_kwargs(harness.MODELS["llama"], path, connector=connector))
        harness.generate(llm, p1)
        harness.close(llm)
        seen.append((_open_clients(), _kvstride_threads(), _rss()))
    clients, threads, rss = zip(*seen)
    assert all(n == 0 for n in clients), f"Mooncake clients left open after each round: {clients}"
    assert all(t == before for t in threads), f"kvstride threads after each round: {threads}, before: {before}"
    growth = rss[-1] - rss[1]
    assert growth <= RSS_SLACK * (ROUNDS - 2), f"resident memory grew {growth >> 20} MiB over {ROUNDS - 2} rounds: {rss}"
    assert not store_registry._STORES, store_registry._STORES
