"""The identity of stored KV at the connector's configuration: every setting that changes a
block's bytes changes the keys the scheduler plans, the weights by the checkpoint's content;
weak block hashes are refused on a shared store; the secret is never printed.

No engine boots: vLLM's real KV-cache specs and config, with the model, cache and load settings
that are compared given as plain attributes (the end-to-end case, a checkpoint replaced under
its path between two engines on ``kvstride store serve``, is in ``test_vllm_serve.py``)."""

from __future__ import annotations

import shutil
import types

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

import vllm_harness as harness  # noqa: E402
from kvstride import identity  # noqa: E402
from kvstride.secret import generate_secret_file, load_secret  # noqa: E402
from kvstride.vllm import checks  # noqa: E402
from kvstride.vllm.config import group_specs, resolve_config  # noqa: E402
from kvstride.vllm.store_registry import arena_slot_bytes  # noqa: E402
from test_vllm_checks import warnings_seen  # noqa: E402,F401  (the fixture: kvstride's warnings)

HASHES = [bytes([i]) * 32 for i in range(4)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return harness.llama(tmp_path_factory.mktemp("identity") / "llama")


def vllm_config(path, extra=None, *, tp=1, algo="sha256_cbor", load_format="safetensors", cache=None,
                policy="recompute", scheduler=None, **model):
    """vLLM's config as the connector reads it (``cache``: more cache settings; ``scheduler``:
    the scheduler's)."""
    model = dict(dict(model=str(path), revision=None, quantization=None, hf_overrides={}, dtype=torch.bfloat16), **model)
    model_config = types.SimpleNamespace(**model, get_total_num_kv_heads=lambda: 2)
    return types.SimpleNamespace(
        model_config=model_config,
        cache_config=types.SimpleNamespace(**dict(
            dict(cache_dtype=model.get("cache_dtype", "auto"), calculate_kv_scales=False, prefix_caching_hash_algo=algo,
                 mamba_cache_mode="none", prefix_cache_retention_interval=0),
            **(cache or {}))),
        load_config=types.SimpleNamespace(load_format=load_format, download_dir=None),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, world_size=tp, rank=0),
        scheduler_config=types.SimpleNamespace(**dict(dict(max_num_seqs=4, max_num_batched_tokens=64), **(scheduler or {}))),
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=dict(extra or {"store": "mooncake"}),
                                                 kv_load_failure_policy=policy),
    )


def kv_cache_config(spec=None, layers=("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")):
    spec = spec or FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)])


def keys(config, worker=False, kv=None):
    """The keys the scheduler (or a worker) would plan for four blocks of one request."""
    resolved = resolve_config(config, kv or kv_cache_config(), worker=worker)
    return resolved.planner.lookup_keys(HASHES, 4 * 32 + 1)


def test_keys_change_with_everything_that_changes_the_kv_bytes(llama_dir, tmp_path):
    """Revision, quantization, hf_overrides (rope scaling changes K), model and KV dtypes, the
    operator's model_identity and the weights under the same path: each its own keys; the same
    settings and bytes, the same keys."""
    base = keys(vllm_config(llama_dir))
    assert keys(vllm_config(llama_dir)) == base
    variants = {
        "revision": keys(vllm_config(llama_dir, revision="v2")),
        "quantization": keys(vllm_config(llama_dir, quantization="fp8")),
        "hf_overrides": keys(vllm_config(llama_dir, hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})),
        "dtype": keys(vllm_config(llama_dir, dtype=torch.float16)),
        "kv dtype": keys(vllm_config(llama_dir, cache_dtype="fp8")),
        "model_identity": keys(vllm_config(llama_dir, {"store": "mooncake", "model_identity": "release-7"})),
    }
    tuned = shutil.copytree(llama_dir, tmp_path / "llama")
    before = keys(vllm_config(tuned))
    harness.llama_finetuned(tuned)  # new weights, the same config, at the same path
    variants["weights"] = keys(vllm_config(tuned))
    assert variants["weights"] != before
    for name, got in variants.items():
        assert got != base, name
        assert len(set(got) & set(base)) == 0, name


