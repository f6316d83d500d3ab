"""Functions short enough to read in one go: none of the package's is over 60 lines, the Triton kernels aside (each
is one program the compiler sees whole)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST_LINES = 60


def long_functions(path: Path) -> list[str]:
    """Every function of `path` over MOST_LINES lines (its def to its last line), Triton kernels aside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        kernel = any(getattr(decorator, "attr", None) == "jit" for decorator in node.decorator_list)
        lines = node.end_lineno - node.lineno + 1
        if lines > MOST_LINES and not kernel:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_package_is_over_60_lines():
    found = [row for path in sorted((ROOT / "egmla").rglob("*.py")) for row in long_functions(path)]
    assert not found, found
