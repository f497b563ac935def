"""``benches/serve_gains.py --smoke``: one tiny cell of the serving bench (``vllm serve`` with
kvstride, driven by ``vllm bench serve``) runs and its connector hits; a cell without hits fails
the bench. Needs the vLLM environment (``make test-vllm``)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

import serve_gains  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("serve-gains")
    out = folder / "smoke.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "serve_gains.py"), "--smoke", "--json", str(out),
         "--cache", str(folder / "cache")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return {"rc": run.returncode, "stdout": run.stdout, "report": json.loads(out.read_text())}


def test_the_smoke_cell_serves_every_request_and_hits_where_prompts_are_reused(smoke):
    assert smoke["rc"] == 0, smoke["stdout"][-3000:]
    cells = smoke["report"]["models"]["tiny"]["cells"]
    assert list(cells) == ["kvstride"], cells
    for workload, row in cells["kvstride"].items():
        assert row["failed"]["max"] == 0 and row["completed"]["min"] > 0, (workload, row)
    for workload in serve_gains.REUSING:
        assert cells["kvstride"][workload]["external_hit_tokens"]["median"] > 0, workload
    assert cells["kvstride"]["no-reuse"]["external_hit_tokens"]["median"] == 0


def test_a_connector_cell_without_hits_fails_the_bench(smoke):
    cells = copy.deepcopy(smoke["report"]["models"]["tiny"]["cells"])
    assert serve_gains.missing_hits(cells, serve_gains.WORKLOADS) == []
    cells["kvstride"]["rag"]["external_hit_tokens"] = {"median": 0.0, "min": 0.0, "max": 0.0}
    assert serve_gains.missing_hits(cells, serve_gains.WORKLOADS) == ["kvstride on rag"]
