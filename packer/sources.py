"""Reading inputs through `datasets`: a recipe, a local file/folder/glob, or a Hub dataset id.

``resolve`` decides what SOURCE names (cheap, no I/O beyond globbing); ``load`` opens it as a
`datasets.Dataset` (Arrow-backed, memory-mapped from the datasets cache) and turns every failure into
a one-line `SourceError` that names the file, the line where it can, and the fix.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .errors import ConfigError, SourceError
from .pages import drop_mapped_pages, mapped_files
from .recipes import RECIPES, Recipe, get_recipe

# file suffix -> datasets packaged builder
BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    kind: str  # "local" or "hub"
    name: str  # what the user gave, for messages
    recipe: Recipe | None
    builder: str | None = None  # local: the datasets builder
    files: tuple[str, ...] = ()  # local: the files, sorted
    hub_id: str | None = None
    hub_config: str | None = None
    split: str = "train"


def _builder_for(path: str) -> str | None:
    lower = path.lower()
    for suffix in sorted(BUILDERS, key=len, reverse=True):
        if lower.endswith(suffix):
            return BUILDERS[suffix]
    return None


def _local_files(source: str) -> list[str] | None:
    """The files SOURCE names (file, folder or glob), or None if it names nothing local."""
    path = Path(source).expanduser()
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and _builder_for(p.name))
        if not files:
            raise SourceError(
                f"{source}: folder holds no readable data files ({', '.join(sorted(BUILDERS))}); "
                "point SOURCE at the files"
            )
        return files
    if glob.has_magic(source):
        files = sorted(p for p in glob.glob(os.path.expanduser(source), recursive=True) if os.path.isfile(p))
        if not files:
            raise SourceError(f"{source}: the pattern matches no files; check the path and quote the glob")
        return files
    return None


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def resolve(source: str, *, recipe: str | None = None, split: str | None = None, from_hub: bool = False) -> Source:
    named = get_recipe(recipe) if recipe else None
    # A file or folder on disk wins over a recipe or Hub id of the same name (as over a Hub id, below);
    # a recipe's name then still sets the formatting, as --recipe does.
    on_disk = source in RECIPES and Path(source).expanduser().exists()
    if source in RECIPES and not on_disk:
        if named is not None and named.name != source:
            raise ConfigError(f"SOURCE is the recipe {source!r} but --recipe says {named.name!r}; give one")
        r = RECIPES[source]
        if r.local is not None and not from_hub:
            if not r.local.is_file():
                raise SourceError(
                    f"recipe {r.name!r}: bundled file {r.local} is missing; regenerate it with "
                    "`python data/make_flan_sample.py` or pass --from-hub"
                )
            return Source(kind="local", name=r.name, recipe=r, builder=_builder_for(r.local.name), files=(str(r.local),))
        return Source(kind="hub", name=r.name, recipe=r, hub_id=r.hub_id, hub_config=r.hub_config, split=split or r.split)
    files = _local_files(source)
    if files is not None:
        for f in files:
            if not _is_utf8(f):
                raise SourceError(
                    f"{os.fsencode(f).decode('utf-8', 'backslashreplace')}: the file name is not UTF-8 text, "
                    "which the manifest records; rename it"
                )
        builders = {_builder_for(f) for f in files}
        if None in builders:
            bad = next(f for f in files if _builder_for(f) is None)
            raise SourceError(f"{bad}: unknown file type; packer reads {', '.join(sorted(BUILDERS))}")
        if len(builders) > 1:
            raise SourceError(f"{source}: mixes file types ({', '.join(sorted(builders))}); give files of one type")
        if split not in (None, "train"):
            raise ConfigError(f"--split {split!r} applies to Hub datasets; a local source is one split")
        if on_disk and named is None:
            named = RECIPES[source]
        return Source(kind="local", name=source, recipe=named, builder=builders.pop(), files=tuple(files))
    if _builder_for(source) or source.startswith((".", "/", "~")) or os.sep + os.sep in source:
        raise SourceError(f"{source}: no such file or folder; check the path")
    if HUB_ID.match(source):
        return Source(kind="hub", name=source, recipe=named, hub_id=source, split=split or "train")
    raise SourceError(
        f"unknown recipe {source!r}; known recipes: {', '.join(RECIPES)}. For a local file give its path, "
        "for a Hub dataset its full id (owner/name)"
    )


def _first_bad_json_line(path: str) -> tuple[int, str] | None:
    """(line number, what is wrong) of the first line that is not UTF-8 or not JSON (line 0: a .gz that
    is not whole gzip data); None if all is fine."""
    import gzip
    import zlib

    number = 0
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            if path.endswith((".json", ".json.gz")):
                try:
                    json.loads(f.read().decode("utf-8"))
                    return None
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    f.seek(0)  # not one document (or not UTF-8): find the line
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return number, f"not UTF-8 text ({e.reason} at byte {e.start} of the line); re-encode the file as UTF-8"
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        return number, f"malformed JSON ({e.msg}); fix or remove that line"
                    except RecursionError:
                        return number, "JSON nested too deeply to read (over ~1,000 levels); flatten or remove that record"
                    if not isinstance(record, dict):
                        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
                            type(record), "a number")
                        return number, f"{kind}, not a record ({{...}}); each line must hold one JSON object"
                    try:  # Python's json accepts a lone surrogate escape (\ud800), Arrow does not
                        json.dumps(record, ensure_ascii=False).encode("utf-8")
                    except UnicodeEncodeError:
                        return number, "a \\uXXXX escape of half a surrogate pair (not a character); fix that text"
    # gzip reads ahead: a line number would be a guess, so these name the file only (line 0)
    except EOFError:
        return 0, "the gzip data ends early (a truncated file); download or compress it again"
    except (gzip.BadGzipFile, zlib.error) as e:
        where = "not gzip data" if number == 0 else "corrupt or extra data after the gzip data"
        return 0, f"{where} ({e}); check the file is a complete .gz, or drop the .gz suffix if it is plain text"
    return None


def _explain_local_failure(source: Source, error: BaseException) -> SourceError:
    if source.builder == "json":
        for path in source.files:
            bad = _first_bad_json_line(path)
            if bad is not None:
                line, msg = bad
                return SourceError(f"{path}:{line}: {msg}" if line else f"{path}: {msg}")
    if isinstance(error, UnicodeDecodeError) or isinstance(error.__cause__, UnicodeDecodeError):
        return SourceError(f"{source.name}: not UTF-8 text; re-encode the file as UTF-8")
    cause = error.__cause__ or error.__context__ or error
    return SourceError(
        f"{source.name}: cannot be read as {source.builder} ({type(cause).__name__}: {str(cause).splitlines()[0][:200]}); "
        "check the file is complete and of that type"
    )


def _cache_full(error: BaseException) -> SourceError | None:
    """The error of a datasets cache that cannot be written (disk full, quota, a file size limit), which
    is no fault of the input; None for any other failure."""
    import errno

    from datasets import config

    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            reason = "a file size limit (ulimit -f) was reached" if seen.errno == errno.EFBIG else "no space left"
            return SourceError(
                f"the datasets cache {config.HF_DATASETS_CACHE} cannot be written ({reason}) while converting the "
                "input to Arrow; free space there or set HF_DATASETS_CACHE to a larger disk"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True  # offline mode reads the local cache; let datasets say whether it is there
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _validate(dataset, step: int = 64 << 20) -> None:
    """``validate(full=True)`` batch by batch, unmapping the cache pages read every ``step`` bytes:
    validating reads the whole memory-mapped table, which would otherwise stay in the resident set."""
    mapped, seen = mapped_files(dataset), 0
    for batch in dataset.data.table.to_batches():
        batch.validate(full=True)
        seen += batch.nbytes
        if seen >= step:
            drop_mapped_pages(mapped)
            seen = 0
    drop_mapped_pages(mapped)


def load(source: Source, *, progress: bool = False):
    """Open SOURCE as a `datasets.Dataset`."""
    import datasets
    from datasets.exceptions import DatasetsError

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures become one SourceError below
    if progress:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    if source.kind == "local":
        if all(os.path.getsize(f) == 0 for f in source.files):
            raise SourceError(f"{source.name}: empty file, holds no records; check the file")
        try:
            dataset = datasets.load_dataset(source.builder, data_files=list(source.files), split="train")
            _validate(dataset)  # pyarrow's JSON reader lets invalid UTF-8 into strings
        except (DatasetsError, ValueError, OSError, UnicodeDecodeError, StopIteration, EOFError, RecursionError) as e:
            raise (_cache_full(e) or _explain_local_failure(source, e)) from e
        return dataset
    if not _hub_reachable():
        raise SourceError(
            f"cannot reach the Hugging Face Hub for {source.hub_id!r} (no network); download it on a connected "
            "machine (`huggingface-cli download --repo-type dataset ...`) and pass the local files, or use the "
            "bundled `flan` recipe"
        )
    try:
        return datasets.load_dataset(source.hub_id, source.hub_config, split=source.split)
    except (DatasetsError, ConnectionError, OSError, ValueError) as e:
        raise SourceError(
            f"{source.hub_id}: cannot load split {source.split!r} from the Hugging Face Hub "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); check the id, --split and your network"
        ) from e
