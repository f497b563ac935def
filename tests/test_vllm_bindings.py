"""A value reaches only a request that would compute the same bytes: on a store that outlives
the engine, a request's keys are bound to its LoRA adapter's content and its multimodal items'
content, not only to the names vLLM hashes (``kvstride.vllm.bindings``).

Engine A's scheduler plans a request's saves, and what it placed is what the store holds; engine
B's scheduler (a new one on the same configuration) then asks the store about a request with the
same block hashes. Requests are vLLM's own (``vllm.v1.request.Request`` with vLLM's block
hasher, ``LoRARequest``, ``MultiModalFeatureSpec``), so their hashes carry what vLLM binds: the
adapter's name and path, the item's identifier. The end-to-end case, adapters served by real
engines through ``kvstride store serve`` and the disk tier, is in ``test_vllm_serve.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import vllm_harness as harness  # noqa: E402
from kvstride.stores.placement import StorePlacement  # noqa: E402
from kvstride.vllm.config import resolve_config  # noqa: E402
from kvstride.vllm.scheduler import SchedulerSide  # noqa: E402
from test_vllm_checks import warnings_seen  # noqa: E402,F401  (the fixture: kvstride's warnings)
from test_vllm_identity import kv_cache_config, vllm_config  # noqa: E402
from test_vllm_scheduler import CountingStore, _prefill_step  # noqa: E402

BLOCK = 32  # kv_cache_config's block: vLLM hashes 32-token blocks
TOKENS = 4 * BLOCK + 1
TABLES = [[1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return harness.llama(tmp_path_factory.mktemp("bindings") / "llama")


@pytest.fixture(scope="module")
def block_hasher():
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def _request(block_hasher, rid: str, *, lora=None, mm=None) -> Request:
    tokens = [(7 * i + 3) % 500 + 3 for i in range(TOKENS)]
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, mm_features=mm, lora_request=lora,
                   block_hasher=block_hasher)


class Engines:
    """Schedulers of one configuration over one store: ``save`` is engine A storing a request's
    blocks, ``hit`` a new engine's lookup of a request."""

    def __init__(self, llama_dir, extra: dict) -> None:
        self.config = vllm_config(llama_dir, extra)
        self.store = CountingStore()
        self.sides = []

    def side(self) -> SchedulerSide:
        side = SchedulerSide(resolve_config(self.config, kv_cache_config(), worker=False), StorePlacement(self.store))
        self.sides.append(side)
        return side

    def save(self, request) -> int:
        """Engine A computes ``request`` and stores what its scheduler plans; the keys stored."""
        side = self.side()
        side.on_new_request(request)
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = side.build_connector_meta(_prefill_step(request, TOKENS, TABLES))
        keys = {key for by_rank in meta.saves.values() for entries in by_rank.values() for key, _, _ in entries}
        self.store.present |= keys
        return len(keys)

    def hit(self, request) -> int:
        side = self.side()
        side.on_new_request(request)
        return side.get_num_new_matched_tokens(request, 0)[0]

    def close(self) -> None:
        for side in self.sides:
            side.shutdown()
        self.store.close()


