"""A real Mooncake master for the tests (import the fixtures explicitly; no conftest).

    from mooncake_fixture import mooncake_master, fresh_master  # noqa: F401
"""

from __future__ import annotations

import pytest

from kvstride.stores import MooncakeStore, start_master


@pytest.fixture(scope="module")
def mooncake_master():
    """One master per test module, on free loopback ports; short read leases so that tests
    are not blocked by the 10 s default."""
    m = start_master(lease_ttl_ms=1000)
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def fresh_master():
    """A master of the test's own (tests that kill or fill it)."""
    m = start_master(lease_ttl_ms=1000)
    try:
        yield m
    finally:
        m.kill()  # no graceful stop needed: the test may have wedged it
        m.stop()  # removes its log folder


@pytest.fixture(scope="module")
def mooncake_store(mooncake_master):
    s = MooncakeStore(mooncake_master, segment_bytes=128 << 20, fingerprint=b"testfp01")
    try:
        yield s
    finally:
        s.close()
