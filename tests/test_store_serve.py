"""`kvstride store serve` (a real mooncake_master plus a segment holder), the Mooncake client
configuration it prints, and the CLI without torch."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstride.mooncake_config import (
    DEFAULT_LOCAL_BUFFER_BYTES,
    DEFAULT_SEGMENT_BYTES,
    MooncakeClientConfig,
    parse_size,
    resolve_client_config,
)
from kvstride.stores.mooncake_master import _free_port, _port_open

ENV = dict(os.environ, MC_LOG_LEVEL="ERROR")


# ---- configuration resolution ----------------------------------------------------------------


def _config_file(tmp_path, settings) -> dict:
    path = tmp_path / "mooncake.json"
    path.write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return {"MOONCAKE_CONFIG_PATH": str(path)}


@pytest.mark.parametrize(
    "text, size",
    [(0, 0), (4096, 4096), ("4096", 4096), ("8GB", 8 << 30), ("8G", 8 << 30), ("8 GiB", 8 << 30), ("512mb", 512 << 20),
     ("64M", 64 << 20), ("2KB", 2048), ("100B", 100), ("1.5GB", 3 << 29), (2.0, 2)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "8XB", "8ib", "-1", "GB", True, None, -1, 2.5])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="--bytes"):
        parse_size(text, "--bytes")


def test_file_with_defaults(tmp_path):
    env = _config_file(tmp_path, {"master_server_address": "127.0.0.1:50051", "local_hostname": "10.0.0.7"})
    assert resolve_client_config(environ=env) == MooncakeClientConfig(
        master_server_address="127.0.0.1:50051",
        protocol="tcp",
        device_name="",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=DEFAULT_SEGMENT_BYTES,
        local_buffer_size=DEFAULT_LOCAL_BUFFER_BYTES,
        local_hostname="10.0.0.7",  # vLLM's file carries it too
    )


def test_file_in_vllms_format(tmp_path):
    env = _config_file(
        tmp_path,
        {"master_server_address": "10.0.0.5:50051", "protocol": "rdma", "device_name": "mlx5_0",
         "metadata_server": "http://10.0.0.5:8080/metadata", "mode": "standalone-store",
         "global_segment_size": 0, "local_buffer_size": "512MB"},
    )
    cfg = resolve_client_config(environ=env)
    assert (cfg.master_server_address, cfg.protocol, cfg.device_name, cfg.metadata_server) == (
        "10.0.0.5:50051", "rdma", "mlx5_0", "http://10.0.0.5:8080/metadata",
    )
    assert (cfg.global_segment_size, cfg.local_buffer_size, cfg.mode) == (0, 512 << 20, "standalone-store")


def test_extra_config_overrides_the_file(tmp_path):
    env = _config_file(
        tmp_path,
        {"master_server_address": "127.0.0.1:1111", "protocol": "rdma", "global_segment_size": "8GB",
         "local_buffer_size": 1 << 20},
    )
    extra = {
        "store": "mooncake",  # the connector's own keys pass through untouched
        "mooncake_master": "127.0.0.1:2222",
        "mooncake_segment_bytes": 0,
        "mooncake_local_buffer_bytes": "32MB",
        "mooncake_protocol": "tcp",
        "mooncake_device": "eth7",
        "mooncake_metadata_server": "http://127.0.0.1:8080/metadata",
    }
    assert resolve_client_config(extra, environ=env) == MooncakeClientConfig(
        "127.0.0.1:2222", "tcp", "eth7", "http://127.0.0.1:8080/metadata", 0, 32 << 20
    )
    # No file: the keys alone are enough.
    cfg = resolve_client_config({"mooncake_master": "127.0.0.1:2222", "mooncake_local_hostname": "10.0.0.8"}, environ={})
    assert cfg == MooncakeClientConfig("127.0.0.1:2222", local_hostname="10.0.0.8")


def test_written_config_reads_back(tmp_path):
    cfg = MooncakeClientConfig("127.0.0.1:4242", global_segment_size=0, local_buffer_size=8 << 20)
    assert cfg.to_json()["mode"] == "standalone-store"
    assert resolve_client_config(environ=_config_file(tmp_path, cfg.to_json())) == cfg
    with pytest.raises(Exception):  # frozen
        cfg.global_segment_size = 1


@pytest.mark.parametrize(
    "settings, extra, message",
    [
        (None, {}, r"set MOONCAKE_CONFIG_PATH .*kv_connector_extra_config\[\"mooncake_master\"\]"),
        ({"protocol": "tcp"}, {}, r"no Mooncake master address \(MOONCAKE_CONFIG_PATH=.*json. has no \"master_server_address"),
        ("{not json", {}, "is not JSON"),
        ('["127.0.0.1:1"]', {}, "must be a JSON object"),
        ({"master_server_address": "localhost"}, {}, "'master_server_address' must be 'host:port', got 'localhost'"),
        ({"master_server_address": "h:1", "global_segment_size": "8XB"}, {}, "'global_segment_size' '8XB' is not a size"),
        ({"master_server_address": "h:1"}, {"mooncake_segment_bytes": "lots"}, r"'mooncake_segment_bytes'\] 'lots' is not a"),
        ({"master_server_address": "h:1"}, {"mooncake_local_buffer_bytes": 0}, r"\['mooncake_local_buffer_bytes'\] must be > 0"),
        ({"master_server_address": "h:1"}, {"mooncake_protocol": ""}, r"\['mooncake_protocol'\] must be a non-empty string"),
        ({"master_server_address": "h:1", "mode": "standalone-store", "global_segment_size": "1GB"}, {},
         "needs global_segment_size == 0"),
        ({"master_server_address": "h:1", "mode": "embedded", "global_segment_size": 0}, {}, "needs global_segment_size > 0"),
        ({"master_server_address": "h:1", "mode": "cluster"}, {}, "mode 'cluster' is unknown"),
        ({"master_server_address": "h:1"}, {"mooncake_segment_size": 0}, r"unknown .* key\(s\) \['mooncake_segment_size'\]"),
    ],
)
def test_config_errors_name_the_value_and_the_fix(tmp_path, settings, extra, message):
    env = {} if settings is None else _config_file(tmp_path, settings)
    with pytest.raises(ValueError, match=message):
        resolve_client_config(extra, environ=env)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read the Mooncake config MOONCAKE_CONFIG_PATH=.*nowhere.json"):
        resolve_client_config(environ={"MOONCAKE_CONFIG_PATH": str(tmp_path / "nowhere.json")})


# ---- kvstride store serve ----------------------------------------------------------------------

# A pure client (segment 0) from $MOONCAKE_CONFIG_PATH: `put` stores the values of a .npy file,
# `get` reads them back into another (a process of its own each, closed before the next starts).
CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvstride.mooncake_config import resolve_client_config
    from kvstride.stores import MooncakeStore

    op, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = resolve_client_config()
    assert cfg.global_segment_size == 0 and cfg.mode == "standalone-store", cfg
    keys = [f"serve-test-{i}" for i in range(n)]
    with MooncakeStore.from_config(cfg, fingerprint=b"servetst") as store:
        if op == "put":
            values = np.load(path)
            print(" ".join(s.value for s in store.put(keys, [[v] for v in values])))
        else:
            values = np.zeros((n, int(sys.argv[4])), np.uint8)
            statuses = store.get(keys + ["serve-test-never-put"], [[v] for v in values] + [[np.zeros(8, np.uint8)]])
            np.save(path, values)
            print(" ".join(s.value for s in statuses))
    """
)


