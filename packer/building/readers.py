"""Local data files read record by record, without `datasets`: JSON Lines and JSON by Python's ``json``,
Parquet, Arrow and CSV by pyarrow. (Text files and every Hub dataset are read by `datasets`: see
:mod:`packer.building.sources`.)

Why not `datasets` for these: a JSON line read by ``json.loads`` is the record exactly as written. The
Arrow JSON reader `datasets` uses infers a type per column and block, so a date-like string became a
``datetime`` (``"2020-01-01"`` could not be built as text), a field of mixed object shapes became a JSON
*string*, and a key a record lacks became a ``None`` in it. Reading this way also spares a build
``import datasets`` (about a second of the bundled sample's 6.7 s build before) and its per-block
schema work. Parquet and Arrow files carry their types, which pyarrow's batches give as they are; a
CSV file has none, so every cell is the text it holds.

A record is the n-th record of its file when it is the n-th object on a non-blank line (JSON Lines),
or the n-th item of the top-level array (a JSON document). Every failure is a ``SourceError`` that
names the file and, for JSON, the line.
"""

from __future__ import annotations

import codecs
import csv
import errno
import gzip
import itertools
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import SourceError

OWN = ("json", "parquet", "arrow", "csv")  # the builders (file kinds) read here


def records(builder: str, path: str) -> Iterator[dict[str, Any]]:
    """The records of one local file, in file order."""
    if builder == "json":
        return _json_records(path)
    if builder == "csv":
        return _csv_records(path)
    return _arrow_records(builder, path)


def count(builder: str, path: str, need: int) -> int:
    """How many records the file holds, counted up to ``need`` (more are not looked for), without making
    them where the format allows: non-blank lines of JSON Lines, Parquet's metadata, Arrow's batch
    lengths. A line that is not a record is counted here, and fails the build when it is read."""
    if builder == "csv":  # quoted cells may span lines: the records are parsed, up to need
        return sum(1 for _ in itertools.islice(_csv_records(path), need))
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


def _json_records(path: str) -> Iterator[dict[str, Any]]:
    with _json_errors(path), _open(path) as f:
        if _is_document(f):
            yield from _document_records(path, f)
            return
        for number, raw in _json_lines(f):
            yield _record(path, number, raw)


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _is_document(f) -> bool:
    """Whether the file is one JSON document, an array (else it is JSON Lines); ``f`` is left at its start."""
    start = f.read(1 << 16).lstrip()
    if start.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
        start = start[3:].lstrip()
    f.seek(0)
    return start.startswith(b"[")


def _json_lines(f) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every non-blank line."""
    for number, raw in enumerate(f, start=1):
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
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}:{number}: not UTF-8 text ({e.reason} at byte {e.start} of the line); re-encode "
                          "the file as UTF-8") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        if path.endswith((".json", ".json.gz")) and number == 1:
            _refuse_one_object(path)
        raise SourceError(f"{path}:{number}: malformed JSON ({e.msg}); fix or remove that line") from None
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
    for k, item in enumerate(_array_items(path, f)):
        if isinstance(item, str):  # an array of texts is read as records {"text": ...}, as `datasets` reads it
            item = {"text": item}
        if not isinstance(item, dict):
            raise SourceError(f"{path}: item {k + 1} of the array is {_kind(item)}, not a record ({{...}}); give an "
                              "array of JSON objects")
        if _has_lone_surrogate(item):
            raise SourceError(f"{path}: item {k + 1} holds a \\uXXXX escape of half a surrogate pair (not a "
                              "character); fix that text")
        yield item


_READ = 1 << 20  # bytes read at a time from a JSON array; doubled while one item does not fit
_TAIL = 32  # characters at the end of the text read where a value or an error may be cut short, not end


def _array_items(path: str, f) -> Iterator[Any]:
    """Each value of the top-level array in ``f``, decoded by the stdlib's ``raw_decode`` from a text buffer
    that holds the current item (not the file). A value that reaches the buffer's end may be incomplete
    (a number, a string cut in two): it is decoded again with more text."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8-sig")()
    buf, pos, lines_before, read, eof, want = "", 0, 0, 0, False, _READ

    def more() -> bool:
        nonlocal buf, pos, lines_before, read, eof
        if eof:
            return False
        data = f.read(want)
        try:
            text = utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise SourceError(f"{path}: not UTF-8 text ({e.reason} at byte {read + e.start}); re-encode the file as "
                              "UTF-8") from None
        read += len(data)
        eof = not data
        lines_before += buf.count("\n", 0, pos)
        buf, pos = buf[pos:] + text, 0
        return True

    def malformed(message: str, at: int) -> SourceError:
        return SourceError(f"{path}:{lines_before + buf.count(chr(10), 0, at) + 1}: malformed JSON ({message}); "
                           "fix the document")

    def skip_space() -> str:
        """The next character that is not white space ("" at the end of the file)."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not more():
                return buf[pos] if pos < len(buf) else ""

    skip_space()
    pos += 1  # the "[" that _is_document saw
    if skip_space() == "]":
        pos += 1
    else:
        while True:
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except RecursionError:
                    raise SourceError(f"{path}: JSON nested too deeply to read (over ~1,000 levels); flatten its "
                                      "records") from None
                except json.JSONDecodeError as e:
                    # an error well before the text's end is one (a string may be longer than the text read)
                    final = len(buf) - e.pos > _TAIL and not e.msg.startswith("Unterminated string")
                    if not final and more():
                        want *= 2
                        continue
                    raise malformed(e.msg, e.pos) from None
                if eof or len(buf) - end > _TAIL:
                    break
                want *= 2
                more()  # a value that ends near the text read so far may go on ("1e" of "1e5")
            pos = end
            yield value
            want = _READ
            after = skip_space()
            pos += 1
            if after == "]":
                break
            if after != ",":
                raise malformed("expecting ',' or ']' after an item" if after else "the array is not closed", pos - 1)
            skip_space()
    if skip_space():
        raise malformed("extra data after the array", pos)


def _refuse_one_object(path: str) -> None:
    """A .json file whose whole text is one object (not an array, not one object per line) says so."""
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            document = json.loads(f.read().decode("utf-8-sig"))
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


def _csv_records(path: str) -> Iterator[dict[str, Any]]:
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
    convert = pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True,
                                  null_values=[""])
    with _arrow_errors("csv", path):
        reader = pcsv.open_csv(path, parse_options=pcsv.ParseOptions(newlines_in_values=True),
                               convert_options=convert)
        for batch in reader:
            yield from batch.to_pylist()


def _arrow_records(builder: str, path: str) -> Iterator[dict[str, Any]]:
    with _arrow_errors(builder, path):
        for batch in _arrow_batches(builder, path):
            yield from batch.to_pylist()


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
