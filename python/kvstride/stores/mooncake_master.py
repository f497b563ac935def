"""Supervision of ``mooncake_master`` processes: started on loopback, stopped with their
parent, their temporary directories removed."""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import importlib.util
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Optional, Sequence


from kvstride.mooncake_config import (
    MOONCAKE_PIP,
    MooncakeDependencyError,
    missing_library,
)

__all__ = ["MasterProcess", "start_master"]

log = logging.getLogger("kvstride.stores")

def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def mooncake_missing() -> Optional[str]:
    """What to install when the mooncake package is not installed, else None (a command checks
    it before it says anything about the store it would start)."""
    try:
        _mooncake_dir()
    except MooncakeDependencyError as err:
        return str(err)
    return None


def _mooncake_dir() -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeDependencyError(
            f"the Mooncake store needs the mooncake package, which is not installed: {MOONCAKE_PIP}"
        )
    return list(spec.submodule_search_locations)[0]


# ---- masters die with their parent ----
# A master's parent-death signal (Linux prctl) fires when the *thread* that forked it ends, so
# every master is forked by one daemon thread that lives as long as the process; atexit stops
# the masters still running on a normal exit, and the signal kills them on any other.

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None
_spawn_requests: Optional[queue.SimpleQueue] = None
_spawner_pid = 0
_spawner_lock = threading.Lock()
_running: set = set()  # masters started by this process and not stopped yet


def _die_with(parent: int):
    """``preexec_fn``: SIGKILL this child when its parent dies, even if it already has."""

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _spawner_loop(requests: queue.SimpleQueue) -> None:
    while True:
        fn, done = requests.get()
        try:
            done.set_result(fn())
        except BaseException as e:
            done.set_exception(e)


def _spawn(argv: list, log_path: str) -> subprocess.Popen:
    """``mooncake_master`` with its output appended to ``log_path``, forked by the spawner
    thread (a daemon, never joined: it ends only with the process; a forked child starts its
    own)."""
    global _spawn_requests, _spawner_pid

    def popen() -> subprocess.Popen:
        with open(log_path, "ab") as log_f:
            return subprocess.Popen(
                argv,
                stdout=log_f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the clients, which close first
                preexec_fn=None if _prctl is None else _die_with(os.getpid()),
            )

    with _spawner_lock:
        if _spawn_requests is None or _spawner_pid != os.getpid():
            _spawn_requests, _spawner_pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(
                target=_spawner_loop, args=(_spawn_requests,), name="kvstride-master-spawner", daemon=True
            ).start()
        requests = _spawn_requests
    done: concurrent.futures.Future = concurrent.futures.Future()
    requests.put((popen, done))
    return done.result()


@atexit.register
def _stop_running() -> None:
    for m in list(_running):
        if m.owner == os.getpid():  # a forked child leaves its parent's masters alone
            m.stop()


