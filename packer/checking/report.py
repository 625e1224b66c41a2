"""What ``packer verify`` returns: a :class:`Report` of every :class:`Problem` found, as values.

The checks (``packer.checking.verify`` and its steps ``verify_manifest``, ``verify_rows``, ``verify_source``)
add problems to one report and never stop at the first; only the CLI prints it (``packer.render``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAX_ROWS_SHOWN = 5


@dataclass(frozen=True, slots=True)
class Problem:
    check: str  # manifest, files, rows, stats, tokenizer, source
    where: str  # a file, "file row N", or the manifest key
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(slots=True)
class Report:
    directory: str
    quick: bool
    problems: list[Problem] = field(default_factory=list)
    checked: dict[str, Any] = field(default_factory=dict)  # what was looked at: shards, rows, tokens, ...
    notes: list[str] = field(default_factory=list)  # what was left out, and why (the user's files): no problem

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: str, where: str, message: str) -> None:
        self.problems.append(Problem(check, where, message))

    def verdict(self) -> str:
        what = ", ".join(f"{v:,} {k}" for k, v in self.checked.items() if isinstance(v, int))
        scope = "quick check (manifest and hashes)" if self.quick else "full check"
        if self.ok:
            return f"{self.directory}: OK, {scope}: {what or 'nothing to check'}"
        n = len(self.problems)
        return f"{self.directory}: {n} problem{'s' * (n != 1)} found ({scope}); rebuild the folder or fix its source"

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "ok": self.ok,
            "quick": self.quick,
            "checked": self.checked,
            "problems": [asdict(p) for p in self.problems],
            "notes": self.notes,
        }


def rows_text(rows: np.ndarray) -> str:
    """``rows 3, 5, 8 … (12 rows)``: the first few of the rows a problem is in."""
    shown = ", ".join(str(int(r)) for r in rows[:MAX_ROWS_SHOWN])
    more = f" … ({len(rows):,} rows)" if len(rows) > MAX_ROWS_SHOWN else ""
    return f"row{'s' * (len(rows) != 1)} {shown}{more}"