def _client(op, config_path, *args):
    return _client_result(_client_start(op, config_path, *args))


def _client_start(op, config_path, *args) -> subprocess.Popen:
    env = dict(ENV, MOONCAKE_CONFIG_PATH=str(config_path))
    argv = [sys.executable, "-c", CLIENT, op, *map(str, args)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _client_result(proc: subprocess.Popen):
    """The statuses the client printed, once it exited."""
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return out.split()


def _put_random(folder, config_path, n, size):
    """``n`` random values of ``size`` bytes put by a client; (the .npy file of what was
    written, the path for what a later get reads)."""
    written, read = folder / "written.npy", folder / "read.npy"
    np.save(written, np.frombuffer(os.urandom(n * size), np.uint8).reshape(n, size))
    assert _client("put", config_path, written, n) == ["ok"] * n
    return written, read


def _serve(log_path, *args):
    """The server, its stderr (Mooncake's log lines too) in a file so that no pipe fills up."""
    with open(log_path, "w") as log:
        argv = [sys.executable, "-m", "kvstride.cli", "store", "serve", *args]
        return subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=log, text=True)


def _wait_for_config(proc, path, log_path, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"store serve exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"store serve wrote no {path} in {timeout:.0f} s")


def _stop(proc, sig, log_path) -> tuple:
    """Signal the server by PID; its exit code, stdout and stderr."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    return proc.returncode, out, log_path.read_text()


def test_objects_outlive_the_client_that_wrote_them(tmp_path):
    config_path = tmp_path / "engines.json"
    log_path = tmp_path / "serve.err"
    server = _serve(log_path, "--bytes", "64M", "--config-out", str(config_path))
    try:
        config = _wait_for_config(server, config_path, log_path)
        assert config["global_segment_size"] == 0 and config["mode"] == "standalone-store"
        host, port = config["master_server_address"].rsplit(":", 1)
        assert host == "127.0.0.1" and _port_open(host, int(port))

        n, size = 6, 256 << 10
        written, read = tmp_path / "written.npy", tmp_path / "read.npy"
        np.save(written, np.frombuffer(os.urandom(n * size), np.uint8).reshape(n, size))
        assert _client("put", config_path, written, n) == ["ok"] * n  # client A, closed on exit
        assert _client("get", config_path, read, n, size) == ["ok"] * n + ["missing"]  # client B, new
        assert np.load(read).tobytes() == np.load(written).tobytes()
    finally:
        rc, out, err = _stop(server, signal.SIGTERM, log_path)
    assert rc == 0, err[-3000:]
    assert json.loads(out.splitlines()[0]) == config  # the same config on stdout
    assert not _port_open(host, int(port), 1.0)


def test_objects_outlive_a_holder_stalled_past_mooncakes_client_ttl(tmp_path):
    """A busy host can delay the holder's heartbeat; mooncake_master's default ``--client_ttl``
    (10 s) then drops the holder's segment and every object in it (seen on a 2-core host under
    a TP=2 engine). store serve's master keeps it for ``--client-ttl`` (60 s): objects written
    before the holder was stopped for 13 s read back whole. ``--log-dir`` keeps the master's
    log."""
    config_path, log_path = tmp_path / "engines.json", tmp_path / "serve.err"
    server = _serve(log_path, "--bytes", "16M", "--config-out", str(config_path), "--log-dir", str(tmp_path))
    try:
        _wait_for_config(server, config_path, log_path)
        n, size = 2, 64 << 10
        written, read = _put_random(tmp_path, config_path, n, size)
        os.kill(server.pid, signal.SIGSTOP)  # the holder's heartbeat stops; its master runs on
        try:
            time.sleep(13)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        time.sleep(2)  # heartbeats again
        assert _client("get", config_path, read, n, size) == ["ok"] * n + ["missing"]
        assert np.load(read).tobytes() == np.load(written).tobytes()
    finally:
        rc, _, err = _stop(server, signal.SIGTERM, log_path)
    assert rc == 0, err[-3000:]
    assert list(tmp_path.glob("master-*.log")), "--log-dir kept no master log"


@pytest.mark.parametrize("lease_ttl", [None, 40])
def test_a_read_from_a_holder_stalled_past_the_lease_fails_unless_the_lease_is_longer(tmp_path, lease_ttl):
    """A read whose transfer outlives Mooncake's read lease fails (LEASE_EXPIRED: the bytes may
    have been evicted meanwhile), however whole they arrive. The holder is stopped for 16 s while
    a client reads: with Mooncake's 10 s lease the read is a miss, with ``--lease-ttl 40`` it
    reads back whole."""
    config_path, log_path = tmp_path / "engines.json", tmp_path / "serve.err"
    lease = [] if lease_ttl is None else ["--lease-ttl", str(lease_ttl)]
    server = _serve(log_path, "--bytes", "16M", "--config-out", str(config_path), *lease)
    try:
        _wait_for_config(server, config_path, log_path)
        n, size = 2, 64 << 10
        written, read = _put_random(tmp_path, config_path, n, size)
        os.kill(server.pid, signal.SIGSTOP)  # the holder stops serving its segment; its master runs on
        try:
            reader = _client_start("get", config_path, read, n, size)
            time.sleep(16)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        statuses = _client_result(reader)
        if lease_ttl is None:
            assert statuses == ["missing"] * (n + 1)
        else:
            assert statuses == ["ok"] * n + ["missing"]
            assert np.load(read).tobytes() == np.load(written).tobytes()
    finally:
        rc, _, err = _stop(server, signal.SIGTERM, log_path)
    assert rc == 0, err[-3000:]


def test_sigint_on_a_chosen_port(tmp_path):
    config_path, port = tmp_path / "engines.json", _free_port()
    log_path = tmp_path / "serve.err"
    server = _serve(log_path, "--bytes", "16MB", "--port", str(port), "--config-out", str(config_path))
    try:
        assert _wait_for_config(server, config_path, log_path)["master_server_address"] == f"127.0.0.1:{port}"
    finally:
        rc, _, err = _stop(server, signal.SIGINT, log_path)
    assert rc == 0, err[-3000:]
    assert not _port_open("127.0.0.1", port, 1.0)


@pytest.mark.parametrize(
    "args, message",
    [(["--bytes", "lots"], "--bytes 'lots' is not a size"), (["--bytes", "0"], "--bytes must be > 0"),
     (["--bytes", "1G", "--host", "0.0.0.0"], "is a wildcard"),
     (["--bytes", "1G", "--client-ttl", "0"], "--client-ttl: must be a whole number of seconds > 0"),
     (["--bytes", "1G", "--lease-ttl", "1.5"], "--lease-ttl: must be a whole number of seconds > 0")],
)
def test_serve_refuses_bad_arguments(args, message):
    argv = [sys.executable, "-m", "kvstride.cli", "store", "serve", *args]
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


# ---- the CLI without torch ---------------------------------------------------------------------

# Runs the CLI as if torch were not installed: a meta-path finder refuses to import it.
WITHOUT_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    from kvstride.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _without_torch(*args):
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], env=ENV, capture_output=True, text=True, timeout=120)


def test_simulate_without_torch_names_an_install_that_works():
    """The packages by name (kvstride's extras install only from a checkout)."""
    done = _without_torch("simulate", "--quiet")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr
    one_line = "kvstride simulate needs torch, which is not installed: pip install torch tqdm matplotlib"
    assert done.stderr.strip().splitlines() == [one_line]


# Runs the CLI as if the mooncake package were not installed: find_spec finds no such package.
WITHOUT_MOONCAKE = textwrap.dedent(
    """
    import importlib.util
    import sys

    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *args: None if name.partition(".")[0] == "mooncake" else real(name, *args)
    from kvstride.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_simulate_on_mooncake_without_mooncake_is_one_line_naming_the_install():
    done = subprocess.run([sys.executable, "-c", WITHOUT_MOONCAKE, "simulate", "--store", "mooncake", "--quiet"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "kvstride simulate: --store mooncake: the Mooncake store needs the mooncake package, which is not "
        "installed: pip install mooncake-transfer-engine-non-cuda"]


def test_explain_needs_no_torch():
    done = _without_torch("explain", "--preset", "llama")
    assert done.returncode == 0, done.stderr
    assert "S = " in done.stdout


def test_simulate_against_store_serve_is_a_pure_client(tmp_path):
    """The documented pairing: ``kvstride simulate --store mooncake://HOST:PORT`` against ``kvstride
    store serve``, with no --store-bytes and no host address: a pure client, its values in the server's
    segment."""
    config_path, log_path = tmp_path / "engines.json", tmp_path / "serve.err"
    server = _serve(log_path, "--bytes", "128M", "--config-out", str(config_path))
    try:
        address = _wait_for_config(server, config_path, log_path)["master_server_address"]
        env = {k: v for k, v in ENV.items() if k != "VLLM_HOST_IP"}
        argv = [sys.executable, "-m", "kvstride.cli", "simulate", "--store", f"mooncake://{address}",
                "--conversations", "2", "--turns", "2", "--json"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["verified"] and result["store"].startswith("mooncake") and result["bytes_stored"] > 0
    finally:
        rc, _, err = _stop(server, signal.SIGTERM, log_path)
    assert rc == 0, err[-3000:]
