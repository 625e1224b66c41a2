"""Local data files read record by record, without `datasets`: JSON Lines and JSON by Python's ``json``,
Parquet, Arrow and CSV by pyarrow, text line by line as `datasets`' text builder reads it. (Every Hub
dataset is read by `datasets`: see :mod:`packer.building.sources`.)

Why not `datasets` for these: a JSON line read by ``json.loads`` is the record exactly as written. The
Arrow JSON reader `datasets` uses infers a type per column and block, so a date-like string became a
``datetime`` (``"2020-01-01"`` could not be built as text), a field of mixed object shapes became a JSON
*string*, and a key a record lacks became a ``None`` in it. Reading this way also spares a build
``import datasets`` (about a second of the bundled sample's 6.7 s build before) and its per-block
schema work. Parquet and Arrow files carry their types, which pyarrow's batches give as they are; a
CSV file has none, so every cell is the text it holds.

A record is the n-th record of its file when it is the n-th object on a non-blank line (JSON Lines),
or the n-th item of the top-level array (a JSON document). Every failure is a ``SourceError`` that
names the file and, for JSON, the line. A record that cannot be made (over ``MAX_RECORD_BYTES``, text
that is not UTF-8, a JSON line that does not parse) is found on the stream, before it is held, and stays in it as a placeholder
(``unreadable``) that the formatter refuses as a ``RecordError``: one line, or under ``--on-error skip``
skipped and counted.
"""

from __future__ import annotations

import codecs
import csv
import errno
import gzip
import itertools
import json
import os
import re
import zlib
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import SourceError
from .formatting import UNREADABLE

OWN = ("json", "parquet", "arrow", "csv", "text")  # the builders (file kinds) read here

# The most bytes of JSON one record may take, checked as it is read, before it is held whole (a gzip'd
# line of 2 GB characters is 9 MB on disk, and reading it whole took 6.4 GB): 16 bytes for each of the
# 4,194,304 characters a record's text may have (``tokenization.MAX_RECORD_CHARS``), so a text at that
# limit written entirely in \uXXXX escapes still fits, with room for fields the format does not use.
MAX_RECORD_BYTES = 1 << 26
def unreadable(message: str, reason: str) -> dict[str, Any]:
    """A record that cannot be made, as the placeholder the formatter refuses (or ``--on-error skip`` counts)."""
    return {UNREADABLE: (message, reason)}


def _too_large(where: str) -> dict[str, Any]:
    return unreadable(f"{where} holds over {MAX_RECORD_BYTES:,} bytes of JSON, more than a record may have (its text "
                      "may have 4,194,304 characters); split it into several records", "too_long")


def records(builder: str, path: str, skip: int = 0) -> Generator[dict[str, Any], None, int]:
    """The records of one local file, in file order, from its ``skip``-th on; the generator returns how many it
    passed over (all the file holds, when that is fewer than ``skip``).

    Records passed over are not made where the format allows: a JSON line's bytes are read and not parsed (a
    tenth of the cost), a Parquet, Arrow or CSV batch wholly before them is not converted to Python; a JSON
    document's items and text lines are made and dropped. So they are not checked either: only records that a
    run over the same bytes has read already are passed over (a resumed spill, a token store entry's extension,
    both keyed by the source's sha256)."""
    if builder == "json":
        return _json_records(path, skip)
    if builder == "csv":
        return _csv_records(path, skip)
    if builder == "text":
        return _passing(_text_records(path), skip)
    return _arrow_records(builder, path, skip)


def _passing(made: Iterator[dict[str, Any]], skip: int) -> Generator[dict[str, Any], None, int]:
    """``made``'s records from its ``skip``-th on, those before made and dropped; returns how many were."""
    passed = 0
    for record in made:
        if passed < skip:
            passed += 1
            continue
        yield record
    return passed


def count(builder: str, path: str, need: int) -> int:
    """How many records the file holds, counted up to ``need`` (more are not looked for), without making
    them where the format allows: non-blank lines of JSON Lines, Parquet's metadata, Arrow's batch
    lengths. A line that is not a record is counted here, and fails the build when it is read."""
    if builder in ("csv", "text"):  # quoted cells may span lines: the records are parsed, up to need
        return sum(1 for _ in itertools.islice(records(builder, path), need))
    if builder != "json":
        with _arrow_errors(builder, path):
            if builder == "parquet":
                import pyarrow.parquet as pq

                with pq.ParquetFile(path) as f:
                    return f.metadata.num_rows
            return sum(batch.num_rows for batch in _arrow_batches(builder, path))
    with _json_errors(path), _open(path) as f:
        if _is_document(f):
            return sum(1 for _ in itertools.islice(_document_records(path, f), need))
        n = 0
        for _ in _json_lines(f):
            n += 1
            if n >= need:
                break
        return n


