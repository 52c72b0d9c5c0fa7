"""One-way layers, checked from the source with the standard library's ``ast`` only.

The project's modules (the packages below) and every import they make, wherever it is written:
at module level, inside functions (imports that run later), under ``if TYPE_CHECKING:``.

* No import cycle between modules, and none between packages (``engine`` and ``services``
  importing each other is a cycle even when no two modules do).
* DESIGN.md's one-way rules: the gateway imports no torch (what a gateway module imports,
  and what those imports pull in at module level); the engine imports nothing networked (no
  grpc, redis or HTTP framework, no gateway, worker, services, kvtransfer, protos or pdserve
  module; torch.distributed is fine); no worker package imports another.

Layers, bottom up: ``pdcore`` (plain shared helpers and types) < ``engine``, ``kvtransfer``,
``protos`` < ``services`` < ``gateway``, ``prefill_worker``, ``decode_worker`` < ``pdserve``.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pdcore", "engine", "services", "gateway", "prefill_worker", "decode_worker",
            "kvtransfer", "protos", "pdserve")
WORKERS = ("prefill_worker", "decode_worker")
NETWORKED = ("grpc", "grpc_health", "grpc_reflection", "redis", "aiohttp", "fastapi",
             "starlette", "flask", "httpx", "requests", "urllib3", "uvicorn", "websockets",
             "socket", "socketserver", "http", "xmlrpc", "ssl")
NOT_FOR_ENGINE = ("gateway", "prefill_worker", "decode_worker", "services", "kvtransfer",
                  "protos", "pdserve")


@dataclass(frozen=True)
class Import:
    target: str  # a project module, or a third-party / stdlib name as written
    line: int
    at_import: bool  # runs when the importing module is imported (module level, not
    # TYPE_CHECKING)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, at_import: bool):
    """(import node, at_import) for every import under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, at_import
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, False)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), False)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), at_import)
        else:
            yield from _walk(child, at_import)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of module ``name``, resolved to project modules where it names one."""
    is_package = path.name == "__init__.py"
    out = []
    for node, at_import in _walk(ast.parse(path.read_text(), str(path)), True):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(alias.name, node.lineno, at_import))
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base else alias.name
            out.append(Import(sub if sub in modules else base, node.lineno, at_import))
    return out


@functools.cache
def _graph() -> tuple[dict[str, Path], dict[str, list[Import]]]:
    modules = project_modules()
    return modules, {name: imports_of(name, path, modules) for name, path in modules.items()}


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def _executed(start: list[str], modules: dict[str, Path],
              graph: dict[str, list[Import]], first_all: bool) -> dict[str, str]:
    """Every module or third-party name that importing ``start`` runs: the start modules'
    imports (all of them with ``first_all``: their functions run in that process too), then
    what those pull in at import time, including the parent packages Python imports first.
    Maps each name to the chain that reached it."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, str, bool]] = [(m, m, first_all) for m in start]
    while todo:
        name, chain, all_imports = todo.pop()
        for imp in graph.get(name, ()):
            if not (imp.at_import or all_imports):
                continue
            targets = [imp.target]
            if imp.target in modules:  # importing a.b.c runs a and a.b first
                parts = imp.target.split(".")
                targets = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            for target in targets:
                if target not in seen:
                    seen[target] = f"{chain} -> {target} (line {imp.line} of {name})"
                    if target in modules:
                        todo.append((target, seen[target], False))
    return seen


def test_no_import_cycle_between_modules():
    modules, graph = _graph()
    edges = {name: {i.target for i in imps if i.target in modules and i.target != name}
             for name, imps in graph.items()}
    assert _cycles(edges) == []


def test_no_import_cycle_between_packages():
    modules, graph = _graph()
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    why: dict[tuple[str, str], str] = {}
    for name, imps in graph.items():
        for imp in imps:
            if imp.target in modules and _top(imp.target) != _top(name):
                edges[_top(name)].add(_top(imp.target))
                why.setdefault((_top(name), _top(imp.target)),
                               f"{name}:{imp.line} imports {imp.target}")
    cycles = _cycles(edges)
    assert cycles == [], [[why[(a, b)] for a in c for b in c if (a, b) in why] for c in cycles]


def test_gateway_imports_no_torch():
    modules, graph = _graph()
    start = [m for m in modules if _top(m) == "gateway"]
    reached = _executed(start, modules, graph, first_all=True)
    heavy = {name: chain for name, chain in reached.items()
             if _top(name) in ("torch", "triton", "numpy")}
    assert "torch" not in {_top(n) for n in heavy}, heavy


def test_engine_imports_nothing_networked():
    modules, graph = _graph()
    start = [m for m in modules if _top(m) == "engine"]
    reached = _executed(start, modules, graph, first_all=True)
    bad = {name: chain for name, chain in reached.items()
           if _top(name) in NETWORKED or _top(name) in NOT_FOR_ENGINE}
    assert bad == {}


def test_no_worker_package_imports_another():
    modules, graph = _graph()
    bad = [f"{name}:{imp.line} imports {imp.target}" for name, imps in graph.items()
           for imp in imps if _top(name) in WORKERS and _top(imp.target) in WORKERS
           and _top(imp.target) != _top(name)]
    assert bad == []


def test_the_checks_see_what_they_check():
    """The analysis itself: relative and function-local imports resolve, TYPE_CHECKING ones
    count for cycles but do not run, and a known cycle is found."""
    modules, graph = _graph()
    assert "kvtransfer.backends.tcp" in modules and "engine" in modules
    assert any(i.target == "kvtransfer.registry" and not i.at_import
               for i in graph["services.config"])  # function-local
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                     "def f():\n    import redis\nimport grpc\n")
    found = {node.names[0].name: at for node, at in _walk(tree, True)}
    assert found == {"TYPE_CHECKING": True, "torch": False, "redis": False, "grpc": True}
    reached = _executed([m for m in modules if _top(m) == "gateway"], modules, graph, True)
    assert "engine.loader" in reached  # gateway.main's function-local import (the tokenizer)
    assert "torch" in _executed(["engine.model_runner"], modules, graph, False)


def test_no_function_over_50_lines_in_the_servicer_packages():
    """The request paths stay small lifecycle objects (DESIGN.md; issue 21.6, 24)."""
    long = []
    for pkg in ("gateway", "prefill_worker", "decode_worker"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 50:
                        long.append(f"{path.relative_to(ROOT)}:{node.name} ({n} lines)")
    assert not long, long