@pytest.fixture
def engines(llama_dir):
    made = []

    def make(extra):
        made.append(Engines(llama_dir, extra))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _write_adapter(folder, version: int) -> str:
    """A PEFT-style adapter folder: its config and its weights (``version`` decides the bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    generator = torch.Generator().manual_seed(version)
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 64, generator=generator)},
              str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("store", [{"store": "mooncake"}, "disk"])
def test_a_lora_adapter_redeployed_at_its_path_is_a_clean_miss(engines, block_hasher, tmp_path, store):
    """Adapter v1 at /adapters/sql is served and stored; v2 is trained and written over it at the
    same name and path (vLLM's block hashes are the same: name and path): a new engine's v2
    requests miss, reloaded in place too. The control: v1's bytes deployed again under a new id
    still hit; the base model's requests never meet the adapter's values."""
    if store == "disk":  # the keys its index holds (planned alike whatever holds the values)
        (tmp_path / "disk").mkdir()
        store = {"store": "embedded", "disk_path": str(tmp_path / "disk"), "disk_bytes": 64 << 20}
    e = engines(store)
    path = _write_adapter(tmp_path / "adapters" / "sql", 1)
    assert e.save(_request(block_hasher, "a", lora=LoRARequest("sql", 1, path))) == 4
    assert e.hit(_request(block_hasher, "v1-again", lora=LoRARequest("sql", 1, path))) == 4 * BLOCK
    _write_adapter(tmp_path / "adapters" / "sql", 2)
    assert e.hit(_request(block_hasher, "v2", lora=LoRARequest("sql", 2, path))) == 0
    assert e.hit(_request(block_hasher, "v2-in-place", lora=LoRARequest("sql", 1, path, load_inplace=True))) == 0
    assert e.hit(_request(block_hasher, "base")) == 0
    _write_adapter(tmp_path / "adapters" / "sql", 1)
    assert e.hit(_request(block_hasher, "v1-redeployed", lora=LoRARequest("sql", 3, path))) == 4 * BLOCK


def test_both_adapter_versions_coexist_in_the_store(engines, block_hasher, tmp_path):
    """v1 and v2 stored under the same name and path keep their own values: each version's
    requests hit their own."""
    e = engines({"store": "mooncake"})
    folder = tmp_path / "adapters" / "sql"
    path = _write_adapter(folder, 1)
    e.save(_request(block_hasher, "a1", lora=LoRARequest("sql", 1, path)))
    one = set(e.store.present)
    _write_adapter(folder, 2)
    e.save(_request(block_hasher, "a2", lora=LoRARequest("sql", 2, path)))
    assert len(e.store.present) == 2 * len(one)
    assert e.hit(_request(block_hasher, "b2", lora=LoRARequest("sql", 4, path))) == 4 * BLOCK
    _write_adapter(folder, 1)
    assert e.hit(_request(block_hasher, "b1", lora=LoRARequest("sql", 5, path))) == 4 * BLOCK


def test_an_adapter_not_on_this_host_is_neither_looked_up_nor_saved(engines, block_hasher, tmp_path, warnings_seen):
    """Its content cannot be read, so its keys cannot cover it: the request computes, counted."""
    e = engines({"store": "mooncake"})
    missing = LoRARequest("gone", 1, str(tmp_path / "nowhere"))
    side = e.side()
    request = _request(block_hasher, "gone", lora=missing)
    side.on_new_request(request)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = side.build_connector_meta(_prefill_step(request, TOKENS, TABLES))
    assert meta.saves == {} and e.store.exists_calls == 0
    assert side.counters["requests_unbound"] == 1
    assert any("LoRA adapter 'gone'" in m for m in warnings_seen), warnings_seen


def test_the_arena_alone_reads_no_adapter(engines, block_hasher, tmp_path, monkeypatch):
    """The embedded store without a disk tier lives and dies with its engine: no adapter is read."""
    from kvstride.vllm import bindings

    monkeypatch.setattr(bindings, "checkpoint_digest", lambda *a, **k: pytest.fail("an adapter was digested"))
    e = engines({"store": "embedded"})
    path = _write_adapter(tmp_path / "sql", 1)
    side = e.side()
    request = _request(block_hasher, "r", lora=LoRARequest("sql", 1, path))
    side.on_new_request(request)
    assert side.bindings.of(request) == side.rank_planners


# ---- multimodal items -------------------------------------------------------------------------


def _image(seed: int, uuid: str) -> MultiModalFeatureSpec:
    """An image item as vLLM's processor hands it over: its pixels (``seed``) and identifier
    (``uuid``: the client's, or vLLM's content hash where the client gave none)."""
    pixels = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    data = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalSharedField(batch_size=1))})
    return MultiModalFeatureSpec(data=data, modality="image", identifier=uuid, mm_position=PlaceholderRange(offset=8, length=16),
                                 mm_hash=uuid)


def test_a_client_uuid_reaches_only_requests_with_the_same_image(engines, block_hasher):
    """One tenant sends image X under ``multi_modal_uuids`` "cat-1"; another tenant's request
    with image Y under the same uuid has the same block hashes and must miss. The same image
    under that uuid (or under vLLM's own content hash) still hits."""
    e = engines({"store": "mooncake"})
    assert e.save(_request(block_hasher, "x", mm=[_image(1, "cat-1")])) == 4
    assert e.hit(_request(block_hasher, "y", mm=[_image(2, "cat-1")])) == 0
    assert e.hit(_request(block_hasher, "x-again", mm=[_image(1, "cat-1")])) == 4 * BLOCK


def test_trusted_client_uuids_are_taken_as_vllm_gives_them(engines, block_hasher):
    """``trust_client_mm_uuids``: vLLM's identifiers as they are (a store only trusted clients
    reach): the same uuid hits whatever the pixels, and no item is read."""
    e = engines({"store": "mooncake", "trust_client_mm_uuids": True})
    e.save(_request(block_hasher, "x", mm=[_image(1, "cat-1")]))
    assert e.hit(_request(block_hasher, "y", mm=[_image(2, "cat-1")])) == 4 * BLOCK


def test_an_item_without_its_data_is_neither_looked_up_nor_saved(engines, block_hasher):
    e = engines({"store": "mooncake"})
    item = _image(1, "cat-1")
    item.data = None
    side = e.side()
    request = _request(block_hasher, "r", mm=[item])
    side.on_new_request(request)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    assert side.build_connector_meta(_prefill_step(request, TOKENS, TABLES)).saves == {}
    assert side.counters["requests_unbound"] == 1


def test_bindings_are_forgotten_with_their_requests(engines, block_hasher, tmp_path):
    e = engines({"store": "mooncake"})
    side = e.side()
    path = _write_adapter(tmp_path / "sql", 1)
    request = _request(block_hasher, "r", lora=LoRARequest("sql", 1, path), mm=[_image(1, "u")])
    side.on_new_request(request)
    side.build_connector_meta(_prefill_step(request, TOKENS, TABLES))
    side.request_finished_all_groups(request, (TABLES[0],))
    assert side.bindings.states() == 0
