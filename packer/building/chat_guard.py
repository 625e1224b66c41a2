"""Where each message's own text lies in a render, proved by an exact alignment, never by a search.

A span finder that searches the real render for headers, ends of turn or its own markers can be fooled by
message text that contains them (a user writing ``<|im_start|>assistant\\n``): it would train that text. So
packer's span finder never reads the real render. It reads a *guard* render instead: the same conversation
with the text of every message that is not the assistant's replaced by a sentinel, a string checked absent
from every message and from the real render. The guard holds only the template's own text, the assistant's
output and the sentinels; :func:`align` then walks the guard and the real render side by side, matching the
template's text exactly and each sentinel with its message's text as the template writes it (as given,
trimmed, or as a JSON string). No search takes part, so no message text can move the walk; where the walk
does not reach the end of both (the template writes a message's text otherwise, or renders the sentinel's
conversation differently), the record is refused (``chat_unverifiable``), never guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import RecordError


def salt(*blobs: str) -> str:
    """The stem of packer's markers and sentinels for one record: ``PACKER``, or ``PACKER<k>Q`` for the smallest
    ``k`` whose markers and sentinels appear in none of ``blobs`` (the record's messages, tools and render)."""
    k = 0
    while True:
        stem = "PACKER" if k == 0 else f"PACKER{k}Q"
        if not any(stem + "MARK" in b or stem + "SENT" in b for b in blobs):
            return stem
        k += 1


def sentinel(stem: str, j: int) -> str:
    return f"{stem}SENT{j:05d}X"


@dataclass(frozen=True, slots=True)
class Alignment:
    """Per sentinel the template writes: (guard start, guard end, real start, real end, message index)."""

    pieces: list[tuple[int, int, int, int, int]]

    def to_real(self, pos: int, where: str) -> int:
        """A position of the guard render in the real one; one inside a sentinel has none."""
        shift = 0
        for g0, g1, _, r1, _ in self.pieces:
            if pos <= g0:
                break
            if pos < g1:
                raise RecordError(f"{where}: its output would begin or end inside another message's text",
                                  "chat_span_ambiguous")
            shift = r1 - g1
        return pos + shift

    def check(self, spans: list[tuple[int, int]], where: str, messages: list[dict]) -> None:
        """No span (guard coordinates) may hold any of another message's text."""
        for g0, g1, r0, r1, j in self.pieces:
            if r1 > r0 and any(a < g1 and g0 < b for a, b in spans):
                raise RecordError(f"{where}: its output would hold the text of turn {j} ({messages[j]['role']}), "
                                  "so packer cannot tell the turns apart", "chat_span_ambiguous")


def _forms(content: str) -> list[str]:
    """How templates write a message's text: as given, trimmed, or as a JSON string (``tojson``, with or
    without its quotes); longest first, so a region is never smaller than the text the template wrote."""
    forms = {content, content.strip(), content.lstrip(), content.rstrip()}
    for ascii_ in (False, True):
        dumped = json.dumps(content, ensure_ascii=ascii_)
        forms |= {dumped, dumped[1:-1]}
    return sorted(forms, key=len, reverse=True)


def align(real: str, guard: str, stem: str, contents: dict[int, str]) -> Alignment:
    """The exact walk of ``guard`` against ``real`` (see the module's docstring); ``contents``: message index ->
    the text its sentinel replaced. Raises ``RecordError(chat_unverifiable)`` where the walk fails."""
    found = list(re.finditer(re.escape(stem) + r"SENT(\d{5})X", guard))
    between = [guard[a:b] for a, b in zip([0] + [m.end() for m in found], [m.start() for m in found] + [len(guard)])]
    seen: set[tuple[int, int]] = set()  # (piece, position) already tried: a failed branch is not walked again

    def walk(k: int, pos: int) -> list[tuple[int, int]] | None:
        if not real.startswith(between[k], pos):
            return None
        pos += len(between[k])
        if k == len(found):
            return [] if pos == len(real) else None
        if (k, pos) in seen:
            return None
        seen.add((k, pos))
        for form in _forms(contents[int(found[k].group(1))]):
            if real.startswith(form, pos) and (rest := walk(k + 1, pos + len(form))) is not None:
                return [(pos, pos + len(form)), *rest]
        return None

    regions = walk(0, 0) if len(found) < 800 else None  # a walk that deep would not fit Python's stack
    if regions is None:
        raise RecordError("packer cannot prove where the template writes the other messages' text (the template "
                          "writes it in a form packer does not check, or renders the conversation differently when "
                          "that text changes), so it cannot tell what is output; give a {% generation %}-tagged "
                          "template with --chat-template", "chat_unverifiable")
    return Alignment([(m.start(), m.end(), r0, r1, int(m.group(1))) for m, (r0, r1) in zip(found, regions)])
