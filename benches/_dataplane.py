"""What the Python benches share: loading kvstride's data-plane modules without running
kvstride/__init__.py (which needs the built Rust core), so the benches run from a checkout with
only their own dependencies, and the median timing of a call."""

import importlib
import os
import statistics
import sys
import time
import types


def median_seconds(fn, repeat: int) -> float:
    """Median wall time of ``repeat`` calls of ``fn``, after one warm-up call (first touch,
    thread pools)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load(name: str):
    try:
        return importlib.import_module(f"kvstride.{name}")
    except ImportError:
        pass
    pkg = "_kvstride_dataplane"
    if pkg not in sys.modules:
        m = types.ModuleType(pkg)
        m.__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "kvstride")]
        sys.modules[pkg] = m
    return importlib.import_module(f"{pkg}.{name}")
