"""kvstride's connector against vLLM's ``KVConnectorBase_V1`` / ``SupportsHMA``, release by release.

vLLM's side comes from ``tests/data/vllm_connector_surface_<major.minor>.json``, which
``scripts/vllm_surface.py`` writes from each release's wheel without installing it (0.32 is what
the vLLM tier runs; 0.33 and 0.34 are CUDA-only on PyPI). kvstride's side is read with ``ast`` from the
module(s) under ``python/kvstride/`` that define ``class KVStrideConnector``, following its
base classes through the project, so no vLLM is needed. Where vLLM is installed, the live
class and the installed ``base.py`` are checked against the same data.

For every vLLM method the connector overrides, in every release: the same kind (method,
classmethod, staticmethod, property), and the same parameters in the same order with the same
names and kinds; a parameter with a default in the base keeps one; extra parameters only after
the base's, each with a default, and only where the base takes ``**kwargs``; the base's
``*args`` / ``**kwargs`` kept. Every abstract method is implemented, and
``supports_sleep_mode`` (vLLM 0.33, default True) answers False.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import inspect
import json
import os
import pathlib
import sys
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "kvstride"
DATA = ROOT / "tests" / "data"
SCRIPT = ROOT / "scripts" / "vllm_surface.py"
CONNECTOR = "KVStrideConnector"
REQUIRED_VERSIONS = ("0.32", "0.33", "0.34")


def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_surface", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vllm_surface", mod)
    spec.loader.exec_module(mod)
    return mod


vs = _load_script()


def surface_files() -> Dict[str, pathlib.Path]:
    out = {}
    for path in sorted(DATA.glob("vllm_connector_surface_*.json")):
        out[path.stem.rsplit("_", 1)[1]] = path
    return out


def load_surface(version: str) -> dict:
    return json.loads(surface_files()[version].read_text())


# ---- the connector, from the project's source ----------------------------------------------


class Project:
    """The modules under a package directory: their classes and what they import."""

    def __init__(self, package_dir: pathlib.Path, package: str = "kvstride"):
        self.modules: Dict[str, ast.Module] = {}
        self.paths: Dict[str, pathlib.Path] = {}
        self.is_package: Dict[str, bool] = {}
        for path in sorted(package_dir.rglob("*.py")):
            rel = path.relative_to(package_dir).with_suffix("")
            parts = [package, *rel.parts]
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join(parts)
            self.modules[name] = ast.parse(path.read_text(), str(path))
            self.paths[name] = path
            self.is_package[name] = is_pkg

    def classes(self, module: str) -> Dict[str, ast.ClassDef]:
        return {n.name: n for n in self.modules[module].body if isinstance(n, ast.ClassDef)}

    def imports(self, module: str) -> Dict[str, Tuple[str, Optional[str]]]:
        """Local name -> (module, attribute or None for ``import x as y``)."""
        out: Dict[str, Tuple[str, Optional[str]]] = {}
        pkg = module if self.is_package[module] else module.rpartition(".")[0]
        for node in ast.walk(self.modules[module]):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for alias in node.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = (src, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        out[alias.asname] = (alias.name, None)
                    else:
                        out[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
        return out

    def resolve(self, module: str, expr: ast.expr, depth: int = 0):
        """A base-class expression in ``module`` -> ``(module, ClassDef)`` if the project
        defines it, else the external class's name (its last dotted part)."""
        if depth > 20:
            raise RecursionError(ast.unparse(expr))
        if isinstance(expr, ast.Subscript):  # Generic[T] and the like
            expr = expr.value
        dotted = ast.unparse(expr)
        head, _, rest = dotted.partition(".")
        if not rest:
            if head in self.classes(module):
                return module, self.classes(module)[head]
            src, attr = self.imports(module).get(head, (None, None))
            if src in self.modules and attr is not None:
                if attr in self.classes(src):
                    return src, self.classes(src)[attr]
                return self.resolve(src, ast.Name(attr), depth + 1)  # re-exported
            return attr or head
        # module.Class, module resolved through this module's imports
        src, attr = self.imports(module).get(head, (None, None))
        if src is not None:
            target = ".".join([src] + ([attr] if attr else []) + rest.split(".")[:-1])
            if target in self.modules:
                return self.resolve(target, ast.Name(rest.split(".")[-1]), depth + 1)
        return dotted.rsplit(".", 1)[-1]

    def find(self, name: str) -> List[Tuple[str, ast.ClassDef]]:
        return [(m, c) for m in self.modules for n, c in self.classes(m).items() if n == name]

    def linearize(self, module: str, cls: ast.ClassDef):
        """The project classes in method-lookup order (depth first, left to right, each once:
        Python's MRO for classes without diamonds) and the external bases met on the way."""
        order: List[Tuple[str, ast.ClassDef]] = []
        external: List[str] = []

        def walk(mod, c):
            if any(c is seen for _, seen in order):
                return
            order.append((mod, c))
            for base in c.bases:
                r = self.resolve(mod, base)
                if isinstance(r, tuple):
                    walk(*r)
                elif r not in external:
                    external.append(r)

        walk(module, cls)
        return order, external