# What a progress bar's total may read, across all the files of a source, before the build starts: 256 MB of
# plain bytes, an inflated gzip byte costing GZIP_COST of them (so 32 MB inflated). Measured from the page
# cache: counting the line breaks of 307 MB of JSON Lines took 0.13 s (2.4 GB/s), inflating the same records
# gzip'd 1.6 s (190 MB/s of text; 840 MB/s for very repetitive text): about a tenth of a second either way
# (half a second read cold from an SSD). The files past it are estimated from their sizes.
BUDGET, GZIP_COST = 256 << 20, 8
SAMPLED = 1 << 20  # the first file of its kind (gzip'd or not) is read this far at least, to know its lines a byte
_BLOCK = 1 << 20


def total(builder: str, paths: Sequence[str], limit: int | None = None) -> int | None:
    """About how many records the files hold, for a progress bar's total only: cheap, nothing parsed.
    Parquet's metadata and Arrow's batch lengths are exact, and under a ``limit`` all that is looked at
    (else the limit is the total: its records are read by the build itself, never once more to count them).
    JSON Lines, CSV and text are counted by their line breaks (a blank JSON line or a cell over several
    lines make it a little high), file after file while ``BUDGET`` lasts; a file past it is estimated from
    its size and the lines a byte held in the files counted (of its kind: gzip'd or not), a file the budget
    ends in from its part counted. (A JSON file past the budget is taken for JSON Lines.) A JSON document
    (an array): None, its items are found only by parsing it."""
    try:
        if builder in ("parquet", "arrow"):
            n = sum(count(builder, path, 1 << 62) for path in paths)
            return n if limit is None else min(n, limit)
        if limit is not None:
            return limit
        left, lines, seen = BUDGET, 0.0, {False: [0, 0], True: [0, 0]}  # gzip'd or not: [lines, bytes on disk]
        for path in paths:
            gz, size = path.endswith(".gz"), os.path.getsize(path)
            cost, measured = (GZIP_COST if gz else 1), seen[gz]
            if left // cost <= 0 and measured[1]:  # the lines its bytes hold, as in the files counted
                lines += size * measured[0] / measured[1] - (builder == "csv")
                continue
            counted = _line_breaks(builder, path, left // cost if measured[1] else max(left // cost, SAMPLED))
            if counted is None:
                return None
            n, took, read = counted
            left -= cost * read
            measured[0] += n
            measured[1] += took
            lines += n * size / max(1, took) - (builder == "csv")
    except (OSError, EOFError, zlib.error, SourceError):
        return None  # the reading itself says what is wrong with the file
    return max(0, round(lines))


def _line_breaks(builder: str, path: str, most: int) -> tuple[int, int, int] | None:
    """(lines in the file's first ``most`` bytes, a last one without a break counted; the bytes of the file
    they took, on disk; the bytes read, gzip'd: inflated), or None for a JSON document. A gzip file whose
    data is all read when ``most`` is reached (4 kB at a time) is counted to its end: the rest is in hand."""
    size = os.path.getsize(path)
    with _open(path, measured=True) as f:
        if builder == "json" and _is_document(f):
            return None
        lines, read, last = 0, 0, b"\n"
        while read < most or (path.endswith(".gz") and f.fileobj.tell() >= size):
            block = f.read(min(_BLOCK, most - read) if read < most else _BLOCK)
            if not block:
                return lines + (last != b"\n"), size, read
            lines += block.count(b"\n")
            read += len(block)
            last = block[-1:]
        return lines, (f.fileobj if path.endswith(".gz") else f).tell(), read


def _json_records(path: str, skip: int = 0) -> Generator[dict[str, Any], None, int]:
    with _json_errors(path), _open(path) as f:
        if _is_document(f):
            return (yield from _passing(_document_records(path, f), skip))
        passed = 0
        for number, raw in _json_lines(f):
            if passed < skip:  # a record's line, passed over unparsed (its number still counted)
                passed += 1
                continue
            yield _too_large(f"{path}:{number}: the line") if raw is None else _record(path, number, raw)
        return passed


def _open(path: str, measured: bool = False):
    """The file's bytes (gzip'd: inflated); ``measured``: its gzip data read 4 kB at a time, so that how
    far into the file the text read took is known that closely (``f.fileobj.tell()``; gzip reads 128 kB
    ahead), for a progress bar's estimate."""
    if not path.endswith(".gz"):
        return open(path, "rb")
    return _MeasuredGzip(path) if measured else gzip.open(path, "rb")


class _Trickle:
    """A file read at most 4 kB a call."""

    def __init__(self, raw):
        self._raw = raw

    def read(self, n: int = -1) -> bytes:
        return self._raw.read(4096 if n < 0 else min(n, 4096))

    def __getattr__(self, name):
        return getattr(self._raw, name)


class _MeasuredGzip(gzip.GzipFile):
    """A gzip file read from a :class:`_Trickle`, which it closes."""

    def __init__(self, path: str):
        self._raw = open(path, "rb")  # noqa: SIM115 (closed with this)
        super().__init__(fileobj=_Trickle(self._raw), mode="rb")

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def _is_document(f) -> bool:
    """Whether the file is one JSON document, an array (else it is JSON Lines); ``f`` is left at its start."""
    start = f.read(1 << 16).lstrip()
    if start.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
        start = start[3:].lstrip()
    f.seek(0)
    return start.startswith(b"[")


def _json_lines(f) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) of every non-blank line; the line is None where it is over ``MAX_RECORD_BYTES``,
    which is passed over a block at a time, never held (``readline`` with a limit)."""
    number = 0
    while raw := f.readline(MAX_RECORD_BYTES + 1):
        number += 1
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(_READ)
            yield number, None
            continue
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if raw.strip():
            yield number, raw


@contextmanager
def _json_errors(path: str):
    """Reading failures of a JSON file as one-line ``SourceError``s (a gzip one names the file only: gzip
    reads ahead, so a line number would be a guess)."""
    try:
        yield
    except EOFError:
        raise SourceError(f"{path}: the gzip data ends early (a truncated file); download or compress it again") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        with open(path, "rb") as raw:
            where = "corrupt or extra data after the gzip data" if raw.read(2) == b"\x1f\x8b" else "not gzip data"
        raise SourceError(f"{path}: {where} ({e}); check the file is a complete .gz, or drop the .gz suffix if it "
                          "is plain text") from None
    except OSError as e:
        raise _unreadable(path, e) from None


def _unreadable(path: str, e: OSError) -> SourceError:
    if e.errno == errno.EMFILE or "Too many open files" in str(e):
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return SourceError(f"{path}: cannot be opened: this process has the {limit:,} files it may open in use "
                           "(ulimit -n), and a mix keeps one open for each part; raise the limit or merge parts into "
                           "fewer sources")
    return SourceError(f"{path}: cannot be read ({e.strerror or e}); check the file")


def _record(path: str, number: int, raw: bytes) -> dict[str, Any]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # the line's alone: the next lines are read as they are
        return unreadable(f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start} of the line); re-encode the "
                          "file as UTF-8", "not_utf8")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        if path.endswith((".json", ".json.gz")) and number == 1:
            _refuse_one_object(path)
        # the line's alone (the next lines are read as they are): one line, or under --on-error skip counted
        return unreadable(f"{path}:{number}: malformed JSON ({e.msg}); fix or remove that line", "malformed_json")
    except RecursionError:
        raise SourceError(f"{path}:{number}: JSON nested too deeply to read (over ~1,000 levels); flatten or remove "
                          "that record") from None
    if not isinstance(record, dict):
        raise SourceError(f"{path}:{number}: {_kind(record)}, not a record ({{...}}); each line must hold one JSON object")
    if b"\\u" in raw and _has_lone_surrogate(record):  # json accepts "\ud800"; no tokenizer or Arrow file does
        raise SourceError(f"{path}:{number}: a \\uXXXX escape of half a surrogate pair (not a character); fix that text")
    return record


def _document_records(path: str, f) -> Iterator[dict[str, Any]]:
    """The items of a top-level JSON array, parsed one at a time from ``f`` (so ``--limit 10`` of a
    large array reads about 10 items' bytes, and no item is held after it is yielded)."""
    for k, item in enumerate(_Array(path, f).items()):
        if item is _OVERSIZE:
            yield _too_large(f"{path}: item {k + 1} of the array")
            continue
        if isinstance(item, str):  # an array of texts is read as records {"text": ...}, as `datasets` reads it
            item = {"text": item}
        if not isinstance(item, dict):
            raise SourceError(f"{path}: item {k + 1} of the array is {_kind(item)}, not a record ({{...}}); give an "
                              "array of JSON objects")
        if _has_lone_surrogate(item):  # bytes that are not UTF-8 (decoded as lone surrogates), or such an escape
            yield unreadable(f"{path}: item {k + 1} of the array holds text that is not UTF-8, or a \\uXXXX escape of half a "
                             "surrogate pair (not a character); re-encode or fix that text", "not_utf8")
            continue
        yield item


_READ = 1 << 20  # bytes read at a time from a JSON array; doubled while one item does not fit
_OVERSIZE = object()  # an array item over MAX_RECORD_BYTES, passed over unread
# what ends a stretch of an item passed over: in a string, its quote or a backslash; outside, a bracket or quote
_IN_STRING, _OUTSIDE = re.compile(r'["\\]'), re.compile(r'["\[\]{},]')
_TAIL = 32  # characters at the end of the text read where a value or an error may be cut short, not end


class _Array:
    """The values of the top-level array in ``f``, decoded by the stdlib's ``raw_decode`` from a text buffer
    that holds the current item (not the file). A value that reaches the buffer's end may be incomplete
    (a number, a string cut in two): it is decoded again with more text. An item over ``MAX_RECORD_BYTES``
    is passed over a block at a time (``_OVERSIZE``)."""

    def __init__(self, path: str, f):
        self.path, self.f = path, f
        self.decoder = json.JSONDecoder()
        # bytes that are not UTF-8 become lone surrogates, found in their item (_document_records)
        self.utf8 = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogateescape")
        self.buf, self.pos, self.lines_before, self.read, self.eof, self.want = "", 0, 0, 0, False, _READ

    def more(self) -> bool:
        """Read the next ``want`` bytes onto the text after ``pos`` (what is before it is dropped)."""
        if self.eof:
            return False
        data = self.f.read(self.want)
        try:
            text = self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise SourceError(f"{self.path}: not UTF-8 text ({e.reason} at byte {self.read + e.start}); re-encode the "
                              "file as UTF-8") from None
        self.read += len(data)
        self.eof = not data
        self.lines_before += self.buf.count("\n", 0, self.pos)
        self.buf, self.pos = self.buf[self.pos:] + text, 0
        return True

    def malformed(self, message: str, at: int) -> SourceError:
        return SourceError(f"{self.path}:{self.lines_before + self.buf.count(chr(10), 0, at) + 1}: malformed JSON "
                           f"({message}); fix the document")

    def skip_space(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def items(self) -> Iterator[Any]:
        self.skip_space()
        self.pos += 1  # the "[" that _is_document saw
        if self.skip_space() == "]":
            self.pos += 1
        else:
            while True:
                value, self.pos = self.value()
                yield value
                self.want = _READ
                after = self.skip_space()
                self.pos += 1
                if after == "]":
                    break
                if after != ",":
                    raise self.malformed("expecting ',' or ']' after an item" if after else "the array is not closed",
                                         self.pos - 1)
                self.skip_space()
        if self.skip_space():
            raise self.malformed("extra data after the array", self.pos)

    def value(self) -> tuple[Any, int]:
        """The item at ``pos`` and where it ends, read on until it is whole."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except RecursionError:
                raise SourceError(f"{self.path}: JSON nested too deeply to read (over ~1,000 levels); flatten its "
                                  "records") from None
            except json.JSONDecodeError as e:
                # an error well before the text's end is one (a string may be longer than the text read)
                final = len(self.buf) - e.pos > _TAIL and not e.msg.startswith("Unterminated string")
                if not final and len(self.buf) - self.pos > MAX_RECORD_BYTES:
                    return _OVERSIZE, self.pass_over()
                if not final and self.more():
                    self.want *= 2
                    continue
                raise self.malformed(e.msg, e.pos) from None
            if end - self.pos > MAX_RECORD_BYTES:  # decoded, but no smaller for that: refused as any larger one
                return _OVERSIZE, end
            if self.eof or len(self.buf) - end > _TAIL:
                return value, end
            self.want *= 2
            self.more()  # a value that ends near the text read so far may go on ("1e" of "1e5")

    def next_block(self, keep: int) -> int:
        """Drop the text before ``keep`` and read on; where ``keep`` is now."""
        self.pos = keep
        if not self.more():
            raise self.malformed("the array is not closed", len(self.buf))
        return self.pos

    def pass_over(self) -> int:
        """Where the item at ``pos`` ends, read a block at a time and dropped as it is passed (the rest
        of the array's syntax is checked as it is decoded after it)."""
        depth, in_string, at = 0, False, self.pos
        self.want = _READ
        while True:
            if at >= len(self.buf):
                at = self.next_block(at)
                continue
            hit = (_IN_STRING if in_string else _OUTSIDE).search(self.buf, at)
            if hit is None:
                at = len(self.buf)
                continue
            c, at = hit.group(), hit.end()
            if in_string:
                if c == "\\":  # the escaped character, maybe in the next block, is passed over
                    if at >= len(self.buf):
                        at = self.next_block(at - 1) + 1
                    at += 1
                    continue
                in_string = False
                if depth == 0:
                    return at
            elif c == '"':
                in_string = True
            elif c in "[{":
                depth += 1
            elif depth == 0:  # the "," or "]" after a number or literal
                return hit.start()
            elif c in "]}":
                depth -= 1
                if depth == 0:
                    return at


def _refuse_one_object(path: str) -> None:
    """A .json file whose whole text is one object (not an array, not one object per line) says so."""
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            text = f.read(MAX_RECORD_BYTES + 1)  # a larger document is no one object worth naming
            if len(text) > MAX_RECORD_BYTES:
                return
            document = json.loads(text.decode("utf-8-sig"))
    except (ValueError, RecursionError, OSError, EOFError):
        return
    if isinstance(document, dict):
        keys = ", ".join(list(document)[:5])
        raise SourceError(f"{path}: holds one JSON object (keys {keys}), not records; give an array of records, or "
                          "one record per line (JSON Lines)")


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null", dict: "an object"}.get(
        type(value), "a number")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(map(_has_lone_surrogate, value))
    return False


def _text_records(path: str) -> Iterator[dict[str, Any]]:
    """Each line a record ``{"text": line}``, as `datasets`' text builder reads a file (which builds read
    before): UTF-8, universal newlines, the line break dropped, blank lines kept. A line over
    ``MAX_RECORD_BYTES`` characters is passed over a block at a time (that builder read it whole: 2 GB of
    memory for a line of 256 MB)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:  # a line that is not UTF-8: its own
            number = 0
            while line := f.readline(MAX_RECORD_BYTES + 1):
                number += 1
                if len(line) > MAX_RECORD_BYTES and not line.endswith("\n"):
                    while line and not line.endswith("\n"):
                        line = f.readline(_READ)
                    yield unreadable(f"{path}:{number}: the line holds over {MAX_RECORD_BYTES:,} characters, more than a record "
                                     "may have (4,194,304); split it into several lines", "too_long")
                    continue
                if _has_lone_surrogate(line):
                    yield unreadable(f"{path}:{number}: not UTF-8 text; re-encode the file as UTF-8", "not_utf8")
                    continue
                yield {"text": line.removesuffix("\n")}
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text ({e.reason}); re-encode the file as UTF-8") from None
    except OSError as e:
        raise _unreadable(path, e) from None


def _csv_records(path: str, skip: int = 0) -> Generator[dict[str, Any], None, int]:
    """Every cell as the text it is (a CSV file has no types: `datasets`' pandas reader made a column of
    numbers floats, and "4" a completion the build refused as not text); an empty cell is null.
    Quoted cells may span lines."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    try:
        with open(path, "rb") as f:
            names = next(csv.reader([f.readline().decode("utf-8-sig")]), [])
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}:1: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as UTF-8") from None
    except csv.Error as e:
        raise SourceError(f"{path}:1: the header line is not CSV ({e}); fix it") from None
    except OSError as e:
        raise _unreadable(path, e) from None
    _refuse_duplicates(path, names, "the header line")
    # check_utf8 off: a row that is not UTF-8 is found by _batch_records, and --on-error skip skips it alone
    convert = pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True,
                                  null_values=[""], check_utf8=False)
    with _arrow_errors("csv", path):
        # a row must fit in one block: a block of the record bound reads every row a record may be
        reader = pcsv.open_csv(path, read_options=pcsv.ReadOptions(block_size=MAX_RECORD_BYTES),
                               parse_options=pcsv.ParseOptions(newlines_in_values=True), convert_options=convert)
        return (yield from _batches_from(path, reader, skip))


