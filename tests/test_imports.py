"""The import graph of app/ and engine/ (engine.kernels included): no cycles, and engine/ never imports app/.

Every import counts, function-level ones included: a lazy import still ties the modules together."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine")


def module_files() -> dict:
    """Module name -> source file, for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name a (possibly relative) `from X import ...` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict):
    """The module of ours that importing `name` runs: the name itself or its nearest package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_only(tree: ast.AST) -> set:
    """Nodes under `if TYPE_CHECKING:`: imports for annotations that never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def imports_of(module: str, path: Path, modules: dict) -> set:
    """Our modules that `module` imports anywhere in its source (functions included)."""
    found = set()
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in base
        else:
            continue
        found.update(m for m in (_known(n, modules) for n in names) if m and m != module)
    return found


def import_graph() -> dict:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict) -> list:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_walk_sees_function_level_imports():
    graph = import_graph()
    assert "engine.bench.suite" in graph["app.workers"]  # imported inside SweepWorker.work
    assert "engine.core.metrics" in graph["engine.core.decoder"]


def describe(cycle: list, graph: dict) -> str:
    edges = [f"{m} -> {', '.join(sorted(t for t in graph[m] if t in cycle))}" for m in cycle]
    return "cycle: " + "; ".join(edges)


def test_no_import_cycles():
    graph = import_graph()
    assert [describe(c, graph) for c in find_cycles(graph)] == []


def test_engine_never_imports_app():
    graph = import_graph()
    bad = {m: sorted(t for t in targets if t.split(".")[0] == "app")
           for m, targets in graph.items() if m.split(".")[0] == "engine"}
    assert {m: t for m, t in bad.items() if t} == {}


def test_find_cycles_reports_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_do_not_count(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine import config\n"
                      "def f():\n    from engine import metrics\n")
    modules = {"engine": None, "engine.config": None, "engine.metrics": None}
    assert imports_of("engine.mod", source, modules) == {"engine.metrics"}


def test_the_cuda_sources_folder_never_shadows_the_kernels_distribution():
    """transformers (5.25 on) imports the hub's `kernels` package: the repository's kernels/ holds .cu files,
    so with the repository on sys.path `import kernels` still finds that distribution (or nothing)."""
    assert sorted(p.name for p in (REPO / "kernels").glob("*.py")) == []
    spec = importlib.util.find_spec("kernels")
    if spec is not None:
        assert spec.origin is None or REPO / "kernels" not in Path(spec.origin).resolve().parents
