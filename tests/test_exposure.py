"""Issue 17, honest exposure: the sockets `kvstride store serve` and a MooncakeStore report are
the ones the kernel shows (`ss -ltnp` where installed, else /proc), and `--secret-file`."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvstride.exposure import Listener, listening_sockets
from kvstride.secret import load_secret
from mooncake_fixture import mooncake_master  # noqa: F401

ENV = dict(os.environ, MC_LOG_LEVEL="ERROR")


def test_listening_sockets_sees_what_this_process_opens():
    before = set(listening_sockets())
    a = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    b = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        a.bind(("127.0.0.1", 0))
        a.listen()
        b.bind(("::", 0))
        b.listen()
        new = set(listening_sockets()) - before
        assert new == {Listener("127.0.0.1", a.getsockname()[1], "tcp"), Listener("::", b.getsockname()[1], "tcp6")}
        assert [s.wildcard for s in sorted(new, key=lambda s: s.family)] == [False, True]
    finally:
        a.close()
        b.close()
    assert set(listening_sockets()) == before


def _ss(pids) -> set:
    """What `ss -ltnp` shows for these processes, as 'addr:port' like Listener.__str__."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        if any(f"pid={pid}," in line for pid in pids):
            addr = fields[3]
            host, port = addr.rsplit(":", 1)
            host = {"*": "[::]", "0.0.0.0": "0.0.0.0"}.get(host, host)
            found.add((host.strip("[]").split("%")[0], int(port)))
    return found


def test_mooncake_store_reports_the_sockets_it_opened(mooncake_master, caplog):
    from kvstride.stores import MooncakeStore

    caplog.set_level("INFO", logger="kvstride.exposure")
    store = MooncakeStore(mooncake_master, segment_bytes=32 << 20)
    try:
        assert store.listeners, "Mooncake's client opened no listening socket?"
        assert set(store.listeners) <= set(listening_sockets())
        logged = " ".join(r.getMessage() for r in caplog.records if r.name == "kvstride.exposure")
        assert all(str(s) in logged for s in store.listeners)
        if any(s.wildcard for s in store.listeners):  # Mooncake 0.3.13.post1: always
            assert "all interfaces" in logged and "Trust model" in logged
    finally:
        store.close()


def test_store_serve_reports_every_socket_it_listens_on(tmp_path):
    key = tmp_path / "deploy.key"
    log_path, config = tmp_path / "serve.err", tmp_path / "engines.json"
    with open(log_path, "w") as log:
        argv = [sys.executable, "-m", "kvstride.cli", "store", "serve", "--bytes", "16M", "--host", "127.0.0.1",
                "--config-out", str(config), "--secret-file", str(key)]
        proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        deadline = time.monotonic() + 60
        report = None
        while time.monotonic() < deadline and report is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            m = re.search(r"listening sockets \(measured\): (\{.*\})", log_path.read_text())
            report = json.loads(m.group(1)) if m else None
            time.sleep(0.1)
        assert report is not None, log_path.read_text()[-3000:]
        time.sleep(0.5)  # the secret line follows the report
        err = log_path.read_text()
        reported = {who: set(addrs) for who, addrs in report.items()}
        mine = {str(s) for s in listening_sockets(proc.pid)}
        assert reported["segment_holder"] == mine
        assert reported["mooncake_master"] and all(a.startswith("127.0.0.1:") for a in reported["mooncake_master"])
        if shutil.which("ss"):  # the kernel's view through another tool
            holder = {(s.address, s.port) for s in listening_sockets(proc.pid)}
            assert _ss([proc.pid]) == holder
        wild = [a for a in reported["segment_holder"] if a.startswith(("0.0.0.0:", "[::]:"))]
        if wild:  # Mooncake 0.3.13.post1 binds these whatever --host says: the command says so
            assert "listen on all interfaces whatever --host says" in err
        assert load_secret(key) and os.stat(key).st_mode & 0o777 == 0o600
        assert '"secret_file"' in err and str(key) in err
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0, log_path.read_text()[-3000:]


def test_store_serve_refuses_a_readable_secret_file(tmp_path):
    key = tmp_path / "deploy.key"
    key.write_text("ab" * 32)
    os.chmod(key, 0o644)
    argv = [sys.executable, "-m", "kvstride.cli", "store", "serve", "--bytes", "16M", "--secret-file", str(key)]
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "chmod 600" in done.stderr and "Traceback" not in done.stderr
