"""The size limit the project keeps: no function in model/ or server/ over 40 lines. Files are split by job,
not by a line count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 40


def _sources() -> list[Path]:
    return sorted(p for folder in ("model", "server") for p in (ROOT / folder).rglob("*.py"))


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_stay_short(path):
    assert _long_functions(path) == [], f"{path.name}: functions over {MAX_FUNCTION_LINES} lines"
