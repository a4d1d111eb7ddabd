"""The package's imports run one way: no module imports another that (directly or through
others) imports it back, no function-local import hides such a cycle, the packages form
layers that only import downwards, and nothing outside ``epscale.kernels.cpu`` reaches
into its modules.

Run it alone with ``.venv/bin/python -m pytest tests/test_import_graph.py -q``; with
``-s`` it prints the layers and the package graph.

The graph is read from the source (``ast``), not by importing: an edge A -> B for every
``import`` or ``from ... import`` statement in A that names module B (``from pkg import
name`` names ``pkg.name`` when that is a module, else ``pkg``). Function-local imports
count like module-level ones, so a cycle cannot be dodged by moving an import into a
function.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT_PKG = "epscale"

# Bottom to top: a package may import its own modules and those of lower layers only.
LAYERS: list[tuple[str, ...]] = [
    ("config", "ops", "appendfile"),
    ("plan",),
    ("kernels",),
    ("dispatch",),
    ("moe",),
    ("placement",),
    ("model", "model_init", "head_loss"),  # the model knows nothing of parallelism
    ("parallel",),
    ("launch",),
    ("metrics",),
    ("training",),
    ("tune",),
    ("interop",),
    ("monitor",),
    ("commands",),
    ("cli", "__init__", "__main__"),
]
SEAMS = {"epscale.kernels.cpu": "the CPU kernels are used through the package only"}
# Packages that plan a run without running it: neither they nor what they import touch torch.
TORCH_FREE = ("epscale.plan",)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / ROOT_PKG).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The epscale modules ``name`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name, modules) else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT_PKG:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != ROOT_PKG:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise AssertionError(f"package epscale.{package} is in no layer of tests/test_import_graph.py")


def test_no_module_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_packages_import_downwards_only():
    graph = _graph()
    upward = []
    package_graph: dict[str, set[str]] = {}
    for a, targets in graph.items():
        pa = _package_of(a)
        for b in targets:
            pb = _package_of(b)
            if pa == pb:
                continue
            package_graph.setdefault(pa, set()).add(pb)
            if _layer(pb) > _layer(pa):
                upward.append(f"{a} imports {b} (layer '{pb}' is above '{pa}')")
    print("\nlayers, bottom to top:", " < ".join("/".join(names) for names in LAYERS))
    for pkg in sorted(package_graph, key=_layer):
        print(f"  {pkg:9s} -> {', '.join(sorted(package_graph[pkg], key=_layer))}")
    assert not upward, "\n".join(upward)
    assert _cycle(package_graph) is None


def test_seams_are_used_through_their_package():
    graph = _graph()
    leaks = [f"{a} imports {b}: {why}" for a, targets in graph.items() for b in targets
             for seam, why in SEAMS.items()
             if b.startswith(seam + ".") and not a.startswith(seam + ".") and a != seam]
    assert not leaks, "\n".join(leaks)


def _third_party(path: Path) -> set[str]:
    """The top-level names of the non-epscale modules ``path`` imports anywhere."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {ROOT_PKG}


def test_planning_packages_are_torch_free():
    """``epscale.plan`` and every epscale module it reaches import no torch (describe,
    simulate and slurm render plan on a machine without it)."""
    graph, modules = _graph(), _modules()
    reached = {m for m in graph if any(m == p or m.startswith(p + ".") for p in TORCH_FREE)}
    todo = list(reached)
    while todo:
        for b in graph[todo.pop()]:
            if b not in reached and b != ROOT_PKG:
                reached.add(b)
                todo.append(b)
    torch_users = sorted(m for m in reached if "torch" in _third_party(modules[m]))
    assert not torch_users, f"import torch though {TORCH_FREE} reach them: {torch_users}"
    assert any(m.startswith("epscale.plan.") for m in reached)


def test_the_checker_sees_cycles_and_local_imports():
    """The checker itself: a cycle through a function-local import is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    modules = _modules()
    name = "epscale.commands.train"
    src = ast.parse(modules[name].read_text())
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(src))
    assert "epscale.training.loop" in _imports(name, modules[name], modules)


def test_the_model_knows_nothing_of_parallelism():
    """``epscale.model`` imports no ``epscale.parallel`` module, directly or through
    others: parallelism is applied to the built model (``parallel.parallelize_model``)."""
    graph = _graph()
    seen, todo = set(), ["epscale.model"]
    while todo:
        for m in graph[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    assert not sorted(m for m in seen if m.startswith("epscale.parallel")), sorted(seen)
