"""``kvstride simulate --trace``: Mooncake-format trace replay through the core and the
capacity index (kvstride.trace, kvstride.capacity), on small hand-made traces whose hits are
known exactly."""

import gzip
import hashlib
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from kvstride import _core
from kvstride.arena import SlotIndex
from kvstride.capacity import BoundaryIndex, LRUIndex, PrefixIndex
from kvstride.cli import main
from kvstride.trace import (
    EXTRA_POLICIES,
    POLICIES,
    ReplayConfig,
    TraceReplay,
    TraceRequest,
    block_tokens,
    list_models,
    load_model,
    read_trace,
)
from kvstride.sizes import parse_size

# Attention and Mamba blocks of 512 tokens (one trace block each): S = H = alignment = 512.
TOY = {
    "name": "toy-hybrid",
    "groups": [
        {"kind": "full_attention", "block_size": 512, "layers": 1, "bytes_per_block": 10},
        {"kind": "mamba", "mamba_mode": "align", "block_size": 512, "layers": 1, "bytes_per_block": 30},
    ],
    "derivation": "test geometry",
}
TOY_SWA = {
    "name": "toy-swa",
    "groups": [
        {"kind": "full_attention", "block_size": 256, "layers": 1, "bytes_per_block": 10},
        {"kind": "sliding_window", "window": 300, "block_size": 256, "layers": 1, "bytes_per_block": 10},
    ],
}


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(TOY))
    return load_model(str(path))


@pytest.fixture
def toy384(tmp_path):
    """TOY with 384-token blocks: a hash block that does not divide the 512-token trace block."""
    path = tmp_path / "toy384.json"
    geometry = json.loads(json.dumps(TOY))
    for g in geometry["groups"]:
        g["block_size"] = 384
    path.write_text(json.dumps(geometry))
    return load_model(str(path))


def req(ids, n=None):
    return TraceRequest(n if n is not None else 512 * len(ids), list(ids))


