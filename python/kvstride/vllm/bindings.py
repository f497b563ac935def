"""What a request's keys are bound to beyond the engine's own namespace, on a store that
outlives the engine (Mooncake, the disk tier): the content of the LoRA adapter it runs and of
the multimodal items in its prompt. vLLM's block hashes name an adapter by its name and path
and an item by an identifier a client may choose (``multi_modal_uuids``), so two requests with
the same hashes can compute other bytes: an adapter retrained and redeployed at the same path,
or an image another tenant declared under the same uuid. Each such request gets planners whose
namespace also binds a digest of that content (docs/SEMANTICS.md, "What a key binds"):

- an adapter's digest is :func:`kvstride.identity.checkpoint_digest` of its folder, computed
  once per adapter vLLM loads (its ``lora_int_id``, name and path, and each request that has
  vLLM reload it in place), never per step;
- a multimodal item's is a SHA-256 of the processed inputs the model consumes (every tensor's
  dtype, shape and bytes), computed once per request when vLLM hands it over; with
  ``trust_client_mm_uuids`` vLLM's identifiers are taken as they are.

A request whose content cannot be read (an adapter folder not on this host, an item whose data
vLLM did not keep) is neither looked up nor saved: it computes what it needs, never loads.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from kvstride.identity import checkpoint_digest, local_checkpoint
from kvstride.vllm.checks import warn_once

__all__ = ["RequestBindings", "mm_item_digest", "PLANNER_MEMORY", "ADAPTER_MEMORY"]

log = logging.getLogger("kvstride.vllm")

#: Bindings whose planners are kept (the least recently used one is dropped first): every
#: adapter in use, and the multimodal requests running.
PLANNER_MEMORY = 1024
#: Adapters whose digest is kept (a redeployed adapter is a new ``lora_int_id``).
ADAPTER_MEMORY = 1024


class _Unbound(Exception):
    """A request's content cannot be read: its keys cannot be bound to it."""


class RequestBindings:
    """Each request's planners (one per TP rank): the engine's own for a request bound to
    nothing more (or on a store that lives and dies with the engine), those of its binding
    otherwise, None for a request that must neither load nor save."""

    def __init__(self, config, count) -> None:
        self._base: List = list(config.rank_planners)
        self._planners_for = config.planners_for
        self._binds = bool(config.binds_requests) and config.planners_for is not None
        self._trust_mm = bool(config.trust_client_mm_uuids)
        self._count = count  # the scheduler side's counter
        self._adapters: "OrderedDict[Tuple, Optional[str]]" = OrderedDict()
        self._planners: "OrderedDict[str, List]" = OrderedDict()
        self._of_request: Dict[str, Optional[List]] = {}

    def of(self, request) -> Optional[List]:
        """``request``'s planners, computed once and kept: at its arrival, since vLLM hands the
        request over with its multimodal data, which it may drop once scheduled."""
        rid = request.request_id
        if rid not in self._of_request:
            self._of_request[rid] = self._planners_of(request)
            if self._of_request[rid] is None:
                self._count("requests_unbound")
        return self._of_request[rid]

    def of_id(self, rid: str) -> Optional[List]:
        """The planners a request was bound to (the engine's own for one never seen)."""
        return self._of_request.get(rid, self._base)

    def forget(self, rid: str) -> None:
        self._of_request.pop(rid, None)

    def states(self) -> int:
        """Requests with planners kept here (tests: none once every request finished)."""
        return len(self._of_request)

    def _planners_of(self, request) -> Optional[List]:
        if not self._binds:
            return self._base
        try:
            parts = []
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                parts.append("lora:" + self._adapter_digest(lora))
            features = getattr(request, "mm_features", None) or ()
            if features and not self._trust_mm:
                parts.append("mm:" + _features_digest(features))
        except _Unbound as why:  # said once per engine
            warn_once(str(why), "%s", why, engine=self)
            return None
        if not parts:
            return self._base
        binding = "|".join(parts)
        planners = self._planners.get(binding)
        if planners is None:
            planners = self._planners[binding] = self._planners_for(binding)
            while len(self._planners) > PLANNER_MEMORY:
                self._planners.popitem(last=False)
        self._planners.move_to_end(binding)
        return planners

    def _adapter_digest(self, lora) -> str:
        name, path = str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "") or "")
        loaded = (getattr(lora, "lora_int_id", None), name, path)
        # load_inplace: vLLM reloads the adapter from its path under the same id (new weights)
        if loaded not in self._adapters or getattr(lora, "load_inplace", False):
            self._adapters[loaded] = _adapter_digest(path)
            while len(self._adapters) > ADAPTER_MEMORY:
                self._adapters.popitem(last=False)
        digest = self._adapters[loaded]
        if digest is None:
            raise _Unbound(
                f"kvstride: LoRA adapter {name!r} ({path!r}) was not found or not readable on this host, so "
                "its requests' keys cannot cover its weights: they are neither loaded nor stored"
            )
        return digest


def _adapter_digest(path: str) -> Optional[str]:
    """The adapter folder's checkpoint digest (local path or cached Hugging Face id), or None."""
    folder = local_checkpoint(path) if path else None
    if folder is None:
        return None
    try:
        return checkpoint_digest(folder).digest
    except ValueError as err:
        log.warning("kvstride: cannot digest LoRA adapter %r: %s", path, err)
        return None


def _features_digest(features) -> str:
    total = hashlib.sha256(b"kvstride mm items v1\0")
    for feature in features:
        total.update(mm_item_digest(feature).encode() + b"\0")
    return total.hexdigest()


def mm_item_digest(feature) -> str:
    """SHA-256 hex of one multimodal item as the model consumes it: its modality, place in the
    prompt and every processed tensor (``_Unbound`` when vLLM did not keep its data)."""
    data = getattr(feature, "data", None)
    position = getattr(feature, "mm_position", None)
    if data is None:
        raise _Unbound(
            "kvstride: a multimodal item reached the connector without its data, so its keys cannot cover "
            "its content: the request is neither loaded nor stored (or set trust_client_mm_uuids)"
        )
    digest = hashlib.sha256()
    _update(digest, str(getattr(feature, "modality", "")))
    _update(digest, [getattr(position, "offset", None), getattr(position, "length", None)])
    for key in sorted(data.keys()):
        _update(digest, str(key))
        _update(digest, getattr(data[key], "data", data[key]))
    return digest.hexdigest()


def _update(digest, value) -> None:
    """Feed ``value`` (nested tensors, numbers, strings) to ``digest``, each part framed by its
    kind and length so that different values never feed the same bytes."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        head = f"T{tensor.dtype}{tuple(tensor.shape)}".encode()
        digest.update(struct.pack("<Q", len(head)) + head)
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        digest.update(struct.pack("<Q", len(raw)))
        digest.update(raw)
    elif isinstance(value, (list, tuple)):
        digest.update(b"L" + struct.pack("<Q", len(value)))
        for item in value:
            _update(digest, item)
    elif isinstance(value, (str, int, float, bool, type(None))):
        text = repr(value).encode()
        digest.update(b"S" + struct.pack("<Q", len(text)) + text)
    else:
        raise _Unbound(
            f"kvstride: a multimodal item holds a {type(value).__name__}, whose content the connector cannot "
            "digest: the request is neither loaded nor stored (or set trust_client_mm_uuids)"
        )
