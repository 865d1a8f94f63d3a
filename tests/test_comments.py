"""No measurements in src/'s comments and docstrings (issue 61, item 7).

Numbers live in benchmarks/RESULTS.md, each beside the machine and the command that produced it, where
a rerun can replace them. A timing, bandwidth or speed ratio copied into a comment has neither and goes
stale without anyone noticing, so code says why in words and cites the section by its title
(benchmarks/RESULTS.md, "Title"), which tests/test_results.py checks exists.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "src" / "specdec"

# A number with a unit of time or rate, "7.2 ms", "45us", "20 µs" (micro sign or Greek mu), "2.5 s", "12 tok/s",
# "30 GB/s" (not "fp32s" or "3 steps"), or a speed ratio "1.24x" (not the shape "8960x1536", the hex "0x1f"
# or "17920 x 1536").
_NUMBER = r"(?<![\w.])\d+(?:[.,]\d+)*"
MEASUREMENT = re.compile(rf"{_NUMBER}[ \u00a0]?(?:ms|us|[µμ]s|s|tok/s|tokens/s|[KMGT]B/s)(?![\w/])"
                         rf"|{_NUMBER}x(?![\w])")


def measurements(text: str, first_line: int) -> list[tuple[int, str]]:
    """(line, match) for each measurement in text, whose first line is first_line."""
    return [(first_line + text.count("\n", 0, match.start()), match.group())
            for match in MEASUREMENT.finditer(text)]


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment and every module, class and function docstring."""
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.append((body[0].value.lineno, body[0].value.value))
    return found


def hits(source: str) -> list[tuple[int, str]]:
    found = [hit for line, text in comments_and_docstrings(source) for hit in measurements(text, line)]
    return sorted(found, key=lambda hit: hit[0])


def test_no_measurements_in_comments_or_docstrings():
    """A timing or ratio in src/ belongs in benchmarks/RESULTS.md; the comment cites the section."""
    found = [f"{path.relative_to(ROOT)}:{line}: {match}" for path in sorted(SOURCE.rglob("*.py"))
             for line, match in hits(path.read_text())]
    assert found == []


def test_the_check_catches_a_planted_measurement():
    planted = ('"""Docstring.\n\nVerifying costs 1.24x a step."""\n'
               "x = 1  # a step takes 7.2 ms\n"
               "y = 2  # an 8960x1536 matrix, 17920 x 1536 too, 0x1f, fp32s, 3 steps, 45us\n"
               'print("strings the program prints: 3.1 ms, 2x")\n')
    assert hits(planted) == [(3, "1.24x"), (4, "7.2 ms"), (5, "45us")]
    assert hits("# 8960x1536 matrix\n") == []
    assert [match for _, match in hits("# 30 GB/s, 12 tok/s, 2.5 s, ~20 µs\n")] == \
        ["30 GB/s", "12 tok/s", "2.5 s", "20 µs"]
