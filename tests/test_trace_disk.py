"""``kvstride simulate --trace ... --disk-bytes``: the kvstride policy's memory over a local disk
(kvstride.capacity.TieredIndex), written through or spilled to, on small hand-made traces."""

import io
import json
from contextlib import redirect_stdout

import numpy as np
import pytest

from kvstride.capacity import DISK_POLICIES, TieredIndex
from kvstride.cli import main
from kvstride.trace import ReplayConfig, TraceReplay, TraceRequest, load_model, replay
from test_cli_errors import assert_one_line_and_exit_2

# Attention and Mamba blocks of 512 tokens (one trace block each): a 4-block prompt saves 4
# attention blocks (40 bytes) and its end and resend states (60 bytes).
TOY = {
    "name": "toy-hybrid",
    "groups": [
        {"kind": "full_attention", "block_size": 512, "layers": 1, "bytes_per_block": 10},
        {"kind": "mamba", "mamba_mode": "align", "block_size": 512, "layers": 1, "bytes_per_block": 30},
    ],
}


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(TOY))
    return load_model(str(path))


def req(ids):
    return TraceRequest(512 * len(ids), list(ids))


# A prompt, three others that push it out of a 250-byte memory, and the prompt again, twice.
PUSHED_OUT = [req([1, 2, 3, 4]), req([10, 11, 12, 13]), req([20, 21, 22, 23]), req([30, 31, 32, 33]),
              req([1, 2, 3, 4]), req([1, 2, 3, 4])]