class Connector:
    """The methods a project class defines or inherits from project classes, with the vLLM
    classes it derives from."""

    def __init__(self, package_dir: pathlib.Path = PACKAGE, name: str = CONNECTOR):
        project = Project(package_dir)
        found = project.find(name)
        assert len(found) == 1, f"{name} defined {len(found)} times under {package_dir}: {[m for m, _ in found]}"
        self.module, cls = found[0]
        self.path = project.paths[self.module]
        self.classes, self.external = project.linearize(self.module, cls)
        self.methods: Dict[str, dict] = {}
        self.nodes: Dict[str, ast.FunctionDef] = {}
        self.owner: Dict[str, str] = {}
        for mod, c in self.classes:
            for fname, m in vs.class_surface(c)["methods"].items():
                if fname not in self.methods:
                    self.methods[fname] = m
                    self.owner[fname] = f"{mod}.{c.name}"
                    self.nodes[fname] = next(
                        n for n in reversed(c.body)
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fname
                    )


def base_methods(surface: dict, external: List[str]) -> Dict[str, Tuple[str, dict]]:
    """name -> (vLLM class, method) over the connector's vLLM bases in lookup order."""
    out: Dict[str, Tuple[str, dict]] = {}
    for cname in external:
        for name, m in surface["classes"].get(cname, {"methods": {}})["methods"].items():
            out.setdefault(name, (cname, m))
    return out


def incompatibilities(where: str, base: dict, over: dict) -> List[str]:
    """Why ``over`` cannot stand in for ``base`` (both ``method_surface`` entries)."""
    if base["kind"] != over["kind"]:
        return [f"{where}: a {over['kind']}, the base's is a {base['kind']}"]
    if base["kind"] == "property":
        return []
    problems = []

    def split(params):
        plain = [p for p in params if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
        var = {p["kind"] for p in params} & {"VAR_POSITIONAL", "VAR_KEYWORD"}
        return plain, var

    b_plain, b_var = split(base["params"])
    o_plain, o_var = split(over["params"])
    def sig(params):
        star = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}
        return "(" + ", ".join(star.get(p["kind"], "") + p["name"] for p in params) + ")"

    for i, bp in enumerate(b_plain):
        if i >= len(o_plain):
            problems.append(f"{where}: lacks the base's parameter {bp['name']!r} {sig(base['params'])}")
            continue
        op = o_plain[i]
        if (op["name"], op["kind"]) != (bp["name"], bp["kind"]):
            problems.append(
                f"{where}: parameter {i} is {op['name']!r} ({op['kind']}), "
                f"the base's is {bp['name']!r} ({bp['kind']}): "
                f"{sig(over['params'])} vs the base's {sig(base['params'])}"
            )
        elif bp["has_default"] and not op["has_default"]:
            problems.append(f"{where}: {bp['name']!r} has no default; the base's has {bp['default']}")
    for op in o_plain[len(b_plain):]:
        if "VAR_KEYWORD" not in b_var:
            problems.append(f"{where}: extra parameter {op['name']!r}, and the base takes no **kwargs")
        elif not op["has_default"]:
            problems.append(f"{where}: extra parameter {op['name']!r} has no default")
    for kind, star in (("VAR_POSITIONAL", "*args"), ("VAR_KEYWORD", "**kwargs")):
        if kind in b_var and kind not in o_var:
            problems.append(f"{where}: drops the base's {star} {sig(base['params'])}")
    return problems


