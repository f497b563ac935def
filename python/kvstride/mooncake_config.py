"""Where a Mooncake client finds its master, resolved the way vLLM's MooncakeStoreConnector does.

The JSON file named by ``MOONCAKE_CONFIG_PATH`` (the file vLLM's connector reads)::

    {"master_server_address": "127.0.0.1:50051", "protocol": "tcp", "device_name": "",
     "metadata_server": "P2PHANDSHAKE", "mode": "standalone-store",
     "global_segment_size": 0, "local_buffer_size": "16MB"}

``global_segment_size`` 0 makes a pure client that contributes no memory (vLLM's
"standalone-store" mode): its objects live in a long-lived holder's segment (``kvstride store
serve``) and outlive the engine.  Sizes are byte counts or strings such as "8GB", "512MB",
"64M" (binary units).  The connector's ``kv_connector_extra_config`` keys ``mooncake_master``,
``mooncake_segment_bytes``, ``mooncake_local_buffer_bytes``, ``mooncake_protocol``,
``mooncake_device``, ``mooncake_metadata_server`` and ``mooncake_local_hostname`` override the
file.

A client that contributes a segment (``global_segment_size`` > 0) tells the master where other
clients reach it: ``local_hostname`` (file or ``mooncake_local_hostname``), else vLLM's
``VLLM_HOST_IP``, else construction fails; it never advertises a loopback address it was not
given.  A pure client serves nothing, so it needs none.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvstride.sizes import parse_size

__all__ = [
    "CONFIG_PATH_ENV",
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_LOCAL_BUFFER_BYTES",
    "HOST_IP_ENV",
    "MooncakeClientConfig",
    "MooncakeDependencyError",
    "missing_library",
    "resolve_client_config",
    "resolve_local_hostname",
]

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
HOST_IP_ENV = "VLLM_HOST_IP"  # vLLM's address of this host
# kvstride moves bytes with the zero-copy calls, which bypass the local buffer; it only
# stages the small bytes-API calls, so it stays far below vLLM's 4 GiB default.
DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20

# kv_connector_extra_config key -> the file key it overrides
OVERRIDE_KEYS = {
    "mooncake_master": "master_server_address",
    "mooncake_segment_bytes": "global_segment_size",
    "mooncake_local_buffer_bytes": "local_buffer_size",
    "mooncake_protocol": "protocol",
    "mooncake_device": "device_name",
    "mooncake_metadata_server": "metadata_server",
    "mooncake_local_hostname": "local_hostname",
}
_MODES = ("embedded", "standalone-store")
_WILDCARDS = ("0.0.0.0", "::", "[::]", "*")
# The dynamic loader's words for a shared library it could not load (a process exits with 127;
# Python's ImportError carries the same text).
_LOADER_ERROR = re.compile(r"(?:^|[\s/])(lib[\w+.-]*?\.so(?:\.\d+)*): ([^\n]+)")
# Libraries of Mooncake's wheel that the wheel does not bundle -> the Debian package with them.
_DEBIAN_PACKAGES = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1", "libcurl.so.4": "libcurl4"}
MOONCAKE_PIP = "pip install mooncake-transfer-engine-non-cuda"


class MooncakeDependencyError(RuntimeError):
    """Something Mooncake itself needs is missing; the message names it and how to install it."""


def missing_library(text: str) -> Optional[str]:
    """The fix for the first shared library the dynamic loader failed to load in ``text`` (a
    ``mooncake_master`` log, an ``ImportError`` message), naming the library and the command
    that installs it; None when ``text`` reports no such failure."""
    match = _LOADER_ERROR.search(text)
    if match is None:
        return None
    library, why = match.group(1), match.group(2).strip()
    package = _DEBIAN_PACKAGES.get(library)
    install = f"apt-get install {package}" if package else f"install the system package that provides {library}"
    return f"Mooncake needs the shared library {library}, which the loader could not load ({why}): {install}"


@dataclass(frozen=True)
class MooncakeClientConfig:
    """What ``MooncakeDistributedStore.setup`` needs (``MooncakeStore.from_config`` takes it)."""

    master_server_address: str
    protocol: str = "tcp"
    device_name: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = DEFAULT_SEGMENT_BYTES
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_BYTES
    local_hostname: Optional[str] = None  # the address this client advertises; None: a pure client's

    @property
    def mode(self) -> str:
        """vLLM's name for the topology: a pure client is "standalone-store"."""
        return "standalone-store" if self.global_segment_size == 0 else "embedded"

    def to_json(self) -> dict:
        """The ``MOONCAKE_CONFIG_PATH`` file contents (read by this module and by vLLM)."""
        settings = {
            "master_server_address": self.master_server_address,
            "protocol": self.protocol,
            "device_name": self.device_name,
            "metadata_server": self.metadata_server,
            "mode": self.mode,
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
        }
        if self.local_hostname is not None:
            settings["local_hostname"] = self.local_hostname
        return settings