class MasterProcess:
    """A ``mooncake_master`` started by :func:`start_master`, stopped by PID. It dies with the
    process that started it (on Linux, even on SIGKILL); :meth:`stop` also removes the log
    folder ``start_master`` made for it."""

    def __init__(
        self,
        proc: subprocess.Popen,
        rpc_port: int,
        metrics_port: int,
        log_path: str,
        argv: list,
        host: str = "127.0.0.1",
        owned_log_dir: Optional[str] = None,
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.argv = argv
        self._owned_log_dir = owned_log_dir
        self.owner = os.getpid()
        _running.add(self)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _end(self, sig: int, timeout: float) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL (tests: a master that dies); its log stays for :meth:`restart`."""
        self._end(signal.SIGKILL, 10.0)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after ``timeout``), then remove the log folder ``start_master``
        made. Final: the master is not restarted after this."""
        self._end(signal.SIGTERM, timeout)
        _running.discard(self)
        if self._owned_log_dir is not None:
            shutil.rmtree(self._owned_log_dir, ignore_errors=True)
            self._owned_log_dir = None

    def restart(self, timeout: float = 15.0) -> None:
        """Start again on the same ports (all keys are lost, clients reconnect by themselves)."""
        self._end(signal.SIGTERM, 10.0)
        self.proc = _spawn(self.argv, self.log_path)
        self.pid = self.proc.pid
        _wait_ready(self, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).strip()
    except OSError as e:
        return f"(no log: {e.strerror})"


def _wait_ready(m: MasterProcess, timeout: float) -> None:
    """Wait until ``m`` serves; on failure stop it (its log folder goes too) and raise with the
    log's last lines, or name what Mooncake is missing when the loader refused to start it."""
    deadline = time.monotonic() + timeout
    url = f"http://{m.host}:{m.metrics_port}/health"
    while time.monotonic() < deadline:
        if m.proc.poll() is not None:
            tail = _log_tail(m.log_path)
            m.stop()
            hint = missing_library(tail) if m.proc.returncode == 127 else None  # 127: the loader gave up
            if hint:
                raise MooncakeDependencyError(f"mooncake_master ({m.argv[0]}) cannot start. {hint}")
            raise RuntimeError(f"mooncake_master exited with {m.proc.returncode}; its log ends:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=0.5) as r:
                body = r.read().decode(errors="replace")
            if '"service_ready":true' in body.replace(" ", "") and _port_open(m.host, m.rpc_port):
                return
        except OSError:
            pass
        time.sleep(0.02)
    tail = _log_tail(m.log_path)
    m.stop()
    raise RuntimeError(f"mooncake_master not ready after {timeout:.0f} s; its log ends:\n{tail}")


def start_master(
    *,
    host: str = "127.0.0.1",
    rpc_port: Optional[int] = None,
    lease_ttl_ms: Optional[int] = None,
    eviction_high_watermark: Optional[float] = None,
    client_ttl_s: Optional[int] = None,
    extra_args: Sequence[str] = (),
    log_dir: Optional[str] = None,
    timeout: float = 15.0,
) -> MasterProcess:
    """Run ``mooncake_master`` listening on ``host`` (loopback by default) at ``rpc_port`` (a
    free one by default; the metrics port is always a free one), wait until healthy. Its log
    goes to ``log_dir``, else to a temporary folder that :meth:`MasterProcess.stop` removes.
    ``MooncakeDependencyError`` names what is missing when Mooncake cannot run here."""
    package_dir = _mooncake_dir()
    binary = os.path.join(package_dir, "mooncake_master")
    if not os.path.exists(binary):
        binary = shutil.which("mooncake_master")
        if binary is None:
            raise MooncakeDependencyError(
                f"the mooncake_master binary is missing: not in the mooncake package ({package_dir}) nor on PATH; "
                f"{MOONCAKE_PIP} installs it"
            )
    if rpc_port is not None and _port_open(host, rpc_port, 0.2):
        raise RuntimeError(f"port {rpc_port} on {host} is in use; pick another or leave it to a free one")
    rpc = _free_port(host) if rpc_port is None else int(rpc_port)
    met = _free_port(host)
    while met == rpc:
        met = _free_port(host)
    argv = [
        binary,
        f"--rpc_port={rpc}",
        f"--rpc_address={host}",
        f"--metrics_port={met}",
        f"--metrics_host={host}",
        "--logtostderr",
    ]
    if lease_ttl_ms is not None:
        argv.append(f"--default_kv_lease_ttl={int(lease_ttl_ms)}")
    if eviction_high_watermark is not None:
        argv.append(f"--eviction_high_watermark_ratio={eviction_high_watermark}")
    if client_ttl_s is not None:  # how long a client's segment outlives its missed heartbeats
        argv.append(f"--client_ttl={int(client_ttl_s)}")
    argv += list(extra_args)
    owned_log_dir = None if log_dir else tempfile.mkdtemp(prefix="kvstride-mooncake-")
    log_path = os.path.join(log_dir or owned_log_dir, f"master-{rpc}.log")
    try:
        proc = _spawn(argv, log_path)
    except OSError as e:
        if owned_log_dir is not None:
            shutil.rmtree(owned_log_dir, ignore_errors=True)
        raise RuntimeError(f"cannot run {binary}: {e}") from e
    m = MasterProcess(proc, rpc, met, log_path, argv, host, owned_log_dir)
    _wait_ready(m, timeout)
    return m


# ---- Mooncake store ---------------------------------------------------------------------
