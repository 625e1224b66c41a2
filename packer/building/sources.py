"""Reading inputs as a stream: a recipe, a local file/folder/glob, or a Hub dataset id.

``resolve`` decides what SOURCE names (cheap, no I/O beyond listing); ``open_stream`` opens it as a
:class:`Stream`, records read in order, a chunk at a time: local JSON, Parquet, Arrow, CSV and text files
by :mod:`packer.building.readers`, Hub datasets through `datasets`' streaming readers (an
``IterableDataset``). Nothing is converted to an Arrow cache and nothing is downloaded whole, so
``--limit N`` reads about N records and stops (a Hub dataset's later shards are never fetched, a local
file is read only as far as its first N records). Every failure, at opening or mid-way, becomes a
one-line `SourceError` that names the file, the line where it can, and the fix.

A folder is read the way the Hub reads a dataset repository (`datasets`' own data-file patterns):
``data/train-*`` and ``data/test-*`` are two splits and ``--split`` picks one; hidden files and folders
(a leading ``.``) are skipped. A glob reads each file once, however many symlinks lead to it.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..contract.recipes import RECIPES, Recipe, get_recipe
from ..errors import ConfigError, PackerError, SourceError
from ..fs import expand_user
from . import hub, readers

BATCH = 1000  # records per read when only counting or peeking

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
    data_files: str | None = None  # hub: the files of the repo to read (a pattern), else its default split files
    split: str = "train"


def _builder_for(path: str) -> str | None:
    lower = path.lower()
    for suffix in sorted(BUILDERS, key=len, reverse=True):
        if lower.endswith(suffix):
            return BUILDERS[suffix]
    return None


def _local_files(source: str, split: str | None) -> tuple[list[str], bool] | None:
    """(the files SOURCE names, whether it chose a split), or None if it names nothing local.

    A folder is resolved by `datasets`' own data-file patterns, as a Hub dataset repository is: splits
    by file or folder name (``data/train-00000-of-00002.parquet``, ``test/``), hidden files and folders
    skipped, symlinked folders not followed. A glob is expanded by ``glob`` and each file kept once
    (by its real path), so a symlink loop cannot make one file be read many times.
    """
    if source == "":
        raise SourceError("SOURCE is empty; give a recipe, a file, a folder, a glob or a Hub id")
    path = expand_user(source, "source", SourceError)
    if path.is_file():
        return [str(path)], False
    if path.is_dir():
        from datasets.data_files import DataFilesDict, get_data_patterns
        from datasets.exceptions import DatasetsError

        try:
            splits = {str(k): [str(f) for f in v] for k, v in
                      DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path)).items()}
        except (DatasetsError, FileNotFoundError):
            splits = {}
        splits = {k: sorted(f for f in v if _builder_for(f)) for k, v in splits.items()}
        splits = {k: v for k, v in splits.items() if v}
        if not splits:
            raise SourceError(
                f"{source}: folder holds no readable data files ({', '.join(sorted(BUILDERS))}); "
                "point SOURCE at the files"
            )
        chosen = split or "train"
        if chosen not in splits:
            raise ConfigError(f"{source}: no split {chosen!r} in this folder; its splits are {', '.join(sorted(splits))}"
                              " (give one with --split)")
        return splits[chosen], len(splits) > 1 or split is not None
    if glob.has_magic(source):
        seen: set[str] = set()
        files = []
        for p in sorted(glob.glob(str(expand_user(source, "source", SourceError)), recursive=True)):
            real = os.path.realpath(p)
            if os.path.isfile(p) and real not in seen:
                seen.add(real)
                files.append(p)
        if not files:
            raise SourceError(f"{source}: the pattern matches no files; check the path and quote the glob")
        return files, False
    return None


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def resolve(source: str, *, recipe: str | None = None, split: str | None = None, from_hub: bool = False,
            files: str | None = None) -> Source:
    """What SOURCE names; ``files`` (a mix part's) picks files inside a Hub repo or a local folder."""
    named = get_recipe(recipe) if recipe else None
    if files is not None:
        folder = expand_user(source, "source", SourceError)
        if folder.is_dir():
            return resolve(str(folder / files), recipe=recipe, split=split)
        if source in RECIPES or HUB_ID.match(source):
            hub = RECIPES.get(source)
            return Source(kind="hub", name=f"{source}/{files}", recipe=named or hub,
                          hub_id=hub.hub_id if hub else source, hub_config=hub.hub_config if hub else None,
                          data_files=files, split=split or "train")
        raise SourceError(f"{source}: 'files' picks files inside a folder or a Hub dataset; this is neither")
    # A file or folder on disk wins over a recipe or Hub id of the same name (as over a Hub id, below);
    # a recipe's name then still sets the formatting, as --recipe does.
    on_disk = source in RECIPES and Path(source).exists()  # a recipe's name has no ~
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
        return Source(kind="hub", name=r.name, recipe=r, hub_id=r.hub_id, hub_config=r.hub_config,
                      data_files=r.hub_files, split=split or r.split)
    found = _local_files(source, split)
    if found is not None:
        files, split_chosen = found
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
        if split not in (None, "train") and not split_chosen:
            raise ConfigError(f"--split {split!r} applies to Hub datasets and folders laid out like one; this "
                              "local source is one split")
        if on_disk and named is None:
            named = RECIPES[source]
        return Source(kind="local", name=source, recipe=named, builder=builders.pop(), files=tuple(files),
                      split=split or "train")
    if _builder_for(source) or source.startswith((".", "/", "~")) or os.sep + os.sep in source:
        raise SourceError(f"{source}: no such file or folder; check the path")
    if HUB_ID.match(source):
        return Source(kind="hub", name=source, recipe=named, hub_id=source, split=split or "train")
    raise SourceError(
        f"unknown recipe {source!r}; known recipes: {', '.join(RECIPES)}. For a local file give its path, "
        "for a Hub dataset its full id (owner/name)"
    )


def _explain_local_failure(source: Source, error: BaseException) -> SourceError:
    if isinstance(error, UnicodeDecodeError) or isinstance(error.__cause__, UnicodeDecodeError):
        return SourceError(f"{source.name}: not UTF-8 text; re-encode the file as UTF-8")
    cause = error.__cause__ or error.__context__ or error
    return SourceError(
        f"{source.name}: cannot be read as {source.builder} ({type(cause).__name__}: {str(cause).splitlines()[0][:200]}); "
        "check the file is complete and of that type"
    )


def _hub_reachable() -> bool:
    from huggingface_hub import constants

    # offline mode reads the local cache; let datasets say whether it is there
    return constants.HF_HUB_OFFLINE or hub.reachable()


def hub_revision(hub_id: str) -> str | None:
    """The commit a Hub dataset is read at now (recorded in the manifest), or None in offline mode."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        return HfApi().dataset_info(hub_id, timeout=10).sha
    except Exception as e:  # huggingface_hub raises many types; all mean "cannot look it up"
        raise SourceError(f"{hub_id}: cannot look the dataset up on the Hugging Face Hub ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}); check the id and your network") from e


@contextmanager
def _torch_unseen():
    """While a stream is made and read, `datasets` is told torch is absent (unless it is imported already).

    An ``IterableDataset`` imports torch whenever it is installed, to make itself a torch dataset and
    share its epoch counter with DataLoader workers (seconds of import, and `packer build` must not
    import torch). packer never hands the stream to torch, so it needs neither; the flag is restored
    after each call, so the rest of the process sees `datasets` as it was."""
    from datasets import config

    if "torch" in sys.modules:
        yield
        return
    saved, config.TORCH_AVAILABLE = config.TORCH_AVAILABLE, False
    try:
        yield
    finally:
        config.TORCH_AVAILABLE = saved


@dataclass(frozen=True, slots=True)
class Stream:
    """A source's records in source order, read lazily a chunk at a time (never all in memory or on disk).

    ``files`` are the local files this read touches: every file of the source, or under ``limit`` only
    those that hold the first ``limit`` records (the rest are never opened). ``revision`` is the Hub
    commit a Hub source is read at.
    """

    source: Source
    files: tuple[str, ...]
    limit: int | None = None
    revision: str | None = None

    @property
    def name(self) -> str:
        return self.source.name

    def _iterable(self):
        import datasets

        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures become one SourceError
        datasets.disable_progress_bars()
        if self.source.kind == "local":
            ds = datasets.load_dataset(self.source.builder, data_files=list(self.files), split="train", streaming=True)
        else:
            ds = datasets.load_dataset(self.source.hub_id, self.source.hub_config, data_files=self.source.data_files,
                                       split=self.source.split, revision=self.revision, streaming=True)
        return ds if self.limit is None else ds.take(self.limit)

    def chunks(self, start: int = 0, size: int = BATCH) -> Iterator[tuple[int, dict[str, list]]]:
        """``(first record index, records as columns)`` of ``size`` records each (the last may be fewer),
        from record ``start`` (records before it are passed over, not formatted; a local JSON line not even parsed,
        a Parquet, Arrow or CSV batch before it not made into records: :func:`packer.building.readers.records`)."""
        if self.source.kind == "local" and self.source.builder in readers.OWN:
            return self._own_chunks(start, size)
        return self._datasets_chunks(start, size)

    def _own_chunks(self, start: int, size: int) -> Iterator[tuple[int, dict[str, list]]]:
        """Local JSON, Parquet and Arrow files, read by :mod:`packer.building.readers` (no `datasets`)."""
        def every():  # the records from `start` on: those before it passed over, unread where the format allows
            left = start
            for f in self.files:
                left -= yield from readers.records(self.source.builder, f, skip=left)
            if left:  # only a run over these very bytes starts past record 0: it read them, so they were there
                raise SourceError(f"{self.source.name}: holds {start - left:,} records, fewer than the {start:,} the "
                                  "run this one resumes had read; the source changed: build again from the start")

        todo = itertools.islice(every(), None if self.limit is None else max(0, self.limit - start))
        done = start
        while batch := list(itertools.islice(todo, size)):
            names = dict.fromkeys(name for record in batch for name in record)  # a key some records lack: None
            yield done, {name: [record.get(name) for record in batch] for name in names}
            done += len(batch)

    def _datasets_chunks(self, start: int, size: int) -> Iterator[tuple[int, dict[str, list]]]:
        done = start
        try:
            with _torch_unseen():
                ds = self._iterable()
                if start:
                    ds = ds.skip(start)
                batches = iter(ds.iter(batch_size=size))
        except PackerError:
            raise
        except Exception as e:  # any failure to open the source is the source's
            raise self._failure(e, done) from e
        while True:
            try:
                with _torch_unseen():
                    batch = next(batches)
            except StopIteration:
                return
            except PackerError:
                raise
            except Exception as e:  # a reader failing mid-way (corrupt file, network)
                raise self._failure(e, done) from e
            n = len(next(iter(batch.values()))) if batch else 0
            yield done, batch
            done += n

    def columns(self) -> list[str]:
        """The record fields: those of the first ``BATCH`` records (read even under a limit of 0, which a
        mix part may have), or the source's features where `datasets` knows them in advance. A source
        without a single record is a ``SourceError``."""
        own = self.source.kind == "local" and self.source.builder in readers.OWN
        first = None  # records its reader could not make name no fields: the fields are the next batch's
        for _, batch in Stream(self.source, self.files, None, self.revision).chunks(0, BATCH if own else 1):
            names = [name for name in batch if name != readers.UNREADABLE]
            bad = batch.get(readers.UNREADABLE)
            if names or not bad:  # records of no fields ({}) are the format's to refuse
                return names
            first = first or next(filter(None, bad))
        if first is not None:
            raise SourceError(f"{self.name}: holds no record that can be read; the first: {first[0]}")
        raise SourceError(f"{self.name}: holds no records; check the file or --split")

    def total(self) -> int | None:
        """About how many records this stream gives, for a progress bar (:func:`readers.total`: under a
        limit, the limit unless metadata says fewer), or None where that is not known cheaply (a JSON
        document, a Hub dataset: then only a ``limit`` bounds it)."""
        if self.source.kind == "local" and self.source.builder in readers.OWN:
            n = readers.total(self.source.builder, self.files, self.limit)
            return self.limit if n is None else n
        return self.limit

    def count(self) -> int:
        return sum(len(next(iter(b.values()))) for _, b in self.chunks() if b)

    def _failure(self, error: BaseException, done: int) -> SourceError:
        if self.source.kind == "local":
            return _explain_local_failure(Source(**{**{k: getattr(self.source, k) for k in self.source.__slots__},
                                                    "files": self.files}), error)
        return SourceError(
            f"{self.source.hub_id}: reading split {self.source.split!r} from the Hugging Face Hub failed after "
            f"{done:,} records ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}); "
            "check the id, --split and your network, then rerun the same command (it resumes)"
        )


def open_stream(source: Source, *, limit: int | None = None) -> Stream:
    """SOURCE as a :class:`Stream` of its first ``limit`` records (all without a limit)."""
    if source.kind == "local":
        if all(os.path.getsize(f) == 0 for f in source.files):
            raise SourceError(f"{source.name}: empty file, holds no records; check the file")
        return Stream(source, _reached(source, limit), limit)
    if not _hub_reachable():
        raise SourceError(
            f"cannot reach the Hugging Face Hub for {source.hub_id!r} (no network); download it on a connected "
            f"machine (`hf download {source.hub_id} --repo-type dataset --local-dir DIR`) and pass the local files, "
            "or use the bundled `flan` recipe"
        )
    return Stream(source, (), limit, hub_revision(source.hub_id))


def holds(source: Source, n: int) -> bool:
    """Whether SOURCE has at least ``n`` records, read no further than that (counted without making
    them where the format allows)."""
    if n <= 0:
        return True
    if source.kind == "local" and source.builder in readers.OWN:
        for f in source.files:
            n -= readers.count(source.builder, f, n)
            if n <= 0:
                return True
        return False
    return open_stream(source, limit=n).count() >= n


def _reached(source: Source, limit: int | None) -> tuple[str, ...]:
    """The files that hold the first ``limit`` records: counted by reading each in turn until they are
    found (so a later file is never opened, let alone hashed)."""
    if limit is None or len(source.files) == 1:
        return source.files
    need, reached = limit, []
    for f in source.files:
        reached.append(f)
        own = source.builder in readers.OWN  # counted without making the records
        need -= readers.count(source.builder, f, need) if own else Stream(source, (f,), need).count()
        if need <= 0:
            break
    return tuple(reached)