def resolve_local_hostname(
    configured: Optional[str], segment_bytes: int, environ: Optional[Mapping[str, str]] = None, name: str = "local_hostname"
) -> Optional[str]:
    """The address a client advertises to the master: ``configured``, else ``$VLLM_HOST_IP``;
    None for a pure client (``segment_bytes`` 0) with neither. A client with a segment and
    neither is a ``ValueError``: other hosts would be told to reach its segment at an address
    that is not theirs to reach."""
    environ = os.environ if environ is None else environ
    where = name
    if configured is None and environ.get(HOST_IP_ENV):
        configured, where = environ[HOST_IP_ENV], HOST_IP_ENV
    if configured is None:
        if segment_bytes == 0:
            return None
        raise ValueError(
            f"this Mooncake client contributes a {segment_bytes}-byte segment, so it must advertise an address "
            f"other clients can reach, and none is set: set {name} or {HOST_IP_ENV} to this host's IP, "
            "or make it a pure client (segment 0) of a `kvstride store serve`"
        )
    host = _text(configured, where)
    if host in _WILDCARDS:
        raise ValueError(f"{where} {host!r} is a wildcard; other clients need this host's address (e.g. its IP)")
    return host


def _read_file(path: str) -> dict:
    where = f"{CONFIG_PATH_ENV}={path!r}"
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the Mooncake config {where}: {e.strerror}; point {CONFIG_PATH_ENV} at the file") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"the Mooncake config {where} is not JSON ({e}); it must be one JSON object") from e
    if not isinstance(data, dict):
        raise ValueError(f"the Mooncake config {where} must be a JSON object, got {type(data).__name__}")
    mode = data.get("mode")
    if mode is not None:
        if mode not in _MODES:
            raise ValueError(f"{where}: mode {mode!r} is unknown; use one of {list(_MODES)}")
        # The file must also be valid for vLLM, which checks mode against the segment size.
        segment = parse_size(data.get("global_segment_size", DEFAULT_SEGMENT_BYTES), f"{where}: global_segment_size")
        if (mode == "standalone-store") != (segment == 0):
            raise ValueError(
                f"{where}: mode {mode!r} needs global_segment_size {'== 0' if mode == 'standalone-store' else '> 0'}, "
                f"got {segment}; fix one of the two or drop 'mode'"
            )
    return data


def _text(value: Any, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value.strip() and not allow_empty):
        raise ValueError(f"{name} must be a{'' if allow_empty else ' non-empty'} string, got {value!r}")
    return value.strip()


def resolve_client_config(
    extra_config: Optional[Mapping[str, Any]] = None, environ: Optional[Mapping[str, str]] = None
) -> MooncakeClientConfig:
    """The client configuration from ``$MOONCAKE_CONFIG_PATH`` (if set) with the connector's
    ``mooncake_*`` keys from ``extra_config`` on top.  ``environ`` defaults to ``os.environ``.
    Raises ``ValueError`` naming the bad key or value and what would work."""
    extra = dict(extra_config or {})
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("mooncake_") and k not in OVERRIDE_KEYS)
    if unknown:  # a misspelt key would silently fall back to a default
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; the Mooncake keys are {sorted(OVERRIDE_KEYS)}")
    path = environ.get(CONFIG_PATH_ENV)
    settings = _read_file(path) if path else {}
    names = {key: f"{CONFIG_PATH_ENV} key {key!r}" for key in OVERRIDE_KEYS.values()}
    for extra_key, file_key in OVERRIDE_KEYS.items():
        if extra.get(extra_key) is not None:
            settings[file_key] = extra[extra_key]
            names[file_key] = f"kv_connector_extra_config[{extra_key!r}]"
    master = settings.get("master_server_address")
    if not master:
        where = f"{CONFIG_PATH_ENV}={path!r} has no \"master_server_address\"" if path else f"{CONFIG_PATH_ENV} is not set"
        raise ValueError(
            f"no Mooncake master address ({where}): set MOONCAKE_CONFIG_PATH to a JSON file with "
            "\"master_server_address\": \"host:port\", or kv_connector_extra_config[\"mooncake_master\"] = \"host:port\" "
            "(`kvstride store serve` starts one and prints the file)"
        )
    master = _text(master, names["master_server_address"])
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{names['master_server_address']} must be 'host:port', got {master!r}")
    segment = parse_size(settings.get("global_segment_size", DEFAULT_SEGMENT_BYTES), names["global_segment_size"])
    local_buffer = parse_size(settings.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_BYTES), names["local_buffer_size"])
    if local_buffer == 0:
        raise ValueError(f"{names['local_buffer_size']} must be > 0 (e.g. '16MB'); it stages the client's transfers")
    protocol = _text(settings.get("protocol", "tcp"), names["protocol"])
    device = _text(settings.get("device_name", ""), names["device_name"], allow_empty=True)
    metadata_server = _text(settings.get("metadata_server", "P2PHANDSHAKE"), names["metadata_server"])
    host = settings.get("local_hostname")
    host_name = names["local_hostname"] if host is not None else (
        f'kv_connector_extra_config["mooncake_local_hostname"] (or "local_hostname" in the {CONFIG_PATH_ENV} file)'
    )
    return MooncakeClientConfig(
        master_server_address=master,
        protocol=protocol,
        device_name=device,
        metadata_server=metadata_server,
        global_segment_size=segment,
        local_buffer_size=local_buffer,
        local_hostname=resolve_local_hostname(host, segment, environ, host_name),
    )