def servable(rp, index, hashes, hit):
    """SEMANTICS §6, checked here with KeyPlanner.key only: every participating group holds
    what a hit of ``hit`` tokens needs."""
    h, planner = rp.h, rp.planner
    for g, spec in enumerate(rp.groups):
        if not planner.hashes_per_block[g]:
            continue
        b = spec.block_size
        if spec.kind == "mamba":
            need = [hit]
        elif spec.kind in ("sliding_window", "chunked_local"):
            lo = max(0, hit - spec.window + 1) if spec.kind == "sliding_window" else hit // spec.window * spec.window
            need = [min((blk + 1) * b, hit) for blk in range(lo // b, -(-hit // b))]
        else:
            need = list(range(b, hit + 1, b)) + ([hit] if hit % b else [])
        keys = [planner.key(g, hashes[e // h - 1]) for e in need]
        if not all(index.exists(keys)):
            return False
    return True


def run(model, trace, policy, capacity=1 << 40, **kw):
    rp = TraceReplay(model)
    hits = []

    def on_hit(rp_, index, hashes, hit):
        assert servable(rp_, index, hashes, hit), (policy, hit)
        hits.append(hit)

    result = rp.run(trace, ReplayConfig(model, capacity, policy, on_hit=on_hit, **kw))
    return result, hits


def test_tokens_are_a_function_of_the_id():
    assert np.array_equal(block_tokens(7), block_tokens(7))
    assert not np.array_equal(block_tokens(7), block_tokens(8))
    assert len(block_tokens(7)) == 512 and block_tokens(7).min() >= 1


def test_trie_hashes_equal_the_core_over_whole_prompts():
    """Hashing per trace block with cached prefixes gives the hashes of the whole token list,
    also when H (544) does not divide the 512-token trace block."""
    model = load_model("qwen3-next-80b")
    rp = TraceReplay(model)
    assert rp.h == 544
    hasher = _core.BlockHasher("sha256_cbor", seed="0")
    for ids, n in (([1, 2, 3, 4, 5], 2500), ([1, 2, 9, 4], 2048), ([1, 2, 3, 4, 5, 6, 7], 3584)):
        nodes = rp.trie.path(ids)
        tokens = np.concatenate([block_tokens(i) for i in ids])[:n]
        assert rp._hashes(nodes, n) == hasher.hash_blocks(tokens, 544)


def test_repeated_prompt_hits_one_alignment_below_its_end(toy):
    for policy in POLICIES:
        result, hits = run(toy, [req([1, 2, 3]), req([1, 2, 3])], policy)
        assert hits == [1024], policy  # T = 1536 would leave nothing to compute
        assert result["hit_tokens"] == 1024 and result["unservable_hits"] == 0


def test_next_turn_hits_the_previous_prompt_end(toy):
    trace = [req([1, 2, 3]), req([1, 2, 3, 4])]
    assert run(toy, trace, "dense")[1] == [1536]
    assert run(toy, trace, "kvstride")[1] == [1536]  # the connector's rule keeps the prompt's end
    assert run(toy, trace, "kvstride", checkpoints="hedge,junction")[1] == [1024]
    # vLLM 0.33 keeps the state at num_prompt_tokens - 1, floored to the alignment.
    assert run(toy, trace, "vllm-reachable")[1] == [1024]


def test_hedge_serves_a_next_turn_that_rewrites_the_prompt_tail(toy384):
    """384-token blocks: the prompt-end state (1536) and the resend boundary (1152) lie past the
    1024 tokens a next turn that rewrites the prompt's last trace block shares: the connector's
    rule misses it; the hedge (the last boundary 512 tokens before the end, 768) serves it."""
    trace = [req([1, 2, 3]), req([1, 2, 4, 5])]
    assert run(toy384, trace, "dense")[1] == [768]
    assert run(toy384, trace, "kvstride", checkpoints="end")[1] == []
    assert run(toy384, trace, "kvstride")[1] == []
    assert run(toy384, trace, "kvstride", checkpoints="hedge")[1] == [768]


def test_a_prompt_with_a_trace_tail_keeps_one_end_state(toy384):
    """384-token blocks, a 1100-token prompt: a later request can share its first 768 tokens
    (two 384-token blocks inside its two whole trace blocks). The connector, given a real
    prompt of that length, keeps one end state (SEMANTICS §8: the resend boundary equals the end
    unless the prompt fills its last block); the trace's grain must not add a second one at 384."""
    result, _hits = run(toy384, [req([1, 2, 3], n=1100)], "kvstride")
    assert result["resident_bytes_by_kind"] == {"full_attention": 20, "mamba": 30}


def test_every_rule_keeps_the_prompt_end_where_the_next_turn_can_use_it(toy384):
    """384-token blocks, a 1300-token prompt: vLLM 0.33's rule and the connector's both keep
    the state at the prompt's end, which a real next turn shares whole. A trace's next turn
    shares the two whole trace blocks (1024 tokens), so both rules' end state is taken at 768,
    where it can serve; the real end (1152) lies past what the trace's next turn shares."""
    trace = [req([1, 2, 3], n=1300), req([1, 2, 5, 6])]
    for policy in POLICIES:
        assert run(toy384, trace, policy)[1] == [768], policy


def test_shared_prefix_junction_is_kept_once_seen(toy):
    trace = [req([1, 2, 3, 4]), req([1, 2, 5, 6]), req([1, 2, 7, 8])]
    dense, hits = run(toy, trace, "dense")
    assert hits == [1024, 1024]
    ks, hits = run(toy, trace, "kvstride")
    assert hits == [1024]  # the second request reveals the junction, the third hits it
    assert run(toy, trace, "vllm-reachable")[1] == [1024]
    assert ks["bytes_written"] < dense["bytes_written"]


def test_periodic_checkpoints_serve_the_first_reuse_of_a_prefix(toy):
    trace = [req([1, 2, 3, 4, 5, 6]), req([1, 2, 3, 7, 8])]
    assert run(toy, trace, "dense")[1] == [1536]
    assert run(toy, trace, "kvstride", checkpoints="hedge,junction")[1] == []
    assert run(toy, trace, "kvstride", checkpoints="hedge,junction,every:1024")[1] == [1024]


def test_decode_states_let_the_next_turn_hit_past_the_previous_prompt(toy):
    """The next turn extends the prompt (1536 tokens) and its 600-token output. Without the
    decode's states it hits at most the prompt's end; with them (``decode_states``) at the
    output's last boundary (2048), for dense and kvstride; vLLM 0.33's rule keeps none."""
    first = TraceRequest(1536, [1, 2, 3], output_length=600)
    trace = [first, req([1, 2, 3, 4, 5])]
    assert run(toy, trace, "dense")[1] == [1536]
    assert run(toy, trace, "kvstride")[1] == [1536]
    for policy in ("dense", "kvstride", "kvstride-boundary-sets"):
        result, hits = run(toy, trace, policy, decode_states=True)
        assert hits == [2048] and result["decode_checkpoints"] == 1, policy
    assert run(toy, trace, "vllm-reachable", decode_states=True)[1] == run(toy, trace, "vllm-reachable")[1]
    # A shorter request sharing the prompt is not its next turn: nothing is written for it.
    sibling = [first, req([1, 2, 3, 9]), req([1, 2, 3, 4, 5])]
    result, hits = run(toy, sibling, "kvstride", decode_states=True)
    assert hits[-1] == 2048 and result["decode_checkpoints"] == 1


def test_capacity_pressure_dense_evicts_kvstride_keeps(toy):
    # dense writes 4 x 10 + 4 x 30 = 160 per 4-block prompt, kvstride 4 x 10 + 2 states (the
    # prompt's end and resend boundaries, 2048 and 1536) = 100.
    trace = [req([1, 2, 3, 4]), req([10, 11, 12, 13]), req([1, 2, 3, 4])]
    dense, dense_hits = run(toy, trace, "dense", capacity=250)
    ks, ks_hits = run(toy, trace, "kvstride", capacity=250)
    assert dense_hits == [] and dense["evictions"] > 0
    assert ks_hits == [1536]
    assert ks["resident_bytes"] <= 250 and dense["resident_bytes"] <= 250
    assert ks["resident_bytes_by_kind"] == {"full_attention": 80, "mamba": 120}


def test_kvstride_evicts_the_least_recent_request_from_its_deepest_boundary(toy):
    """A state at every block; the store holds two requests. A third evicts the first one's
    deepest block and state (the embedded store's order), so a repeat of the first still hits
    one boundary short; a per-value LRU evicts its head and the repeat hits nothing."""
    trace = [req([1, 2, 3]), req([7, 8]), req([9]), req([1, 2, 3])]
    ks, hits = run(toy, trace, "kvstride", capacity=200, checkpoints="every:512")
    assert hits == [1024] and ks["resident_bytes"] <= 200
    assert run(toy, trace, "kvstride-admission", capacity=200, checkpoints="every:512")[1] == []


def test_kvstride_keeps_the_prompt_whose_hit_saves_more_prefill_per_byte(toy):
    """A long prompt's boundary set saves more prefill per byte than a short one's (2048
    tokens for 70 bytes against 512 for 40), so when a newer request needs room the short
    prompt written after it goes first, and the long prompt's next turn hits all of it. By
    recency alone the long prompt's deepest state goes, and the turn hits one boundary short."""
    trace = [req([1, 2, 3, 4]), req([7]), req([9]), req([1, 2, 3, 4, 5])]
    valued, hits = run(toy, trace, "kvstride", capacity=150)
    assert hits == [2048] and valued["resident_bytes"] <= 150
    assert run(toy, trace, "kvstride", capacity=150, value_weight=0)[1] == [1536]


def test_replay_index_evicts_as_the_embedded_store_does():
    """The replay's kvstride index and the arena's SlotIndex run one order: fed the same
    ranked keys, touches and unit-sized values, they hold the same keys after every step."""
    slots, index = SlotIndex(6), PrefixIndex(6)
    steps = [
        ("save", "a", [("a16", 16), ("a32", 32), ("a48", 48)]),
        ("save", "b", [("b16", 16), ("b32", 32)]),
        ("load", "a", ["a16", "a32"]),  # a's prefix is loaded: b is now the least recent
        ("save", "c", [("c16", 16), ("c32", 32), ("c48", 48)]),
        ("save", "d", [("a16", 16), ("d32", 32)]),  # shares a's head: present, skipped
    ]
    seen = []
    for action, _request, items in steps:
        seen += [item if action == "load" else item[0] for item in items]
        stamp = slots.stamp()
        assert index.stamp() == stamp
        if action == "load":
            slots.unpin(slots.pin(items, stamp))
            index.touch(items, stamp)
        else:
            new = [(key, depth) for key, depth in items if not slots.known([key])[0]]
            ranks = {key: (stamp, depth) for key, depth in new}
            slots.confirm([k for k, s in zip(ranks, slots.reserve(list(ranks), ranks)) if s is not None])
            index.put_many([(key, 1, "full_attention", stamp, depth) for key, depth in items])
        assert slots.exists(seen) == index.exists(seen) and slots.evictions == index.evictions
    assert sorted(slots.keys()) == ["a16", "a32", "c16", "c32", "c48", "d32"]


def test_prefix_index():
    index = PrefixIndex(25)
    old, new = index.stamp(), index.stamp()
    index.put_many([("a", 10, "full_attention", old, 16), ("s", 10, "mamba", old, 32)])
    index.put_many([("b", 10, "full_attention", new, 16)])  # the old request's deepest value goes
    assert index.exists(["a", "s", "b"]) == [True, False, True] and index.evictions == 1
    index.touch(["a"], index.stamp())
    index.put_many([("c", 10, "mamba", index.stamp(), 16)])
    assert index.exists(["a", "b", "c"]) == [True, False, True]
    assert index.resident() == {"full_attention": 10, "mamba": 10}
    assert index.put_many([("d", 26, "mamba", index.stamp(), 16)]) == 0 and index.rejected == 1


def test_boundary_index_keeps_sets_coherent():
    index = BoundaryIndex(100)
    fa = [(f"fa{i}", 10, "full_attention") for i in range(4)]
    assert index.put_boundary(b"a", fa[:2] + [("sa", 30, "mamba")], 2.0) == 50
    assert index.put_boundary(b"b", fa + [("sb", 30, "mamba")], 4.0) == 50  # shares fa0, fa1
    assert index.used == 100
    # A third set evicts the lowest-priority set: its state goes, the attention blocks it
    # shares with "b" stay while "b" needs them.
    assert index.put_boundary(b"c", [("sc", 30, "mamba")], 1.0) == 30
    assert index.boundaries == 2 and index.used == 100 and not index.has_boundary(b"a")
    assert index.exists(["fa0", "fa1", "sa"]) == [True, True, False]
    for bid, keys in ((b"a", ["fa0", "fa1", "sa"]), (b"b", ["fa0", "fa1", "fa2", "fa3", "sb"])):
        assert index.has_boundary(bid) == all(index.exists(keys))
    assert index.put_boundary(b"big", [("huge", 500, "mamba")], 9.0) == 0 and index.rejected == 1


def test_lru_index():
    index = LRUIndex(25)
    assert index.put("a", 10, "full_attention") and index.put("b", 10, "mamba")
    index.touch(["a"])
    assert index.put("c", 10, "mamba")
    assert index.exists(["a", "b", "c"]) == [True, False, True]
    assert index.resident() == {"full_attention": 10, "mamba": 10}
    assert not index.put("d", 26, "mamba")


@pytest.mark.parametrize("policy", POLICIES + EXTRA_POLICIES)
@pytest.mark.parametrize("geometry", [TOY, TOY_SWA])
def test_every_reported_hit_is_servable_by_every_group(tmp_path, policy, geometry):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(geometry))
    model = load_model(str(path))
    rng = np.random.default_rng(3)
    trace = []
    for _ in range(150):
        base = [int(x) for x in rng.choice(6, size=rng.integers(0, 4))]  # shared prefixes
        ids = base + [int(x) for x in rng.integers(100, 130, size=rng.integers(1, 5))]
        trace.append(req(ids, 512 * len(ids) - int(rng.integers(0, 400))))
    result, hits = run(model, trace, policy, capacity=600)
    assert result["unservable_hits"] == 0
    assert hits, "the trace should produce hits"


def _toy_files(tmp_path, requests: int):
    """The toy model's JSON and a trace of ``requests`` requests sharing two of their three
    blocks (the third alternates), as the command reads them."""
    model = tmp_path / "toy.json"
    model.write_text(json.dumps(TOY))
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3 + i % 2]}
            for i in range(requests)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return model, trace


def test_cli_json_fields(tmp_path):
    model, trace = _toy_files(tmp_path, 6)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["simulate", "--trace", str(trace), "--model", str(model), "--capacity", "1K,1G",
                   "--policy", "all", "--json"])
    assert rc == 0
    document = json.loads(out.getvalue())  # one JSON document
    results = document["results"]
    assert document["trace"] == str(trace)
    assert [(r["policy"], r["capacity_bytes"]) for r in results] == [
        (p, c) for p in POLICIES for c in (1024, 1 << 30)
    ]
    for r in results:
        for field in ("policy", "model", "capacity_bytes", "requests", "prompt_tokens", "hit_tokens",
                      "token_hit_rate", "bytes_written", "bytes_written_per_request", "resident_bytes_by_kind"):
            assert field in r
        assert r["requests"] == 6 and r["prompt_tokens"] == 9000 and r["model"] == "toy-hybrid"
        assert r["unservable_hits"] == 0
    big = {r["policy"]: r for r in results if r["capacity_bytes"] == 1 << 30}
    assert big["dense"]["hit_tokens"] == 5 * 1024  # requests 2..6 hit the two shared blocks


def test_cli_replay_options_reach_the_replay(tmp_path):
    """--decode-states, --checkpoints, --retention-interval and --value-weight change what the
    replay keeps."""
    model = tmp_path / "toy.json"
    model.write_text(json.dumps(TOY))
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1536, "output_length": 600, "hash_ids": [1, 2, 3]},
            {"timestamp": 1, "input_length": 2560, "output_length": 5, "hash_ids": [1, 2, 3, 4, 5]},
            {"timestamp": 2, "input_length": 2560, "output_length": 5, "hash_ids": [1, 2, 6, 7, 8]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    def replay(*options, capacity="1G"):
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["simulate", "--trace", str(trace), "--model", str(model), "--capacity", capacity,
                         "--json", *options]) == 0
        (result,) = json.loads(out.getvalue())["results"]
        return result

    plain = replay()
    assert plain["hit_tokens"] == 1536 + 1024 and plain["decode_checkpoints"] == 0
    turns = replay("--decode-states")
    assert turns["hit_tokens"] == 2048 + 1024 and turns["decode_checkpoints"] == 1
    assert replay("--checkpoints", "hedge")["hit_tokens"] == 1024 + 1024  # the hedge at 1024, twice
    periodic = replay("--retention-interval", "512")  # a state at every block: more bytes, the same hits
    assert periodic["hit_tokens"] == plain["hit_tokens"] and periodic["bytes_written"] > plain["bytes_written"]
    # As test_kvstride_keeps_the_prompt_whose_hit_saves_more_prefill_per_byte: the long
    # prompt's next turn hits all of it when value counts, one boundary short by recency alone.
    crowded = [{"timestamp": t, "input_length": 512 * len(ids), "output_length": 0, "hash_ids": ids}
               for t, ids in enumerate([[1, 2, 3, 4], [7], [9], [1, 2, 3, 4, 5]])]
    trace.write_text("\n".join(json.dumps(r) for r in crowded) + "\n")
    assert replay(capacity="150")["hit_tokens"] == 2048
    assert replay("--value-weight", "0", capacity="150")["hit_tokens"] == 1536