def random_trace(seed: int, requests: int = 200):
    """Shared prefixes and new tails, prompts ending inside their last trace block."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(requests):
        base = [int(x) for x in rng.choice(6, size=rng.integers(0, 4))]
        ids = base + [int(x) for x in rng.integers(100, 140, size=rng.integers(1, 5))]
        out.append(TraceRequest(512 * len(ids) - int(rng.integers(0, 400)), ids))
    return out


def run(model, trace, memory, disk=0, disk_policy="write-through", **kw):
    """One kvstride replay; every reported hit is checked to be in the index (either tier)."""
    def on_hit(rp, index, hashes, hit):
        assert all(index.exists(keys_of_hit(rp, hashes, hit))), hit

    return TraceReplay(model).run(trace, ReplayConfig(model, memory, "kvstride", disk_bytes=disk,
                                                      disk_policy=disk_policy, on_hit=on_hit, **kw))


def keys_of_hit(rp, hashes, hit):
    """The toy's keys a hit of ``hit`` tokens needs: its attention blocks and the state at it."""
    key = rp.planner.key
    return [key(0, hashes[e // 512 - 1]) for e in range(512, hit + 1, 512)] + [key(1, hashes[hit // 512 - 1])]


@pytest.mark.parametrize("disk_policy", DISK_POLICIES)
def test_a_disk_serves_what_memory_evicted(toy, disk_policy):
    alone = run(toy, PUSHED_OUT, 250)
    assert alone["hit_tokens"] == 1536 and alone["evictions"] > 0  # the second repeat only
    tiered = run(toy, PUSHED_OUT, 250, 1 << 20, disk_policy)
    assert tiered["hit_tokens"] == 2 * 1536  # both repeats hit their resend boundary
    assert tiered["resident_bytes"] <= 250 and tiered["unservable_hits"] == 0
    # The first repeat reads its hit's 3 attention blocks and state back from disk into memory;
    # the second finds them there.
    assert tiered["disk_bytes_read"] == 3 * 10 + 30 and tiered["loads_from_disk"] == 1


def test_disk_bytes_zero_is_memory_alone(toy):
    """With disk_bytes 0 the replay is memory alone; memory-alone runs give the same figures
    with disk runs between them (the replay's shared trie and caches), and a disk too small
    for any value (1 byte) changes nothing under either policy."""
    trace = random_trace(3)
    plain = replay(trace, toy, [300, 600], ["kvstride"])
    with_disk = replay(trace, toy, [300, 600], ["kvstride"], disk_bytes=1 << 20)
    assert [(r["disk_bytes"], r["disk_policy"]) for r in with_disk] == [
        (0, None), (1 << 20, "write-through"), (1 << 20, "spill")] * 2
    figures = ("hit_tokens", "hits", "bytes_written", "values_written", "evictions", "resident_bytes",
               "resident_bytes_by_kind", "disk_bytes_written", "disk_bytes_read")
    for alone, row in zip(plain, with_disk[::3]):
        assert alone["hit_tokens"] > 0 and alone["disk_bytes_written"] == 0
        assert {f: alone[f] for f in figures} == {f: row[f] for f in figures}
    for disk_policy in DISK_POLICIES:
        tiny = run(toy, trace, 300, 1, disk_policy)
        assert {f: tiny[f] for f in figures[:7]} == {f: plain[0][f] for f in figures[:7]}, disk_policy


@pytest.mark.parametrize("seed", [3, 4])
def test_a_larger_memory_and_disk_hit_more_and_every_hit_is_servable(toy, seed):
    trace = random_trace(seed)
    alone = run(toy, trace, 300)
    for disk_policy in DISK_POLICIES:
        tiered = run(toy, trace, 300, 1 << 20, disk_policy)
        assert tiered["hit_tokens"] > alone["hit_tokens"], disk_policy
        assert tiered["unservable_hits"] == 0 and tiered["disk_resident_bytes"] <= 1 << 20
        assert tiered["resident_bytes"] <= 300


def test_write_through_writes_what_is_saved_and_spill_what_memory_evicts(toy):
    trace = random_trace(5)
    # Memory never fills: spill writes nothing, write-through every value saved.
    through = run(toy, trace, 1 << 30, 1 << 30, "write-through")
    spill = run(toy, trace, 1 << 30, 1 << 30, "spill")
    assert through["evictions"] == 0 and spill["disk_bytes_written"] == 0
    assert through["disk_bytes_written"] == through["bytes_written"] > 0
    assert through["hit_tokens"] == spill["hit_tokens"] == run(toy, trace, 1 << 30)["hit_tokens"]
    # Memory full, the disk not: spill writes each evicted value once, at most what was saved.
    through = run(toy, trace, 300, 1 << 30, "write-through")
    spill = run(toy, trace, 300, 1 << 30, "spill")
    assert 0 < spill["disk_bytes_written"] <= through["disk_bytes_written"]
    assert spill["disk_evictions"] == through["disk_evictions"] == 0


@pytest.mark.parametrize("disk", [100, 200])
def test_a_disk_smaller_than_memory_adds_nothing_under_write_through(toy, disk):
    """Written through, a disk smaller than memory holds the newest values memory stored, which
    memory still holds: the prompt pushed out of memory is gone from it too. A larger disk keeps
    it. (Each tier runs its own clock and counts the reads of what it holds, so on a trace with
    many reloads a smaller disk can keep a value memory dropped: the figures below are exact on
    this trace, not a bound.)"""
    alone = run(toy, PUSHED_OUT, 250)
    small = run(toy, PUSHED_OUT, 250, disk, "write-through")
    assert small["hit_tokens"] == alone["hit_tokens"] == 1536 and small["disk_bytes_read"] == 0
    assert small["disk_bytes_written"] == small["bytes_written"] and small["disk_evictions"] > 0
    assert run(toy, PUSHED_OUT, 250, 1 << 20, "write-through")["hit_tokens"] == 2 * 1536


def test_tiered_index_reads_back_with_the_disk_standing():
    """A value read back from disk is resident in memory again, with the depth the disk kept for
    it: of two values of one request, the deeper still leaves memory first."""
    index = TieredIndex(20, 100, "spill", value_weight=0)
    first, second = index.stamp(), index.stamp()
    index.put_many([("a16", 10, "full_attention", first, 16), ("a32", 10, "full_attention", first, 32)])
    index.put_many([("b16", 10, "full_attention", second, 16), ("b32", 10, "full_attention", second, 32)])
    assert index.memory.exists(["a16", "a32"]) == [False, False] and index.exists(["a16", "a32"]) == [True, True]
    assert index.disk.bytes_written == 20 and index.bytes_written == 40
    index.touch(["a16", "a32"], index.stamp())
    assert index.memory.exists(["a16", "a32", "b16", "b32"]) == [True, True, False, False]
    assert index.disk_bytes_read == 20 and index.loads_from_disk == 1
    assert index.memory.order.ordered(["a16", "a32"]) == ["a32", "a16"]
    assert index.disk.bytes_written == 40  # b's values spilled; a's were on disk already
    with pytest.raises(ValueError, match="write-through, spill"):
        TieredIndex(20, 100, "write-back")


def test_write_through_writes_what_memory_stores_once():
    """A value memory already holds is not saved again, so it is not written through again,
    though the smaller disk dropped it: the disk stays the newest values memory stored."""
    index = TieredIndex(40, 20, "write-through")
    for keys in (("a", "b"), ("c", "d"), ("a", "b")):
        stamp = index.stamp()
        index.put_many([(key, 10, "full_attention", stamp, depth) for depth, key in enumerate(keys)])
    assert index.bytes_written == index.disk.bytes_written == 40
    assert index.disk.exists(["a", "b", "c", "d"]) == [False, False, True, True]


def _trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"input_length": 512 * len(r.hash_ids), "hash_ids": r.hash_ids}) + "\n"
                            for r in PUSHED_OUT))
    model = tmp_path / "toy.json"
    model.write_text(json.dumps(TOY))
    return str(path), str(model)