@pytest.fixture(scope="module")
def connector() -> Connector:
    return Connector()


# ---- the committed data --------------------------------------------------------------------


def test_surfaces_for_each_supported_release():
    assert set(REQUIRED_VERSIONS) <= set(surface_files()), (
        f"missing tests/data/vllm_connector_surface_*.json for {set(REQUIRED_VERSIONS) - set(surface_files())}: "
        "python scripts/vllm_surface.py --version X.Y.0"
    )


@pytest.mark.parametrize("version", sorted(surface_files()))
def test_surface_file_is_the_scripts_output(version):
    """Each file has the script's format, canonical formatting, and its release in its name."""
    path = surface_files()[version]
    doc = json.loads(path.read_text())
    vs.validate(doc)
    assert vs.minor(doc["version"]) == version
    assert pathlib.Path(vs.data_path(doc["version"])).resolve() == path.resolve()
    assert vs.dumps(doc) == path.read_text()
    for cname in vs.CLASSES:
        methods = doc["classes"][cname]["methods"]
        assert methods and any(m["abstract"] for m in methods.values()), cname


def test_script_output_format():
    """The script's document for a small base.py: what it reads of each method."""
    source = '''
from abc import ABC, abstractmethod
import abc

class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> bool: ...

class KVConnectorBase_V1(ABC):
    @property
    def role(self) -> int:
        return 1
    @role.setter
    def role(self, value): ...
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        return True
    @staticmethod
    def helper(a, /, b=1, *args, c, d=None, **kwargs): ...
    @abc.abstractmethod
    def start_load_kv(self, forward_context, **kwargs: Any) -> None: ...
    async def later(self): ...
'''
    doc = vs.surface_document(source, distribution="vllm", version="9.9.0", wheel="/x/vllm-9.9.0-py3-none-any.whl")
    vs.validate(doc)
    assert doc["wheel"] == "vllm-9.9.0-py3-none-any.whl" and doc["source"] == vs.BASE_PY
    base = doc["classes"]["KVConnectorBase_V1"]
    assert base["bases"] == ["ABC"]
    m = base["methods"]
    assert list(m) == ["helper", "later", "role", "start_load_kv", "supports_sleep_mode"]
    assert m["role"]["kind"] == "property" and m["role"]["returns"] == "int"  # the getter, not the setter
    assert m["supports_sleep_mode"] == {
        "kind": "classmethod", "abstract": False, "async": False, "decorators": ["classmethod"], "returns": "bool",
        "params": [
            {"name": "cls", "kind": "POSITIONAL_OR_KEYWORD", "has_default": False, "default": None, "annotation": None},
            {"name": "kv_transfer_config", "kind": "POSITIONAL_OR_KEYWORD", "has_default": False, "default": None,
             "annotation": "'KVTransferConfig'"},
        ],
    }
    assert [(p["name"], p["kind"], p["default"]) for p in m["helper"]["params"]] == [
        ("a", "POSITIONAL_ONLY", None), ("b", "POSITIONAL_OR_KEYWORD", "1"), ("args", "VAR_POSITIONAL", None),
        ("c", "KEYWORD_ONLY", None), ("d", "KEYWORD_ONLY", "None"), ("kwargs", "VAR_KEYWORD", None),
    ]
    assert m["helper"]["kind"] == "staticmethod"
    assert m["start_load_kv"]["abstract"] and m["later"]["async"]
    assert doc["classes"]["SupportsHMA"]["methods"]["request_finished_all_groups"]["abstract"]
    # The committed files have the same keys at every level.
    committed = load_surface(REQUIRED_VERSIONS[-1])
    assert set(committed) == set(doc)
    cm = committed["classes"]["KVConnectorBase_V1"]["methods"]["supports_sleep_mode"]
    assert set(cm) == set(m["supports_sleep_mode"]) and set(cm["params"][0]) == set(m["helper"]["params"][0])