def test_keys_change_with_the_vllm_version_the_model_code_and_every_byte_cache_flag(llama_dir, tmp_path, monkeypatch):
    """The vLLM release (kernels and layouts change between them), the model code a
    ``trust_remote_code`` checkpoint runs (its ``*.py`` files, at any depth), and each cache
    setting that changes a block's bytes: each its own keys."""
    import vllm

    from kvstride.vllm.config import BYTE_CACHE_FLAGS

    base = keys(vllm_config(llama_dir))
    variants = {}
    monkeypatch.setattr(vllm, "__version__", vllm.__version__ + ".post9")
    variants["vllm version"] = keys(vllm_config(llama_dir))
    monkeypatch.undo()
    assert keys(vllm_config(llama_dir)) == base
    coded = shutil.copytree(llama_dir, tmp_path / "remote")
    (coded / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    (coded / "layers").mkdir()
    (coded / "layers" / "attention.py").write_text("ROPE = 'default'\n")
    first = keys(vllm_config(coded, trust_remote_code=True))
    assert first == keys(vllm_config(coded, trust_remote_code=True)) != keys(vllm_config(coded))
    (coded / "modeling_tiny.py").write_text("SCALE = 2.0\n")
    variants["model code"] = keys(vllm_config(coded, trust_remote_code=True))
    (coded / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    (coded / "layers" / "attention.py").write_text("ROPE = 'yarn'\n")
    variants["nested model code"] = keys(vllm_config(coded, trust_remote_code=True))
    assert variants["model code"] != first and variants["nested model code"] != first
    changed = {
        "cache_dtype": "fp8", "calculate_kv_scales": True, "kv_cache_dtype_skip_layers": ["0"],
        "mamba_cache_dtype": "float32", "mamba_ssm_cache_dtype": "float32", "mamba_cache_mode": "align",
        "mamba_block_size": 64, "use_replayssm": True, "replayssm_buffer_len": 32, "swa_bounded_replay": False,
        "kv_sharing_fast_prefill": True,
    }
    assert set(changed) == set(BYTE_CACHE_FLAGS)
    for flag, value in changed.items():
        variants[flag] = keys(vllm_config(llama_dir, cache={flag: value}))
    for name, got in variants.items():
        assert len(set(got) & set(base)) == 0, name


def test_settings_that_change_no_byte_keep_the_keys(llama_dir):
    """Scheduling, memory, ports and logging settings leave every key as it is."""
    base = keys(vllm_config(llama_dir))
    assert keys(vllm_config(llama_dir, scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 8192})) == base
    assert keys(vllm_config(llama_dir, cache={"gpu_memory_utilization": 0.5, "enable_prefix_caching": True,
                                              "enable_mamba_shared_prefix_checkpoint": True})) == base
    config = vllm_config(llama_dir)
    config.parallel_config.data_parallel_master_port = 29555
    config.observability_config = types.SimpleNamespace(log_level="debug", otlp_traces_endpoint="http://127.0.0.1:4317")
    assert keys(config) == base


def _rope_override(config):
    config.rope_theta = 20000.0
    return config


def test_a_callable_hf_overrides_is_refused_on_a_shared_store_unless_model_identity_names_it(llama_dir):
    """A callable's effect cannot be read (and its repr changed in every process: no hit
    ever): refused on a shared store with a ValueError naming ``model_identity``; with it, the
    same keys in every process. The arena alone lives with its engine: accepted."""
    with pytest.raises(ValueError, match="model_identity"):
        keys(vllm_config(llama_dir, hf_overrides=_rope_override))
    named = {"store": "mooncake", "model_identity": "rope-20k"}
    got = keys(vllm_config(llama_dir, named, hf_overrides=_rope_override))
    assert got == keys(vllm_config(llama_dir, named, hf_overrides=_rope_override))
    assert identity.plain(_rope_override) == "callable:test_vllm_identity._rope_override"
    keys(vllm_config(llama_dir, {"store": "embedded"}, hf_overrides=_rope_override))


def test_plain_is_the_same_in_every_process():
    """Sets by their sorted members, functions by their qualified name (their repr holds an
    address, a set's order follows the process's hash seed)."""
    assert identity.plain({"b", "a", "c"}) == ["a", "b", "c"]
    assert identity.plain({"layers": frozenset({2, 1})}) == {"layers": [1, 2]}
    assert "0x" not in identity.plain(test_plain_is_the_same_in_every_process)


@pytest.mark.parametrize("store", ["embedded", "mooncake"])
def test_a_failing_load_policy_is_refused_naming_recompute(llama_dir, store):
    """vLLM's default ``kv_load_failure_policy`` ("fail") turns every routine failed load (a
    deadline, a value evicted since the lookup) into a failed request: refused at construction,
    naming the fix, unless ``allow_failing_loads`` says the operator wants it."""
    with pytest.raises(ValueError, match='"recompute"') as refused:
        keys(vllm_config(llama_dir, {"store": store}, policy="fail"))
    assert "allow_failing_loads" in str(refused.value)
    keys(vllm_config(llama_dir, {"store": store, "allow_failing_loads": True}, policy="fail"))
    keys(vllm_config(llama_dir, {"store": store}, policy="recompute"))
    with pytest.raises(ValueError, match="allow_failing_loads"):
        keys(vllm_config(llama_dir, {"store": store, "allow_failing_loads": "yes"}, policy="fail"))


def test_model_identity_replaces_the_weights_digest(llama_dir, tmp_path, monkeypatch):
    """With ``model_identity`` the checkpoint is not read, and engines with the same tag share
    keys whatever their weights; a bad tag is a ValueError naming it."""
    tuned = harness.llama_finetuned(tmp_path / "tuned")
    extra = {"store": "mooncake", "model_id": "prod", "model_identity": "release-7"}
    monkeypatch.setattr(identity, "checkpoint_digest", None)  # any read would fail
    assert keys(vllm_config(llama_dir, extra)) == keys(vllm_config(tuned, extra))
    for bad in ("", "  ", 7):
        with pytest.raises(ValueError, match="model_identity"):
            keys(vllm_config(llama_dir, dict(extra, model_identity=bad)))


def test_the_weights_are_read_by_the_scheduler_only(llama_dir, monkeypatch):
    """Once per engine: the scheduler plans every rank's keys; the workers (one per rank) never
    read the checkpoint."""
    reads = []
    real = identity.checkpoint_digest
    monkeypatch.setattr("kvstride.vllm.config.checkpoint_digest", lambda *a, **k: reads.append(a) or real(*a, **k))
    for worker in (True, True):
        resolve_config(vllm_config(llama_dir, tp=2), kv_cache_config(), worker=worker)
    assert reads == []
    resolve_config(vllm_config(llama_dir, tp=2), kv_cache_config(), worker=False)
    assert len(reads) == 1


def test_a_checkpoint_not_on_this_host_is_named_in_one_warning(warnings_seen, monkeypatch):
    monkeypatch.setattr(checks, "_warned_keys", set())
    config = vllm_config("no-such-org/no-such-model")
    for _ in range(2):
        keys(config)
    assert len([m for m in warnings_seen if "model_identity" in m and "no-such-model" in m]) == 1


def test_configuration_warnings_come_once_per_engine_from_its_scheduler(llama_dir, fresh_warnings, warnings_seen):
    """An engine's scheduler says each warning once; its workers (a process each under ``mp``)
    say none; a second engine in the same process says it again."""
    extra = {"store": "mooncake", "allow_weak_hash": True}
    first, second = (vllm_config(llama_dir, extra, tp=2, algo="xxhash_cbor") for _ in range(2))
    for worker in (True, True):
        resolve_config(first, kv_cache_config(), worker=worker)
    assert warnings_seen == []
    for config in (first, first, second):
        resolve_config(config, kv_cache_config(), worker=False)
    assert len([m for m in warnings_seen if "allow_weak_hash" in m]) == 2, warnings_seen


def test_dummy_weights_are_identified_by_their_config(llama_dir, tmp_path):
    empty = tmp_path / "config-only"
    empty.mkdir()
    shutil.copy(llama_dir + "/config.json", empty / "config.json")
    a = keys(vllm_config(empty, load_format="dummy"))
    assert a == keys(vllm_config(empty, load_format="dummy")) != keys(vllm_config(llama_dir))


# ---- weak hashes ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(checks, "_warned_keys", set())
    monkeypatch.setenv("PYTHONHASHSEED", "0")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_weak_hash_refused_on_a_shared_store(llama_dir, fresh_warnings, warnings_seen, algo):
    with pytest.raises(ValueError, match="sha256_cbor.*allow_weak_hash"):
        keys(vllm_config(llama_dir, algo=algo))
    engine = vllm_config(llama_dir, {"store": "mooncake", "allow_weak_hash": True}, algo=algo)
    for _ in range(2):
        keys(engine)
    assert len([m for m in warnings_seen if "allow_weak_hash" in m]) == 1
    keys(vllm_config(llama_dir, {"store": "embedded"}, algo=algo))  # one engine's own memory: no neighbour
    with pytest.raises(ValueError, match="allow_weak_hash"):
        keys(vllm_config(llama_dir, {"store": "mooncake", "allow_weak_hash": "yes"}, algo=algo))


# ---- the secret ---------------------------------------------------------------------------------------


def test_the_config_never_prints_the_secret(llama_dir, tmp_path):
    path = tmp_path / "deploy.key"
    generate_secret_file(path)
    secret = load_secret(path)
    extra = {"store": "mooncake", "secret_file": str(path)}
    for worker in (False, True):
        config = resolve_config(vllm_config(llama_dir, extra), kv_cache_config(), worker=worker)
        assert config.secret == secret
        text = (repr(config) + str(config)).encode()
        for form in harness.secret_forms(secret):
            assert form not in text


# ---- UniformTypeKVCacheSpecs -------------------------------------------------------------------------------


def test_uniform_type_specs_stand_for_their_layers(llama_dir):
    """Layers of one attention type whose pages differ (other head counts) are one vLLM group
    with a UniformTypeKVCacheSpecs: kvstride takes their type, block size and fewest heads."""
    layers = ["a", "b"]
    small = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.bfloat16, sliding_window=64)
    large = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=torch.bfloat16, sliding_window=64)
    uniform = UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={"a": small, "b": large})
    config = kv_cache_config(uniform, layers)
    (spec,) = group_specs(config, vllm_config(llama_dir))
    assert (spec.kind, spec.block_size, spec.window) == ("sliding_window", 32, 64)
    assert arena_slot_bytes(config) == small.page_size_bytes + large.page_size_bytes
    assert len(keys(vllm_config(llama_dir), kv=config)) == 4
    # At TP=4 layer "a" holds one head per rank and "b" four: whether "a"'s heads are split or
    # replicated, the model config (2 heads, which "b" does not hold) cannot tell.
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        group_specs(config, vllm_config(llama_dir, tp=4), shared=True)