def test_shipped_models_and_sizes():
    assert {"qwen3-next-80b", "gemma-3-27b", "gpt-oss-120b", "nemotron-h"} <= set(list_models())
    q = load_model("qwen3-next-80b")
    assert [g.kind for g in q.groups] == ["full_attention", "mamba"]
    assert q.bytes_per_block[0] == 12 * 544 * 2 * 2 * 256 * 2  # layers x block x K,V x heads x dim x bf16
    assert parse_size("256G") == 256 << 30 and parse_size("1T") == 1 << 40 and parse_size("1.5K") == 1536


def test_read_trace_rejects_other_formats(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 3}\n')
    with pytest.raises(ValueError, match="not a Mooncake trace line"):
        read_trace(str(bad))


def test_read_trace_reads_gzip():
    """The shipped production trace (benches/traces/README.md): read as it is, compressed, and
    the file its README's checks and checksum describe."""
    path = Path(__file__).parent.parent / "benches" / "traces" / "mooncake_conversation_trace.jsonl.gz"
    with gzip.open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    trace = read_trace(str(path))
    assert len(trace) == 12031 and sum(r.input_length for r in trace) == 144793823
    assert trace[0] == TraceRequest(6758, list(range(14)), 0.0, 500)


def test_cli_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    model = tmp_path / "toy.json"
    model.write_text(json.dumps(TOY))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"input_length": 1500, "hash_ids": [1, 2, 3]}) for _ in range(3)) + "\n")
    png = tmp_path / "hit.png"
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["simulate", "--trace", str(trace), "--model", str(model), "--capacity", "1K",
                   "--capacity", "1G", "--quiet", "--plot", str(png)])
    assert rc == 0
    text = out.getvalue()
    assert "kvstride" in text and "hit rate" in text and "hits every group could not serve: 0" in text
    assert png.stat().st_size > 1000


