"""The layers: the speculation core never imports the training package (what makes weights) nor the apps (CLI, server,
benches, demo) built on it; and no modules import each other."""
import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

import drafttree

APPS = ("drafttree.training", "drafttree.apps")
CHECKED_ONLY = ("drafttree.conformance",)  # mypy's file that checks every layer's classes against the protocols

# walks by hand: pkgutil.walk_packages would import the app packages it recurses into
IMPORT_THE_CORE = """
import importlib, pkgutil, sys, drafttree
apps, core = {apps!r}, []
skip = apps + {checked_only!r}
def walk(pkg):
    for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        if not m.name.startswith(skip):
            core.append(m.name)
            module = importlib.import_module(m.name)
            if m.ispkg:
                walk(module)
walk(drafttree)
print(len(core), sorted(m for m in sys.modules if m.startswith(apps)))
"""


def test_the_core_imports_nothing_from_training_or_the_apps():
    code = IMPORT_THE_CORE.format(apps=APPS, checked_only=CHECKED_ONLY)
    count, imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.split(maxsplit=1)
    assert int(count) > 40
    assert imported.strip() == "[]", f"core modules import training or app modules: {imported}"


def module_imports(root: Path = Path(drafttree.__file__).parent) -> dict[str, set[str]]:
    """drafttree module -> the drafttree modules it imports when it is imported (its top-level statements, those
    inside top-level try/if too; imports inside functions run later and cannot make a circle at import time). A module
    importing a.b also imports package a."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for stmt in ast.parse(path.read_text()).body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue
            for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    pkg = package.split(".")
                    base = pkg[:len(pkg) - node.level + 1] if node.level else []
                    module = ".".join(base + ([node.module] if node.module else []))
                    found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in names else module for a in node.names}
        with_packages = set()
        for dep in found:
            parts = dep.split(".")
            with_packages |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[name] = {d for d in with_packages if d in names and d != name and not name.startswith(d + ".")}
    return graph


def test_no_import_circles():
    try:
        order = list(graphlib.TopologicalSorter(module_imports()).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"modules import each other: {' -> '.join(e.args[1])}") from None
    assert len(order) > 100


def test_the_circle_check_finds_a_circle(tmp_path):
    pkg = tmp_path / "drafttree"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("import sys\nif sys:\n    from drafttree.a import g\n\ndef f():\n    from . import c\n")
    (pkg / "c.py").write_text("from .a import g\n")  # c -> a -> b, but b imports c only when f runs
    graph = module_imports(pkg)
    assert graph["drafttree.a"] == {"drafttree.b"} and graph["drafttree.b"] == {"drafttree.a"}
    assert graph["drafttree.c"] == {"drafttree.a"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