def _heads_config(llama_dir, tp: int, total: int, extra=None):
    config = vllm_config(llama_dir, extra, tp=tp)
    config.model_config.get_total_num_kv_heads = lambda: total
    return config


def test_head_counts_come_from_the_model_config_and_each_groups_spec(llama_dir):
    """One KV head per rank is ``tp`` heads split, or fewer replicated: the model config tells,
    when every layer holds the share its count gives. A group of one head per rank next to a
    group of more (a model whose layers' head counts differ) cannot be told apart: before, it
    was keyed with the model config's count, replicated over ranks that may hold different
    heads; now it is refused on a shared store (the arena keys as one rank and needs no count)."""
    def spec(per_rank, window=None):
        if window:
            return SlidingWindowSpec(block_size=32, num_kv_heads=per_rank, head_size=32, dtype=torch.bfloat16,
                                     sliding_window=window)
        return FullAttentionSpec(block_size=32, num_kv_heads=per_rank, head_size=32, dtype=torch.bfloat16)

    def two_groups(full, window):
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec(full)),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], spec(window, 64)),
        ])

    # The model's 2 heads: one per rank at TP=2 (split), two ranks each at TP=4 (replicated).
    assert [g.num_kv_heads for g in group_specs(two_groups(1, 1), _heads_config(llama_dir, 2, 2), shared=True)] == [2, 2]
    assert [g.num_kv_heads for g in group_specs(two_groups(1, 1), _heads_config(llama_dir, 4, 2), shared=True)] == [2, 2]
    # More than one head per rank is split, whatever the model config says.
    assert [g.num_kv_heads for g in group_specs(two_groups(4, 4), _heads_config(llama_dir, 2, 2), shared=True)] == [8, 8]
    # The model config says 2 heads; the window layers hold 4 per rank at TP=4 (16 heads): the
    # full-attention group's one head per rank may be 1, 2 or 4 heads.
    mixed = two_groups(1, 4)
    with pytest.raises(ValueError, match="group 0 holds one KV head per rank at tensor_parallel_size=4"):
        group_specs(mixed, _heads_config(llama_dir, 4, 2), shared=True)
    with pytest.raises(ValueError, match="store 'embedded'"):
        resolve_config(_heads_config(llama_dir, 4, 2), mixed, worker=False)
    assert [g.num_kv_heads for g in group_specs(mixed, _heads_config(llama_dir, 4, 2))] == [None, 16]
    resolve_config(_heads_config(llama_dir, 4, 2, {"store": "embedded"}), mixed, worker=False)


