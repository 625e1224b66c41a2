"""The sizes the house keeps (issue 32): the CLI module stays a page of commands and options, and no
function grows past what a reader holds at once. A function's size is its lines from `def` to its last
line, its docstring not counted."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "packer"
CLI_MAX_LINES = 250
FUNCTION_MAX_LINES = 80
# Over the limit and being cut: a name here is allowed while its function is cut (empty: none is).
BEING_CUT: set[str] = set()


def sizes_of(source: str, where: str) -> dict[str, int]:
    """Each function and method in ``source`` as 'where:name' → its lines without the docstring."""
    sizes = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = node.end_lineno - node.lineno + 1
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
        sizes[f"{where}:{node.name}"] = max(lines, sizes.get(f"{where}:{node.name}", 0))
    return sizes


@functools.cache  # the sources do not change during a run: parsed once for the two tests that read them
def function_sizes() -> dict[str, int]:
    """Every function of packer/, named 'stage/module.py:name'."""
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        sizes.update(sizes_of(path.read_text(), path.relative_to(PACKAGE).as_posix()))
    return sizes


def test_cli_is_at_most_250_lines():
    lines = len((PACKAGE / "cli.py").read_text().splitlines())
    assert lines <= CLI_MAX_LINES, f"packer/cli.py has {lines} lines (at most {CLI_MAX_LINES}): move helpers out"


def test_no_function_is_over_80_lines():
    over = {name: n for name, n in function_sizes().items() if n > FUNCTION_MAX_LINES and name not in BEING_CUT}
    listed = ", ".join(f"{name} ({n} lines)" for name, n in sorted(over.items()))
    assert not over, f"over {FUNCTION_MAX_LINES} lines: {listed}; cut them into named steps"


def test_the_measure_sees_a_long_function():
    # the rule above can fail: a function's lines are counted, nested ones too, its docstring not
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    source = f'def long():\n    """Doc\n    string."""\n{body}\n\nclass A:\n    def short(self):\n        """Doc."""\n        return 1\n'
    assert sizes_of(source, "m.py") == {"m.py:long": 82, "m.py:short": 2}
    sizes = function_sizes()
    assert "cli.py:build" in sizes and "planning/plan.py:plan" in sizes