def test_cli_reports_memory_alone_and_both_disk_policies(tmp_path):
    trace, model = _trace_file(tmp_path)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["simulate", "--trace", trace, "--model", model, "--capacity", "250,1K", "--disk-bytes", "1K",
                     "--json"]) == 0
    results = json.loads(out.getvalue())["results"]  # one JSON document
    assert [(r["capacity_bytes"], r["disk_policy"]) for r in results] == [
        (c, p) for c in (250, 1024) for p in (None, "write-through", "spill")]
    by = {(r["capacity_bytes"], r["disk_policy"]): r for r in results}
    assert by[(250, None)]["hit_tokens"] == 1536 and by[(250, "spill")]["hit_tokens"] == 2 * 1536
    assert by[(250, "spill")]["disk_bytes_written_per_request"] > 0
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["simulate", "--trace", trace, "--model", model, "--capacity", "250", "--disk-bytes", "1MiB",
                     "--disk-policy", "spill", "--quiet"]) == 0
    text = out.getvalue()
    assert "with a 1M disk below memory" in text and "spill" in text and "write-through" not in text


@pytest.mark.parametrize("argv, option, fix", [
    (["--disk-bytes", "4XB"], "--disk-bytes", "4T"),
    (["--disk-bytes=-1T"], "--disk-bytes", "4T"),
    (["--disk-bytes", "0"], "--disk-bytes", "4T"),
    (["--disk-bytes", "inf"], "--disk-bytes", "4T"),
    (["--disk-bytes", "4T", "--policy", "dense"], "--disk-bytes", "--policy kvstride"),
    (["--disk-policy", "spill"], "--disk-policy", "--disk-bytes SIZE"),
    (["--disk-policy", "write-back", "--disk-bytes", "4T"], "--disk-policy", "spill"),
])
def test_bad_disk_input_is_one_line_and_exit_2(tmp_path, capsys, argv, option, fix):
    trace, model = _trace_file(tmp_path)
    assert_one_line_and_exit_2(capsys, ["simulate", "--trace", trace, "--model", model, "--quiet", *argv], option, fix)


def test_the_disk_policy_needs_trace(capsys, tmp_path):
    """Without --trace the embedded store's disk tier is written through: no policy to choose."""
    try:
        code = main(["simulate", "--disk-bytes", "4T", "--disk-path", str(tmp_path), "--disk-policy", "spill"])
    except SystemExit as done:
        code = done.code
    assert code == 2 and "--disk-policy: only read by --trace FILE" in capsys.readouterr().err
