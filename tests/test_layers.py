"""DEVELOPERS.md's module tour is true: it lists every module of packer/ once, in layers; no module
imports one listed before it (arrows point downward, so there is no cycle and no import dodged); and a
stage imports only the stages upstream of it (the build never imports the training side or the checks,
the training side never imports the build)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "packer"
STAGES = ("planning", "contract", "building", "checking", "training")
# what each stage may import, besides itself and the shared modules at the top (cache, errors, fs)
ALLOWED = {
    "planning": set(),
    "contract": {"planning"},
    "building": {"contract", "planning"},
    "checking": {"building", "contract", "planning"},
    "training": {"contract", "planning"},
}
SHARED = {"cache", "errors", "fs", "remote/cached", "remote/fetch", "remote/prefetch", "remote/publish"}


# The sources do not change during a run: each is listed and parsed once (imports() is asked for every module by
# two tests, and each call listed the package again).
@functools.cache
def modules() -> tuple[str, ...]:
    """Every module of the package as a path under packer/ without .py: `cli`, `building/pipeline`."""
    return tuple(sorted(p.relative_to(PACKAGE).with_suffix("").as_posix() for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "data" not in p.relative_to(PACKAGE).parts))


def tour() -> list[str]:
    """The modules in the order DEVELOPERS.md's `packer/` entry names them (first mention)."""
    text = (ROOT / "DEVELOPERS.md").read_text()
    section = text[text.index("- `packer/` —"):text.index("- `examples/` —")]
    names = [m for m in re.findall(r"`(?:packer/)?((?:\w+/)?\w+)\.py`", section) if m in modules()]
    return list(dict.fromkeys(names))


def _resolve(module: str, level: int, name: str | None) -> str:
    """An import's target as a dotted path under packer ('' for packer itself)."""
    parts = module.split("/")[:-1]  # the module's package under packer
    base = parts[: len(parts) - (level - 1)] if level else []
    return ".".join([*base, *(name.split(".") if name else [])])


@functools.cache
def imports(module: str) -> frozenset[str]:
    """The packer modules that ``module`` imports, at any depth of its code, as tour names."""
    known = set(modules())
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("packer"):
                continue
            mod = node.module.removeprefix("packer").lstrip(".") if node.level == 0 else node.module
            base = _resolve(module, node.level, mod) if node.level else (mod or "")
            targets = [base, *(f"{base}.{a.name}".lstrip(".") for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name.removeprefix("packer.") for a in node.names if a.name.startswith("packer.")]
        found.update(t.replace(".", "/") for t in targets if t.replace(".", "/") in known)
    return frozenset(found - {module})


def stage(module: str) -> str | None:
    head = module.split("/")[0]
    return head if head in STAGES else None


def test_the_tour_lists_every_module():
    assert sorted(tour()) == list(modules())


def test_no_module_imports_one_above_it():
    order = tour()
    upward = [f"{m} imports {d}" for i, m in enumerate(order) for d in sorted(imports(m)) if d in order[:i]]
    assert not upward, "reorder DEVELOPERS.md's tour or cut the import: " + "; ".join(upward)


def test_a_stage_imports_only_the_stages_upstream_of_it():
    wrong = []
    for m in modules():
        if (s := stage(m)) is None:
            continue
        for d in imports(m):
            ds = stage(d)
            if ds is None and d not in SHARED:
                wrong.append(f"{m} imports {d} (a module of the entry layer)")
            elif ds is not None and ds != s and ds not in ALLOWED[s]:
                wrong.append(f"{m} imports {d} ({s} may import only {sorted(ALLOWED[s]) or 'no stage'})")
    assert not wrong, "; ".join(wrong)


def test_the_top_holds_few_loose_modules():
    loose = [m for m in modules() if "/" not in m and m != "__main__"]
    assert len(loose) <= 10, loose


def test_the_checker_sees_imports_across_stages():
    # the rule above can fail: pipeline's imports, resolved, name modules of other stages
    assert {"contract/schema", "contract/config", "planning/plan", "errors"} <= imports("building/pipeline")
    assert "building/pipeline" in imports("checking/verify")
