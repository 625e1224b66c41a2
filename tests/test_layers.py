"""DEVELOPERS.md's module tour is true: it lists every module of packer/ once, in layers, and no module
imports one listed before it (arrows point downward, so there is no cycle and no import dodged)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "packer"


def tour() -> list[str]:
    """The modules in the order DEVELOPERS.md's `packer/` entry names them (first mention)."""
    text = (ROOT / "DEVELOPERS.md").read_text()
    section = text[text.index("- `packer/` —"):text.index("- `examples/` —")]
    names = [m for m in re.findall(r"`(?:packer/)?(\w+)\.py`", section) if (PACKAGE / f"{m}.py").is_file()]
    return list(dict.fromkeys(names))


def imports(module: str) -> set[str]:
    """The packer modules that ``module`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1 or node.module == "packer":
                found.update(a.name for a in node.names)
            elif node.module and node.module.startswith("packer."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("packer."))
    return {m for m in found if (PACKAGE / f"{m}.py").is_file()} - {module}


def test_the_tour_lists_every_module():
    assert sorted(tour()) == sorted(p.stem for p in PACKAGE.glob("*.py"))


def test_no_module_imports_one_above_it():
    order = tour()
    upward = [f"{m} imports {d}" for i, m in enumerate(order) for d in sorted(imports(m)) if d in order[:i]]
    assert not upward, "reorder DEVELOPERS.md's tour or cut the import: " + "; ".join(upward)
