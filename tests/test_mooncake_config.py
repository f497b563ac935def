"""kvstride.mooncake_config: the address a Mooncake client advertises (issue 14 item 5), the
names of what Mooncake itself is missing (issue 15 item 8) and sizes as strings (review B14)."""

import json

import pytest

from kvstride.mooncake_config import (
    MooncakeClientConfig,
    missing_library,
    parse_size,
    resolve_client_config,
    resolve_local_hostname,
)

MASTER = {"mooncake_master": "10.0.0.1:50051"}


def _file(tmp_path, **settings) -> dict:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.1:50051", **settings}))
    return {"MOONCAKE_CONFIG_PATH": str(path)}


# ---- local_hostname: config key > VLLM_HOST_IP > ValueError ----------------------------------


def test_the_config_key_wins_over_the_file_and_vllm_host_ip(tmp_path):
    env = dict(_file(tmp_path, local_hostname="10.0.0.2"), VLLM_HOST_IP="10.0.0.3")
    extra = {"mooncake_local_hostname": "10.0.0.4"}
    assert resolve_client_config(extra, environ=env).local_hostname == "10.0.0.4"
    assert resolve_client_config({}, environ=env).local_hostname == "10.0.0.2"  # the file's key


def test_vllm_host_ip_when_no_key_is_set(tmp_path):
    assert resolve_client_config(MASTER, environ={"VLLM_HOST_IP": "10.0.0.3"}).local_hostname == "10.0.0.3"
    env = dict(_file(tmp_path), VLLM_HOST_IP="10.0.0.3")
    assert resolve_client_config({}, environ=env).local_hostname == "10.0.0.3"


@pytest.mark.parametrize("segment", [None, "16MB", 1])
def test_a_client_with_a_segment_and_no_address_is_refused(segment):
    """Never a loopback default: other hosts would be told to reach the segment at 127.0.0.1."""
    extra = dict(MASTER) if segment is None else dict(MASTER, mooncake_segment_bytes=segment)
    with pytest.raises(ValueError) as err:
        resolve_client_config(extra, environ={"VLLM_HOST_IP": ""})
    message = str(err.value)
    assert 'kv_connector_extra_config["mooncake_local_hostname"]' in message and "VLLM_HOST_IP" in message
    assert "segment 0" in message  # the other way out: a pure client of `kvstride store serve`


def test_a_pure_client_needs_no_address():
    cfg = resolve_client_config(dict(MASTER, mooncake_segment_bytes=0), environ={})
    assert cfg.local_hostname is None and "local_hostname" not in cfg.to_json()
    # ... but takes one when given.
    assert resolve_client_config(dict(MASTER, mooncake_segment_bytes=0), environ={"VLLM_HOST_IP": "10.0.0.3"}).local_hostname == "10.0.0.3"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", " ", ""])
def test_a_wildcard_or_empty_address_is_refused(host):
    with pytest.raises(ValueError, match="mooncake_local_hostname"):
        resolve_client_config(dict(MASTER, mooncake_local_hostname=host), environ={})
    with pytest.raises(ValueError, match="VLLM_HOST_IP"):
        resolve_local_hostname(None, 1 << 20, {"VLLM_HOST_IP": host})


def test_resolve_local_hostname_direct():
    assert resolve_local_hostname("10.0.0.9", 1 << 20, {"VLLM_HOST_IP": "10.0.0.3"}) == "10.0.0.9"
    assert resolve_local_hostname(None, 1 << 20, {"VLLM_HOST_IP": "10.0.0.3"}) == "10.0.0.3"
    assert resolve_local_hostname(None, 0, {}) is None
    with pytest.raises(ValueError, match="set local_hostname or VLLM_HOST_IP"):
        resolve_local_hostname(None, 1 << 20, {})


def test_the_address_is_written_and_read_back(tmp_path):
    cfg = MooncakeClientConfig("10.0.0.1:50051", local_hostname="10.0.0.5")
    env = {"MOONCAKE_CONFIG_PATH": str(tmp_path / "c.json")}
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_json()))
    assert resolve_client_config(environ=env) == cfg


# ---- what Mooncake is missing ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, library, fix",
    [
        ("/x/mooncake_master: error while loading shared libraries: libibverbs.so.1: cannot open shared object "
         "file: No such file or directory", "libibverbs.so.1", "apt-get install libibverbs1"),
        ("libibverbs.so.1: cannot open shared object file: No such file or directory",  # an ImportError's text
         "libibverbs.so.1", "apt-get install libibverbs1"),
        ("mooncake_master: error while loading shared libraries: /tmp/x/libibverbs.so.1: file too short",
         "libibverbs.so.1", "apt-get install libibverbs1"),
        ("store.so: error while loading shared libraries: libnuma.so.1: cannot open shared object file",
         "libnuma.so.1", "apt-get install libnuma1"),
        ("libfoo-bar.so.3.1: cannot open shared object file", "libfoo-bar.so.3.1", "the system package that provides"),
    ],
)
def test_missing_library_names_it_and_the_fix(text, library, fix):
    hint = missing_library(text)
    assert library in hint and fix in hint


@pytest.mark.parametrize("text", ["", "E0101 master.cpp:12] bind failed: Address already in use", "No module named 'mooncake'"])
def test_no_missing_library_in_other_failures(text):
    assert missing_library(text) is None


# ---- sizes (review B14: store_bytes / staging_bytes) --------------------------------------------


@pytest.mark.parametrize("value, size", [("8GB", 8 << 30), ("64MiB", 64 << 20), ("512 mb", 512 << 20), (1 << 30, 1 << 30)])
def test_parse_size_for_the_connectors_byte_settings(value, size):
    assert parse_size(value, "store_bytes") == size


def test_parse_size_names_the_setting():
    with pytest.raises(ValueError, match="staging_bytes 'eight' is not a size"):
        parse_size("eight", "staging_bytes")


def test_sizes_are_shown_in_the_units_they_are_given_in():
    from kvstride.sizes import format_size, parse_size

    assert [format_size(n) for n in (0, 1000, 4096, 67092480, 1 << 30, 1536 << 20, 1 << 40)] == [
        "0 B", "1000 B", "4 KiB", "63.98 MiB", "1 GiB", "1.5 GiB", "1 TiB"]
    for text in ("4 KiB", "1.5 GiB", "1 TiB"):
        assert format_size(parse_size(text)) == text
