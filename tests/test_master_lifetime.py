"""Masters that kvstride starts die with the process that started them, even on SIGKILL, and
leave no log folder behind once stopped (review B8, issue 15 item 5)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvstride import simulate, stores
from kvstride.stores.mooncake_master import _port_open, start_master

ENV = dict(os.environ, MC_LOG_LEVEL="ERROR")


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, port: int, timeout: float) -> bool:
    """The master is gone and its RPC port closed (a zombie leader's threads may still be
    closing it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid) and not _port_open("127.0.0.1", port, 0.2):
            return True
        time.sleep(0.05)
    return False


def _kill_leftover(pid: int) -> None:
    """A master this test started that outlived its parent: stop it by PID."""
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)


# Starts a master from a thread that ends at once (the parent-death signal belongs to the thread
# that forked), checks it still runs, prints its pid, port and log folder, then waits.
PARENT = textwrap.dedent(
    """
    import os, sys, threading, time
    from kvstride.stores import start_master

    box = []
    t = threading.Thread(target=lambda: box.append(start_master()))
    t.start()
    t.join()
    m = box[0]
    time.sleep(0.5)
    assert m.alive(), "the master died with the thread that started it"
    print(m.pid, m.rpc_port, os.path.dirname(m.log_path), flush=True)
    if sys.argv[1] == "wait":
        time.sleep(600)
    """
)


def _parent(mode: str):
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line:
        proc.kill()
        raise AssertionError(f"the parent printed nothing: {proc.communicate(timeout=30)[1][-3000:]}")
    return proc, int(line[0]), int(line[1]), line[2]


def test_master_dies_with_a_sigkilled_parent():
    proc, pid, port, _ = _parent("wait")
    try:
        assert not _gone(pid) and _port_open("127.0.0.1", port)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert _wait_gone(pid, port, 5.0), "mooncake_master outlived its SIGKILLed parent"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _kill_leftover(pid)


def test_normal_exit_stops_the_master_and_removes_its_log_folder():
    proc, pid, port, log_dir = _parent("exit")
    try:
        assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
        assert _wait_gone(pid, port, 5.0)
        assert not os.path.exists(log_dir)
    finally:
        _kill_leftover(pid)


def test_stop_removes_the_log_folder_kill_keeps_it_for_restart():
    m = start_master()
    log_dir = os.path.dirname(m.log_path)
    try:
        assert os.path.isdir(log_dir) and os.path.basename(log_dir).startswith("kvstride-mooncake-")
        m.kill()
        assert os.path.isdir(log_dir)  # a restart appends to the same log
        m.restart()
        assert m.alive()
    finally:
        m.stop()
    assert not m.alive() and not os.path.exists(log_dir)
    m.stop()  # twice: nothing left to do


def test_a_given_log_folder_is_left_alone(tmp_path):
    m = start_master(log_dir=str(tmp_path))
    m.stop()
    assert os.listdir(tmp_path) == [os.path.basename(m.log_path)]


def test_simulate_stops_its_master_when_the_store_fails(monkeypatch):
    """Simulation.__init__ runs before run_simulation's cleanup: a store that fails after
    start_master must not leak the master."""
    started = []

    def recording_start_master(**kwargs):
        started.append(start_master(**kwargs))
        return started[-1]

    class Broken(stores.MooncakeStore):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("setup failed")

    monkeypatch.setattr(simulate, "start_master", recording_start_master)
    monkeypatch.setattr(simulate, "MooncakeStore", Broken)
    cfg = simulate.SimConfig(
        mix=simulate_mix(), store="mooncake", store_bytes=16 << 20, conversations=2, turns=1, system_tokens=64, progress=False
    )
    try:
        with pytest.raises(RuntimeError, match="setup failed"):
            simulate.run_simulation(cfg)
        assert len(started) == 1
        assert not started[0].alive() and not os.path.exists(os.path.dirname(started[0].log_path))
    finally:
        for m in started:
            m.stop()


def simulate_mix():
    from kvstride.mixes import resolve_mix

    return resolve_mix("llama", None, None)
