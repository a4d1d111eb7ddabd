"""No function in ``epscale.training`` is longer than 100 lines (the trainer reads as
steps, not as one long set-up). Read from the source with ``ast``, like
tests/test_import_graph.py: a function's length is ``end_lineno - lineno + 1``, its
decorators and docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "epscale"
PACKAGES = ("training",)
MAX_LINES = 100


def long_functions(source: str, filename: str, limit: int = MAX_LINES) -> list[str]:
    """'file:line name (n lines)' for every function of ``source`` longer than ``limit``."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{filename}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_in_training_is_longer_than_100_lines():
    found = []
    for pkg in PACKAGES:
        files = sorted((SRC / pkg).rglob("*.py"))
        assert files, f"no sources under {SRC / pkg}"
        for path in files:
            found += long_functions(path.read_text(), str(path.relative_to(SRC.parent)))
    assert not found, "split these into steps:\n" + "\n".join(found)


def test_the_checker_sees_a_long_method():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    src = f"class A:\n    def short(self):\n        return 1\n\n    def long(self):\n{body}\n"
    assert long_functions(src, "a.py") == [f"a.py:5 long ({MAX_LINES + 1} lines)"]
    assert long_functions(src, "a.py", limit=MAX_LINES + 1) == []