def _local_wheels() -> List[str]:
    dirs = [d for d in os.environ.get("KVSTRIDE_VLLM_WHEELS", "").split(os.pathsep) if d]
    return sorted(w for d in dirs for w in glob.glob(os.path.join(d, "vllm*.whl")))


@pytest.mark.skipif(not _local_wheels(), reason="set KVSTRIDE_VLLM_WHEELS to folders with vLLM wheels")
def test_committed_surfaces_match_local_wheels():
    for wheel in _local_wheels():
        doc = vs.wheel_document(wheel)
        path = pathlib.Path(vs.data_path(doc["version"]))
        if path.exists():
            committed = json.loads(path.read_text())
            assert committed["classes"] == doc["classes"], f"{path.name} differs from {wheel}: rerun the script"
            if committed["distribution"] == doc["distribution"]:
                assert committed["source_sha256"] == doc["source_sha256"]


def test_installed_vllm_matches_its_surface():
    """The vLLM tier: the installed base.py reads the same as the committed file for its release."""
    pytest.importorskip("vllm")
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    files = surface_files()
    version = vs.minor(vllm.__version__)
    if version not in files:
        pytest.fail(f"vLLM {vllm.__version__} is installed but tests/data has no surface for {version}")
    doc = vs.surface_document(inspect.getsource(base), distribution="vllm", version=vllm.__version__, wheel=None)
    assert doc["classes"] == load_surface(version)["classes"]


# ---- the connector against each release ----------------------------------------------------


def test_connector_found_and_derives_from_vllm(connector):
    assert {"KVConnectorBase_V1", "SupportsHMA"} <= set(connector.external), connector.external
    unknown = [b for b in connector.external if b not in vs.CLASSES and b not in ("ABC", "object", "Generic")]
    assert not unknown, f"{CONNECTOR} derives from {unknown}: add them to CLASSES in scripts/vllm_surface.py"


@pytest.mark.parametrize("version", REQUIRED_VERSIONS)
def test_overrides_match_the_base(connector, version):
    surface = load_surface(version)
    base = base_methods(surface, connector.external)
    overridden = sorted(set(connector.methods) & set(base))
    assert {"start_load_kv", "get_num_new_matched_tokens", "request_finished_all_groups"} <= set(overridden)
    problems = []
    for name in overridden:
        cname, b = base[name]
        where = f"{connector.owner[name]}.{name} vs vLLM {version} {cname}.{name}"
        problems += incompatibilities(where, b, connector.methods[name])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", REQUIRED_VERSIONS)
def test_abstract_methods_implemented(connector, version):
    surface = load_surface(version)
    missing = []
    for cname in connector.external:
        for name, m in surface["classes"].get(cname, {"methods": {}})["methods"].items():
            if m["abstract"] and (name not in connector.methods or connector.methods[name]["abstract"]):
                missing.append(f"{cname}.{name}")
    assert not missing, f"{CONNECTOR} does not implement vLLM {version}'s abstract {missing}"


def test_sleep_mode_refused(connector):
    """vLLM 0.33 lets sleep mode free and remap the KV caches under a connector unless
    ``supports_sleep_mode`` says False; kvstride keeps views and in-flight copies of them."""
    assert "supports_sleep_mode" in load_surface("0.33")["classes"]["KVConnectorBase_V1"]["methods"]
    m = connector.methods.get("supports_sleep_mode")
    assert m is not None, f"{CONNECTOR} does not override supports_sleep_mode (vLLM 0.33's default is True)"
    assert m["kind"] == "classmethod"
    node = connector.nodes["supports_sleep_mode"]
    returns = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
    assert returns and all(isinstance(r.value, ast.Constant) and r.value.value is False for r in returns), (
        f"{connector.owner['supports_sleep_mode']}.supports_sleep_mode must return False"
    )


