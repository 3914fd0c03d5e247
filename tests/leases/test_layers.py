"""The apps' layers, read from the source: the base app imports nothing of the companion
apps, `leases.tasks` nothing of `leases.pipelines`, and no modules import each other in a
circle when they load (an import inside a function runs later, so it is allowed to point
back, though not across layers)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "leases"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at load time) for each import of the file; `from x import
    y` counts as x.y when that is a module of the package, else x."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    loading = {id(node) for node in _load_time(tree.body)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in loading) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.append((whole if whole in MODULES else base, id(node) in loading))
    return found


def _load_time(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements run when the module loads: not in functions, nor under TYPE_CHECKING."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                out += _load_time([n for n in inner if isinstance(n, ast.stmt)] + [
                    s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])
    return out


MODULES = {_module(path) for path in PACKAGE.rglob("*.py") if "migrations" not in path.parts}
GRAPH = {_module(path): _imports(path) for path in PACKAGE.rglob("*.py") if "migrations" not in path.parts}


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("leases", "leases.tasks"), ("leases", "leases.pipelines"), ("leases.tasks", "leases.pipelines"),
])
def test_a_layer_imports_nothing_of_the_apps_built_on_it(layer, forbidden):
    base_only = layer == "leases"
    wrong = sorted(
        f"{module} imports {target}" for module, imports in GRAPH.items()
        if _in(module, layer) and not (base_only and (_in(module, "leases.tasks") or _in(module, "leases.pipelines")))
        for target, _ in imports if _in(target, forbidden))
    assert not wrong, wrong


def _circles(edges: dict[str, list[str]]) -> list[str]:
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in edges.get(module, []):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return circles


def test_no_modules_import_each_other_in_a_circle_when_they_load():
    edges = {module: sorted({target for target, loading in imports if loading and target in MODULES
                             and target != module and not _in(module, target)})
             for module, imports in GRAPH.items()}
    assert not _circles(edges), _circles(edges)


def test_the_reading_of_imports_tells_load_time_from_later_and_finds_a_circle():
    """The checks above can fail: relative imports resolve to modules, an import inside a
    function is not a load-time one, and a circle of three is found."""
    found = _imports(PACKAGE / "tasks" / "jobs" / "leasing.py")
    assert ("leases.tasks.joblease", True) in found and ("leases.tasks.registry", True) in found
    assert ("leases.lease", False) in _imports(PACKAGE / "contrib" / "scrapy" / "config.py")
    assert _circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a -> b -> c -> a"]
