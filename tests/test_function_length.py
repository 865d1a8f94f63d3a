"""Functions a reader can hold (issue 61, item 6): no function in src/specdec over 80 lines, its
docstring not counted, and no exemptions: a function that grows past the bound is split."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src" / "specdec"
MOST_LINES = 80


def long_functions(source: str, most: int = MOST_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function longer than `most` lines, its docstring not counted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
        if lines > most:
            found.append((node.name, lines))
    return found


def test_no_function_is_longer_than_a_reader_can_hold():
    found = {(str(path.relative_to(SOURCE)), name): lines for path in sorted(SOURCE.rglob("*.py"))
             for name, lines in long_functions(path.read_text())}
    assert found == {}, "split these"


def test_the_count_leaves_out_the_docstring_and_catches_a_long_body():
    def body(lines: int) -> str:
        return "\n".join(f"    x{i} = {i}" for i in range(lines))

    # def line + body: 81 lines, the 3-line docstring left out.
    assert long_functions(f'def f():\n    """Doc.\n\n    More."""\n{body(80)}\n') == [("f", 81)]
    assert long_functions(f'def g():\n    """Doc."""\n{body(79)}\n') == []  # exactly 80
