"""The code's own conventions that a linter cannot check, read from its syntax trees."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOTS = [Path(__file__).parents[2] / part for part in ("src", "tests", "bench")]
SOURCES = sorted(path for root in ROOTS for path in root.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOTS[0].parent)))
def test_options_are_built_by_keyword(path: Path) -> None:
    """`Options(...)` names every field: 20 fields, several of the same type, in any order.

    A transposed --kill-after and --namespace, or --max-time and --kill-after, would
    type-check when passed by position (design review, "Options built positionally").
    """
    tree = ast.parse(path.read_text(), str(path))
    positional = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Options"
        and node.args
    ]
    assert positional == [], f"{path}: Options(...) with positional arguments at {positional}"