def _arrow_records(builder: str, path: str, skip: int = 0) -> Generator[dict[str, Any], None, int]:
    with _arrow_errors(builder, path):
        return (yield from _batches_from(path, _arrow_batches(builder, path), skip))


def _batches_from(path: str, batches, skip: int) -> Generator[dict[str, Any], None, int]:
    """The records of ``batches`` from the ``skip``-th on: a batch wholly before it is not converted; returns how
    many were passed over."""
    row = 0
    for batch in batches:
        if row + batch.num_rows <= skip:
            row += batch.num_rows
            continue
        lo = max(0, skip - row)
        yield from _batch_records(path, batch.slice(lo) if lo else batch, row + lo)
        row += batch.num_rows
    return min(row, skip)


def _batch_records(path: str, batch, first: int) -> Iterator[dict[str, Any]]:
    """A batch's records, where each can be made: a row whose strings are not UTF-8 (Parquet and Arrow files
    do not check it) or whose strings hold over ``MAX_RECORD_BYTES`` is its placeholder (``unreadable``),
    found before it is made into Python objects."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = None
    for column in batch.columns:  # the strings of the top-level columns, measured in place
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_binary(column.type):
            n = pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)
            sizes = n if sizes is None else sizes + n
    big = set() if sizes is None else set((sizes > MAX_RECORD_BYTES).nonzero()[0].tolist())
    if not big:
        try:
            yield from batch.to_pylist()
            return
        except UnicodeDecodeError:
            pass  # which rows: one at a time below
    for i in range(batch.num_rows):
        if i in big:
            yield unreadable(f"{path}: row {first + i + 1} holds over {MAX_RECORD_BYTES:,} bytes of text, more than a record "
                             "may have (its text may have 4,194,304 characters); split it into several rows", "too_long")
            continue
        one = batch.slice(i, 1)
        try:
            yield one.to_pylist()[0]
        except UnicodeDecodeError as e:
            name = next((n for n, c in zip(one.schema.names, one.columns, strict=True) if _not_utf8(c)), "?")
            yield unreadable(f"{path}: row {first + i + 1}, column {name!r}: not UTF-8 text ({e.reason} at byte {e.start}); "
                             "re-encode the file's text as UTF-8", "not_utf8")


def _not_utf8(column) -> bool:
    try:
        column.to_pylist()
        return False
    except UnicodeDecodeError:
        return True


@contextmanager
def _arrow_errors(builder: str, path: str):
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and (e.errno == errno.EMFILE or "Too many open files" in str(e)):
            raise _unreadable(path, e) from None
        if "invalid UTF8" in str(e):
            raise SourceError(f"{path}: not UTF-8 text; re-encode the file as UTF-8") from None
        if "straddl" in str(e):  # pyarrow's CSV reader: a row larger than the block it reads
            raise SourceError(f"{path}: a row holds over {MAX_RECORD_BYTES:,} bytes, more than a record may have (its "
                              "text may have 4,194,304 characters); split it into several rows") from None
        raise SourceError(f"{path}: cannot be read as {builder} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "check the file is complete and of that type") from None


def _refuse_duplicates(path: str, names: list[str], where: str) -> None:
    """A record is a mapping: of two columns of one name only the last would be kept, silently."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise SourceError(f"{path}: {where} names the column {name!r} twice, and a record keeps only one of "
                              "them; rename or remove one")
        seen.add(name)


def _arrow_batches(builder: str, path: str):
    import pyarrow as pa

    if builder == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            _refuse_duplicates(path, f.schema_arrow.names, "the Parquet schema")
            yield from f.iter_batches(batch_size=1000)
        return
    with pa.memory_map(path) as source:  # Arrow IPC: the stream format (`datasets`' .arrow files), or the file format
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            _refuse_duplicates(path, reader.schema.names, "the Arrow schema")
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        _refuse_duplicates(path, reader.schema.names, "the Arrow schema")
        yield from reader
