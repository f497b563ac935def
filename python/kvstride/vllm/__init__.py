"""kvstride's vLLM KV connector (``kv_connector_module_path="kvstride.vllm"``), split by
role: :mod:`.connector` (the facade vLLM loads), :mod:`.scheduler` and :mod:`.worker` (its two
sides), :mod:`.config` (vLLM's configuration read into kvstride's), :mod:`.metadata`,
:mod:`.store_registry`, :mod:`.stats`, :mod:`.checks`, :mod:`.bindings` and :mod:`.logs`."""

from kvstride.engine import LoadRequest, SaveRequest
from kvstride.vllm.config import group_specs
from kvstride.vllm.connector import KVStrideConnector
from kvstride.vllm.metadata import KVStrideMetadata, KVStrideWorkerMetadata
from kvstride.vllm.logs import through_vllm_logging
from kvstride.vllm.store_registry import drop_shared_stores, release_shared_store, shared_store

through_vllm_logging()

__all__ = [
    "KVStrideConnector", "KVStrideMetadata", "KVStrideWorkerMetadata", "LoadRequest", "SaveRequest",
    "group_specs", "shared_store", "release_shared_store", "drop_shared_stores",
]
