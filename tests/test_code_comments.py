"""Code comments and docstrings state rules and their reasons; the runs that chose them live in docs/results.md
("Behind the defaults"), not in the code."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "egmla", ROOT / "integrations" / "vllm" / "egmla_vllm"]
# A measured figure: a number followed by a percent sign, or by ms, s or x as a unit ("3x", "1.94 s", "0.65x").
MEASURED = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:%|ms\b|s\b|x\b)")


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """Every comment and docstring line of a Python file, with its line number."""
    source = path.read_text()
    lines = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines += [(first.lineno + offset, line) for offset, line in enumerate(first.value.value.splitlines())]
    return lines


def test_the_scan_finds_a_measured_figure():
    assert (
        MEASURED.search("# 3-5x slower here") and MEASURED.search("took 1.94 s") and MEASURED.search("+8.3% held-out")
    )
    assert not MEASURED.search("# [T, H, dn + dr]: 4 heads of 64, block_size 16")


@pytest.mark.parametrize("package", PACKAGES, ids=lambda path: path.name)
def test_no_measured_figure_in_code_comments(package):
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        for number, line in comment_lines(path)
        if MEASURED.search(line)
    ]
    assert not found, "measured figures belong in docs/results.md:\n" + "\n".join(found)