def test_conversation_trace_turns_extend_the_previous_prompt_and_output(tmp_path):
    """scripts/conversation_trace.py: each turn of a session keeps every whole block of the
    previous prompt and is at least the previous prompt and its output long; replayed with
    decode states, next turns hit past the previous prompts."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "conversation_trace.py"
    spec = importlib.util.spec_from_file_location("conversation_trace", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    session = module.conversation_trace(sessions=1, mean_turns=8.0, seed=1)
    assert len(session) > 2
    for prev, turn in zip(session, session[1:]):
        whole = prev["input_length"] // 512
        assert turn["hash_ids"][:whole] == prev["hash_ids"][:whole]
        assert set(turn["hash_ids"][whole:]).isdisjoint(prev["hash_ids"])
        assert turn["input_length"] >= prev["input_length"] + prev["output_length"]
        assert turn["timestamp"] > prev["timestamp"]
    requests = module.conversation_trace(sessions=40, seed=3)
    assert requests == sorted(requests, key=lambda r: r["timestamp"])
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in requests)
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    model = load_model("qwen3-next-80b")
    rp = TraceReplay(model)
    trace = read_trace(str(path))
    plain = rp.run(trace, ReplayConfig(model, 1 << 44, "kvstride"))
    turns = rp.run(trace, ReplayConfig(model, 1 << 44, "kvstride", decode_states=True))
    assert turns["decode_checkpoints"] > 0 and turns["hit_tokens"] > plain["hit_tokens"]


def test_loss_split_classes_what_kvstride_misses_against_dense(toy):
    """scripts/trace_loss_split.py, on the replay's per-request hits (``on_request``): the
    first reuse of a junction inside an earlier prompt is lost to dense, and so is a next turn
    that rewrites the previous prompt's last whole block (no hedge state)."""
    import importlib.util

    script = Path(__file__).parent.parent / "scripts" / "trace_loss_split.py"
    spec = importlib.util.spec_from_file_location("trace_loss_split", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The second request meets the first at 1024 (no state there yet); the third shares all
    # but the last whole block of the second (2100 tokens: its end state is at 2048 only).
    trace = [req([1, 2, 3, 4]), req([1, 2, 5, 6, 9], n=2100), req([1, 2, 5, 7]), req([1, 2, 5, 6, 8])]
    replay = TraceReplay(toy)
    assert module.hits_per_request(replay, trace, "dense", 1 << 40) == [0, 1024, 1536, 2048]
    assert module.hits_per_request(replay, trace, "kvstride", 1 << 40) == [0, 0, 1024, 2048]
    assert module.classify(trace) == [
        "nothing shared", "inside an earlier prompt", "all but the last whole block", "inside an earlier prompt"
    ]


def test_cli_replays_at_the_default_capacities_and_a_disk_given_as_text(tmp_path):
    """Without ``--capacity`` the replay runs at its default sizes (given as text), and
    ``run_trace`` reads sizes as the command does."""
    from kvstride.simulate import DEFAULT_TRACE_CAPACITIES, run_trace

    model, trace = _toy_files(tmp_path, 4)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["simulate", "--trace", str(trace), "--model", str(model), "--json", "--quiet"]) == 0
    results = json.loads(out.getvalue())["results"]
    assert [r["capacity_bytes"] for r in results] == [parse_size(c) for c in DEFAULT_TRACE_CAPACITIES]
    tiered = run_trace(str(trace), model=str(model), capacities=["1G"], policies=["kvstride"], disk_bytes="4GiB",
                       disk_policies=["spill"])
    assert [r["disk_bytes"] for r in tiered] == [0, 4 << 30]


def test_a_quiet_replay_says_each_cell_as_it_ends(tmp_path, capsys):
    """``--quiet`` draws no progress bar, but a long replay is not silent: one line on stderr as
    each policy and capacity ends, then the table."""
    model, trace = _toy_files(tmp_path, 4)
    assert main(["simulate", "--trace", str(trace), "--model", str(model), "--capacity", "1K,1G", "--quiet"]) == 0
    out, err = capsys.readouterr()
    said = err.strip().splitlines()
    assert len(said) == 2 and all("kvstride at " in line and "of prompt tokens hit" in line for line in said), err
    assert "hit rate" in out
