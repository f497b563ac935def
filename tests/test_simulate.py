"""``kvstride simulate`` and ``kvstride explain`` through the CLI's entry point, on small
workloads: every preset on the embedded store with and without faults, two presets on a real
Mooncake master, the plot, a run whose loaded bytes are wrong (the check must fail), the old
synchronous load order (the Mamba running state is wrong: the check must fail), and explain for
the ring mix and for a mix that cannot be keyed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstride import cli
from kvstride.mixes import PRESETS
from kvstride.arena import HostArena

# 4 conversations in batches of 2 over 4 turns: 8 request batches, so --fault-every 2
# injects a fault before batches 2, 4 and 6: corrupt, restart, evict.
SMALL = ["--conversations", "4", "--batch", "2", "--turns", "4", "--user-tokens", "100", "--reply-tokens", "60",
         "--chunk-tokens", "256", "--token-bytes", "16", "--state-bytes", "1024", "--store-bytes", "64M", "--quiet"]


def system_tokens(preset: str) -> str:
    # glm-ring's scheduler block is 1152 tokens: its system prompt must span two of them.
    return "2400" if preset == "glm-ring" else "600"


def simulate(capsys, preset, *extra):
    rc = cli.main(["simulate", "--preset", preset, "--system-tokens", system_tokens(preset), *SMALL, "--json", *extra])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    return rc, result


def check(rc, result, faults: bool):
    assert rc == 0, result
    assert result["load_timing"] == "async"
    assert result["verified"] is True and result["wrong_bytes"] == 0
    assert result["verified_bytes"] > 0 and result["hit_rate"] > 0
    history = result["history"]
    assert len(history) == 8
    # Turn 0: the second batch hits the first batch's system prompt, Mamba mixes included
    # (chunked prefill hands the Mamba state off at chunk ends).
    assert history[1]["hit_tokens"] > 0
    if faults:
        f = result["faults"]
        assert f["fault_corrupt"] == f["fault_restart"] == f["fault_evict"] == 1
        assert f["corrupted_values"] > 0 and f["evicted_values"] > 0
        assert result["outcomes"].get("get_corrupt", 0) > 0  # corrupted values were read and caught
        assert history[4]["hit_tokens"] == 0  # the batch right after the restart finds nothing
    else:
        assert not result["faults"]
        assert all(r["hit_tokens"] > 0 for r in history[1:])


@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_simulate_embedded(capsys, preset, faults):
    rc, result = simulate(capsys, preset, *(["--fault-every", "2"] if faults else []))
    assert result["store"] == "embedded" and result["mix"] == preset
    check(rc, result, faults)


@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
@pytest.mark.parametrize("preset", ["glm-ring", "qwen3-next"])
def test_simulate_mooncake(capsys, preset, faults):
    rc, result = simulate(capsys, preset, "--store", "mooncake", *(["--fault-every", "2"] if faults else []))
    assert result["store"] == "mooncake"
    check(rc, result, faults)


def test_chunk_tokens_rounding(capsys):
    # qwen3-next: S = 256, alignment 64 -> 300 rounds up to 320; glm-ring: at least S = 1152.
    _, result = simulate(capsys, "qwen3-next", "--chunk-tokens", "300")
    assert result["chunk_tokens"] == 320
    _, result = simulate(capsys, "glm-ring", "--chunk-tokens", "100")
    assert result["chunk_tokens"] == 1152


def test_plot_and_table(capsys, tmp_path):
    path = tmp_path / "sim.png"
    rc = cli.main(["simulate", "--preset", "llama", "--system-tokens", "600", *SMALL, "--plot", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "hit rate" in out and "verified" in out and "True" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


@pytest.mark.parametrize("preset", ["llama", "qwen3-next"])
def test_wrong_loaded_byte_fails_the_run(capsys, monkeypatch, preset):
    """Prove the check can fail: flip one byte of every block a load writes (the embedded
    store loads straight from its arena slots into the blocks)."""
    original = HostArena.load

    def load_then_flip(self, slots, groups, block_ids, **kwargs):
        ok = original(self, slots, groups, block_ids, **kwargs)
        for group, block_id in zip(np.asarray(groups)[ok], np.asarray(block_ids)[ok]):
            piece = self.layout.groups[int(group)].pieces[0]
            self.layout.storages[piece.storage][piece.offset + int(block_id) * piece.stride] ^= 0xFF
        return ok

    monkeypatch.setattr(HostArena, "load", load_then_flip)
    rc, result = simulate(capsys, preset)
    assert rc == 1
    assert result["verified"] is False and result["wrong_bytes"] > 0


@pytest.mark.parametrize("preset", ["qwen3-next", "glm-ring"])
def test_sync_load_leaves_the_mamba_running_state_wrong(capsys, preset):
    """The old connector: the load ran in the request's first computing step, after vLLM's
    preprocess_mamba had copied the (still garbage) hit-state block into the running state."""
    rc, result = simulate(capsys, preset, "--load-timing", "sync")
    assert rc == 1 and result["load_timing"] == "sync"
    assert result["verified"] is False and result["wrong_bytes"] > 0


def test_sync_load_without_mamba_is_right(capsys):
    # Attention blocks are read where they are loaded: the load order does not matter.
    rc, result = simulate(capsys, "gemma3", "--load-timing", "sync")
    assert rc == 0 and result["verified"] is True and result["wrong_bytes"] == 0


def test_simulate_refuses_a_mix_that_cannot_be_keyed(capsys):
    assert cli.main(["simulate", "--groups", "full_attention:16,mamba:24:mode=none", "--quiet"]) == 2
    assert "cannot be keyed" in capsys.readouterr().err


def test_explain_glm_ring(capsys):
    assert cli.main(["explain", "--preset", "glm-ring"]) == 0
    out = capsys.readouterr().out
    assert "S = 1152" in out and "H = 64" in out
    ring = next(line for line in out.splitlines() if "circular_buffer" in line and "takes part" not in line and line.strip().startswith("1"))
    assert "no " in ring and "skipped everywhere" in ring
    assert "not divisible by tokens_per_hash=64" in out and "islice(step=0)" in out
    assert "never keys, stores, looks up or loads it" in out


def test_explain_failing_mix(capsys):
    assert cli.main(["explain", "--groups", "full_attention:16,mamba:24:mode=none"]) == 2
    out = capsys.readouterr().out
    assert "this mix cannot be keyed" in out and "H=48" in out
    assert "nearest mixes that work" in out
    assert "set mamba mode align on group 1: S=48 H=8" in out
    assert 'kvstride explain --groups "full_attention:16,mamba:24"' in out


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"kvstride {version('kvstride')}"


def test_the_embedded_store_over_a_disk_tier_hits_what_memory_evicted_and_again_next_run(capsys, tmp_path):
    """1 MiB of memory holds about half the conversations' values: the disk tier below it serves
    the rest (every loaded byte verified), and a second run on the same folder, a new store,
    hits from the records the first one left."""
    base = ["simulate", "--preset", "glm-ring", "--store-bytes", "1M", "--conversations", "8", "--turns", "3", "--json"]
    disk = ["--disk-path", str(tmp_path), "--disk-bytes", "256M"]
    results = []
    for extra in ([], disk, disk):
        assert cli.main([*base, *extra]) == 0
        results.append(json.loads(capsys.readouterr().out))
    memory_alone, first, second = results
    assert all(r["verified"] and r["wrong_bytes"] == 0 for r in results)
    assert first["hit_rate"] > memory_alone["hit_rate"] and first["disk"]["disk_bytes_read"] > 0
    assert first["disk"]["disk_bytes_written"] > 0 and not first["disk"].get("disk_records_rejected")
    assert second["hit_rate"] > first["hit_rate"]  # its first turns hit too: the records outlived the first store


@pytest.mark.parametrize("extra,says", [
    (["--disk-bytes", "1G"], "--disk-bytes and --disk-path go together"),
    (["--disk-bytes", "1G", "--disk-path", "{tmp}/missing"], "is not a folder"),
    (["--store", "mooncake", "--disk-bytes", "1G", "--disk-path", "{tmp}"], "the disk tier is the embedded store's"),
])
def test_disk_options_of_the_workload_are_one_line_and_exit_2(capsys, tmp_path, extra, says):
    argv = ["simulate", "--preset", "llama", "--quiet", *(a.format(tmp=tmp_path) for a in extra)]
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and len(err.splitlines()) == 1, err
