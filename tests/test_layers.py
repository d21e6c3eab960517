"""The worker's layers, measured over every import statement of every module (``ast``: module level, inside
functions and under ``TYPE_CHECKING`` alike), as docs/architecture.md describes them.

Bottom to top: runtime < checkpoint < ft < elastic < trainer < integrations. A package imports only the ones
below it, the shared base (errors, rundir, trust, config) and the leaves the worker uses (preemption,
tracking, rendezvous); none of them imports the driver side. ``python tests/test_layers.py`` prints every
cross-package import of the tree and the checks' findings.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LADDER = ["runtime", "checkpoint", "ft", "elastic", "trainer", "integrations"]
BASE = {"errors", "rundir", "trust", "config"}
LEAVES = {"preemption", "tracking", "rendezvous"}  # below the ladder: they import only the base
DRIVER = {"orchestrator.controller", "orchestrator.plan", "orchestrator.launch", "orchestrator.lifecycle",
          "orchestrator.launchers", "orchestrator.testcluster", "launchers", "ray"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path = ROOT) -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import statement under orchestrator/."""
    found = []
    for path in sorted((root / "orchestrator").rglob("*.py")):
        module = _module_name(path)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: each name may be a module
                    found += [(module, f"{target}.{alias.name}", node.lineno) for alias in node.names]
                else:
                    found.append((module, target, node.lineno))
    return found


def package_of(module: str) -> str:
    """``orchestrator.<first part>`` (a module directly under orchestrator/ is its own), else the top name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "orchestrator" and len(parts) > 1 else parts[0]


def _short(package: str) -> str:
    return package.removeprefix("orchestrator.")


def violations(root: Path = ROOT) -> list[str]:
    """Every import that breaks the layers, as ``module:line imports target (why)``."""
    found = []
    for module, target, line in imports(root):
        source, dest = _short(package_of(module)), _short(package_of(target))
        if source == dest or package_of(module) == package_of(target):
            continue
        where = f"{module}:{line} imports {target}"
        if source in LADDER:
            if dest in LADDER and LADDER.index(dest) > LADDER.index(source):
                found.append(f"{where} ({dest} is above {source})")
            elif any(target == d or target.startswith(d + ".") for d in DRIVER):
                found.append(f"{where} (the driver side)")
        elif source in BASE | LEAVES and dest in LADDER:
            found.append(f"{where} ({source} is below the worker's layers)")
    return found


def package_cycles(root: Path = ROOT, within: set[str] | None = None) -> list[list[str]]:
    """Strongly connected groups of packages (more than one) in the import graph, lazy imports included."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, target, _ in imports(root):
        a, b = package_of(module), package_of(target)
        if a != b and b.startswith("orchestrator") and (within is None or {_short(a), _short(b)} <= within):
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in list(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_package_imports_one_above_it_or_the_driver_side():
    assert violations() == []


def test_the_worker_packages_have_no_loops():
    assert package_cycles(within=set(LADDER) | BASE | LEAVES) == []


def test_every_ladder_package_exists():
    for name in LADDER:
        assert (ROOT / "orchestrator" / name / "__init__.py").is_file(), name


if __name__ == "__main__":
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, target, line in imports():
        a, b = package_of(module), package_of(target)
        if a != b and (b.startswith("orchestrator") or b in DRIVER):
            edges[(a, b)].append(f"{module}:{line}")
    for (a, b), where in sorted(edges.items()):
        print(f"{_short(a)} -> {_short(b)}: {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}")
    print("\nlayer violations:", *(violations() or ["none"]), sep="\n  ")
    print("package loops (worker side):", *(package_cycles(within=set(LADDER) | BASE | LEAVES) or ["none"]),
          sep="\n  ")
    print("package loops (whole tree):", *(package_cycles() or ["none"]), sep="\n  ")
    sys.exit(1 if violations() else 0)