def test_the_embedded_store_reads_no_checkpoint(llama_dir, monkeypatch):
    """The arena lives and dies with its engine: no other weights can meet its values."""
    monkeypatch.setattr("kvstride.vllm.config.checkpoint_digest", None)  # any read would fail
    assert resolve_config(vllm_config(llama_dir, {"store": "embedded"}), kv_cache_config(), worker=False).model_identity is None


def test_an_unknown_key_is_refused_naming_the_nearest(llama_dir):
    """A misspelled secret_file would run a shared store unauthenticated; a key of a feature
    this connector lacks would do nothing: both are refused at construction."""
    with pytest.raises(ValueError, match="unknown key 'secret_flie': did you mean 'secret_file'"):
        keys(vllm_config(llama_dir, {"store": "mooncake", "secret_flie": "/etc/kvstride/deploy.key"}))
    with pytest.raises(ValueError, match="unknown key 'no_such_option'"):
        keys(vllm_config(llama_dir, {"store": "embedded", "no_such_option": 1}))


def test_the_arena_is_sized_for_the_groups_it_stores(llama_dir):
    """A scratch ring (never stored) takes no room in the embedded store's slots: the scheduler
    counts slots, and each worker sizes them, by the keyed groups' blocks alone."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    ring = CircularBufferSpec(block_size=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["r"], ring)])
    assert ring.page_size_bytes > full.page_size_bytes
    resolved = resolve_config(vllm_config(llama_dir, {"store": "embedded", "store_bytes": 1 << 20}), config, worker=True)
    assert resolved.store.stored_groups == (0,)
    assert resolved.store.num_slots == (1 << 20) // full.page_size_bytes


def test_the_disk_tier_is_checked_at_construction(llama_dir, tmp_path):
    """Every bad disk setting is a ValueError naming it, before any engine work."""
    folder = str(tmp_path)
    for extra, match in [
        ({"disk_path": folder}, "has 'disk_path' but not 'disk_bytes'"),
        ({"disk_bytes": "1GiB"}, "has 'disk_bytes' but not 'disk_path'"),
        ({"disk_path": str(tmp_path / "missing"), "disk_bytes": "1GiB"}, "is not a folder"),
        ({"disk_path": folder, "disk_bytes": "1000TiB"}, r"disk_bytes=1000 TiB does not fit .*: [0-9.]+ [KMGT]iB free"),
        ({"disk_path": folder, "disk_bytes": "12"}, r"disk_bytes=12 B holds no record of [0-9.]+ KiB"),
        ({"disk_path": folder, "disk_bytes": "lots"}, "disk_bytes 'lots' is not a size"),
        ({"store": "mooncake", "disk_path": folder, "disk_bytes": "1GiB"}, "embedded store's disk tier"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_config(vllm_config(llama_dir, dict({"store": "embedded"}, **extra)), kv_cache_config(), worker=False)
    config = resolve_config(vllm_config(llama_dir, {"store": "embedded", "disk_path": folder, "disk_bytes": "1GiB"}),
                            kv_cache_config(), worker=False)
    assert config.store.disk.num_records > 0 and config.model_identity is not None  # the weights are in the keys


@pytest.mark.parametrize("extra, policy", [
    ({"store": "embedded", "secret_flie": "x"}, "recompute"),
    ({"store": "embedded"}, "fail"),
    ({"store": "redis"}, "recompute"),
    ({"store": "mooncake", "disk_path": "/tmp", "disk_bytes": "1G"}, "recompute"),
    ({"store": "embedded", "disk_bytes": "1G"}, "recompute"),
    ({"store": "embedded", "store_bytes": "lots"}, "recompute"),
    ({"store": "embedded", "save_wait_s": "soon"}, "recompute"),
    ({"store": "embedded", "admission": "lru"}, "recompute"),
    ({"store": "embedded", "allow_failing_loads": "no"}, "fail"),
    ({"store": "embedded", "secret_file": "/nope/kvstride/deploy.key"}, "recompute"),
])
def test_check_config_raises_what_the_connector_raises(llama_dir, extra, policy):
    """``kvstride check-config`` and the connector building itself in vLLM refuse a
    configuration with the same words."""
    from kvstride.connector_checks import check_transfer_config

    transfer = {"kv_connector": "KVStrideConnector", "kv_connector_module_path": "kvstride.vllm",
                "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}
    with pytest.raises(ValueError) as offline:
        check_transfer_config(transfer)
    with pytest.raises(ValueError) as in_vllm:
        resolve_config(vllm_config(llama_dir, extra, policy=policy), kv_cache_config(), worker=False)
    assert str(offline.value) == str(in_vllm.value)


@pytest.mark.parametrize("extra", [
    {"store": "embedded", "secret_flie": "x"},
    {"store": "redis"},
    {"store": "embedded", "disk_path": "/nope/kvstride", "disk_bytes": "1G"},
    {"store": "embedded", "store_bytes": "lots"},
    {"store": "embedded", "secret_file": "/nope/kvstride/deploy.key"},
])
def test_the_connector_class_refuses_a_mistake_before_any_worker_starts(llama_dir, extra):
    """vLLM asks the connector's class ``requires_piecewise_for_cudagraph(extra_config)`` while
    it builds its configuration (with CUDA graphs of whole steps, its CUDA default), before a
    worker starts or a model loads: kvstride answers with the connector's own error there."""
    import inspect

    from vllm.config import vllm as vllm_config_module

    from kvstride.vllm import KVStrideConnector

    assert "requires_piecewise_for_cudagraph(\n                    self.kv_transfer_config.kv_connector_extra_config" in (
        inspect.getsource(vllm_config_module)), "vLLM no longer asks the connector's class while it builds its config"
    with pytest.raises(ValueError) as early:
        KVStrideConnector.requires_piecewise_for_cudagraph(extra)
    with pytest.raises(ValueError) as in_vllm:
        resolve_config(vllm_config(llama_dir, extra), kv_cache_config(), worker=False)
    assert str(early.value) == str(in_vllm.value)
    assert KVStrideConnector.requires_piecewise_for_cudagraph({"store": "embedded"}) is False
