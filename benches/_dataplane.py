"""Load kvstride's data-plane modules without running kvstride/__init__.py (which needs the
built Rust core): the benches then run from a checkout with only their own dependencies."""

import importlib
import os
import sys
import types


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