def test_live_class_matches_the_source(connector):
    """Where vLLM is installed: the class vLLM would load is the one read from the source, and
    answers False to sleep mode."""
    pytest.importorskip("vllm")
    import importlib

    live = getattr(importlib.import_module(connector.module), CONNECTOR)
    assert live.supports_sleep_mode(None) is False
    project = [c for c in live.__mro__ if c.__module__.split(".")[0] == "kvstride"]
    assert [f"{c.__module__}.{c.__name__}" for c in project] == [f"{m}.{c.name}" for m, c in connector.classes]
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    assert issubclass(live, KVConnectorBase_V1) and issubclass(live, SupportsHMA)
    for name, m in connector.methods.items():
        attr = inspect.getattr_static(live, name)
        if m["kind"] == "property":
            assert isinstance(attr, property), name
            continue
        fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        assert [p.name for p in inspect.signature(fn).parameters.values()] == [p["name"] for p in m["params"]], name


# ---- the comparison rules ------------------------------------------------------------------


def _m(src: str) -> dict:
    fn = ast.parse(src).body[0]
    return vs.method_surface(fn)


@pytest.mark.parametrize(
    "base, over, ok",
    [
        ("def f(self, a, b=1): ...", "def f(self, a, b=1): ...", True),
        ("def f(self, a, b=1): ...", "def f(self, a=0, b=2): ...", True),  # a default added
        ("def f(self, a, b=1): ...", "def f(self, a, b): ...", False),  # a default dropped
        ("def f(self, a, b): ...", "def f(self, b, a): ...", False),  # order
        ("def f(self, a): ...", "def f(self, x): ...", False),  # name
        ("def f(self, a, b): ...", "def f(self, a): ...", False),  # missing
        ("def f(self, a, *, b): ...", "def f(self, a, b): ...", False),  # kind
        ("def f(self, a, **kw): ...", "def f(self, a): ...", False),  # **kwargs dropped
        ("def f(self, a, *args): ...", "def f(self, a): ...", False),  # *args dropped
        ("def f(self, a, **kw): ...", "def f(self, a, c=None, **kw): ...", True),
        ("def f(self, a, **kw): ...", "def f(self, a, c, **kw): ...", False),  # extra without default
        ("def f(self, a): ...", "def f(self, a, c=None): ...", False),  # extra, base has no **kwargs
        ("def f(self, a): ...", "def f(self, a, **kw): ...", True),  # accepts more calls
        ("@classmethod\ndef f(cls, c): ...", "@classmethod\ndef f(cls, c=None): ...", True),
        ("@classmethod\ndef f(cls, c): ...", "def f(self, c): ...", False),
        ("@property\ndef f(self): ...", "def f(self): ...", False),
    ],
)
def test_incompatibilities(base, over, ok):
    assert (incompatibilities("f", _m(base), _m(over)) == []) is ok


def test_connector_found_across_modules(tmp_path):
    """The connector split into a package, with a mixin and a re-export: still found, with its
    inherited methods and vLLM bases."""
    pkg = tmp_path / "kvstride" / "vllm"
    pkg.mkdir(parents=True)
    (tmp_path / "kvstride" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .connector import KVStrideConnector\n")
    (pkg / "mixins.py").write_text(
        "import abc\nclass Sleep(abc.ABC):\n    @classmethod\n"
        "    def supports_sleep_mode(cls, kv_transfer_config):\n        return False\n"
    )
    (pkg / "worker.py").write_text(
        "from kvstride.vllm import mixins\nclass Worker(mixins.Sleep):\n    def wait_for_save(self): ...\n"
    )
    (pkg / "connector.py").write_text(
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA\n"
        "from .worker import Worker\n"
        "class KVStrideConnector(Worker, KVConnectorBase_V1, SupportsHMA):\n"
        "    def start_load_kv(self, forward_context, **kwargs): ...\n"
    )
    c = Connector(tmp_path / "kvstride")
    assert c.module == "kvstride.vllm.connector"
    assert [f"{m}.{k.name}" for m, k in c.classes] == [
        "kvstride.vllm.connector.KVStrideConnector", "kvstride.vllm.worker.Worker", "kvstride.vllm.mixins.Sleep",
    ]
    assert c.external == ["ABC", "KVConnectorBase_V1", "SupportsHMA"]
    assert c.owner["supports_sleep_mode"] == "kvstride.vllm.mixins.Sleep"
    assert set(c.methods) == {"supports_sleep_mode", "wait_for_save", "start_load_kv"}
