"""The code stays in small pieces: no module of speckv over 500 lines, no function over 80.

Lines are physical lines (docstrings and comments count: they are read too); a function's
span runs from its first decorator to its last line, nested functions included. A piece that
outgrows the limit is split along a seam (what it owns), not cut in two. Also: `speckv demo`
measures through product modules (`speckv.measure`), never through a bench command's module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "speckv"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in sorted(ROOT.rglob("*.py"))]


def test_no_module_is_over_500_lines():
    long = {str(path.relative_to(ROOT.parent)): source.count("\n")
            for path, source in _sources() if source.count("\n") > MAX_FILE_LINES}
    assert not long, f"split these along a seam: {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path, source in _sources():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                size = node.end_lineno - first + 1
                if size > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}"] = size
    assert not long, f"split these along a seam: {long}"


def test_the_demo_imports_no_bench_module():
    offenders = []
    for path in sorted((ROOT / "commands").glob("demo*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [])
            offenders += [f"{path.name}: {name}" for name in names
                          if name.startswith("speckv.bench")]
    assert not offenders
