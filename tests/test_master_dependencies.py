"""What Mooncake itself needs, named with its fix (issue 15 item 8): a libibverbs.so.1 the loader
cannot load, and a missing mooncake_master binary, on the real paths (`kvstride store serve`,
`kvstride simulate --store mooncake`, the connector's MooncakeStore.from_config, start_master).

The missing library is made real for one process tree only: LD_LIBRARY_PATH names a folder whose
libibverbs.so.1 is an empty file, which the loader finds first and cannot load (exit 127, the
same words as on a machine without it). The missing binary: a mooncake package without it, first
on the path, and a PATH without it. Nothing on the system is touched."""

import os
import subprocess
import sys
import textwrap

import pytest

from kvstride.stores.mooncake_master import _free_port

ENV = dict(os.environ, MC_LOG_LEVEL="ERROR")
SMALL_SIMULATION = ["--preset", "llama", "--conversations", "2", "--batch", "1", "--turns", "1", "--system-tokens", "64",
                    "--user-tokens", "16", "--reply-tokens", "16", "--store-bytes", "16M", "--quiet"]


@pytest.fixture
def no_libibverbs(tmp_path):
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "libibverbs.so.1").write_bytes(b"")
    return dict(ENV, LD_LIBRARY_PATH=os.pathsep.join(p for p in (str(libs), ENV.get("LD_LIBRARY_PATH")) if p))


@pytest.fixture
def no_master_binary(tmp_path):
    """A mooncake package without mooncake_master ahead of the real one, and a PATH without it."""
    fake = tmp_path / "site" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in ENV.get("PATH", "").split(os.pathsep) if not os.path.exists(os.path.join(p, "mooncake_master")))
    return dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path / "site"), ENV.get("PYTHONPATH")) if p), PATH=path)


def _run(env, *argv, timeout=120):
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)


def _cli(env, *args):
    return _run(env, "-m", "kvstride.cli", *args)


def _assert_names_libibverbs(text):
    assert "libibverbs.so.1" in text and "apt-get install libibverbs1" in text, text[-3000:]
    assert "exited with 127" not in text


# ---- libibverbs.so.1 cannot be loaded --------------------------------------------------------


def test_start_master_names_the_library(no_libibverbs):
    code = textwrap.dedent(
        """
        import os, tempfile
        from kvstride.mooncake_config import MooncakeDependencyError
        from kvstride.stores import start_master
        before = set(os.listdir(tempfile.gettempdir()))
        try:
            start_master()
        except MooncakeDependencyError as err:
            print(err)
        left = {d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("kvstride-mooncake-")}
        print("left:", sorted(left))
        """
    )
    done = _run(no_libibverbs, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_names_libibverbs(done.stdout)
    assert "left: []" in done.stdout  # the failed master's log folder is removed


def test_store_serve_names_the_library(no_libibverbs):
    done = _cli(no_libibverbs, "store", "serve", "--bytes", "16MB")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("kvstride store serve: ")
    _assert_names_libibverbs(done.stderr)


def test_simulate_names_the_library(no_libibverbs):
    done = _cli(no_libibverbs, "simulate", *SMALL_SIMULATION, "--store", "mooncake")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.startswith("kvstride simulate: ")
    _assert_names_libibverbs(done.stderr)


def test_the_connectors_client_names_the_library(no_libibverbs):
    """The connector builds its client with MooncakeStore.from_config: the client library
    itself (mooncake.store) cannot load."""
    code = textwrap.dedent(
        f"""
        from kvstride.mooncake_config import MooncakeDependencyError, resolve_client_config
        from kvstride.stores import MooncakeStore
        config = resolve_client_config({{"mooncake_master": "127.0.0.1:{_free_port()}", "mooncake_segment_bytes": 0}})
        try:
            MooncakeStore.from_config(config)
        except MooncakeDependencyError as err:
            print(err)
        """
    )
    done = _run(no_libibverbs, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_names_libibverbs(done.stdout)
    assert "client" in done.stdout


# ---- no mooncake_master binary ---------------------------------------------------------------


def _assert_names_the_binary(text):
    assert "mooncake_master" in text and "is missing" in text, text[-3000:]
    assert "pip install mooncake-transfer-engine-non-cuda" in text, text[-3000:]


def test_start_master_names_the_missing_binary(no_master_binary):
    code = textwrap.dedent(
        """
        from kvstride.mooncake_config import MooncakeDependencyError
        from kvstride.stores import start_master
        try:
            start_master()
        except MooncakeDependencyError as err:
            print(err)
        """
    )
    done = _run(no_master_binary, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_names_the_binary(done.stdout)


def test_store_serve_names_the_missing_binary(no_master_binary):
    done = _cli(no_master_binary, "store", "serve", "--bytes", "16MB")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    _assert_names_the_binary(done.stderr)


def test_simulate_names_the_missing_binary(no_master_binary):
    done = _cli(no_master_binary, "simulate", *SMALL_SIMULATION, "--store", "mooncake")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    _assert_names_the_binary(done.stderr)
