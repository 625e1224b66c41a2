"""The pipeline, end to end: source → format → tokenize → plan → write → manifest.

Tokens go to a flat spill file in the output's staging folder as they are made; only the lengths stay
in memory for planning (a few bytes per example). The plan is global (all lengths at once), then rows
are read back from the spill and written shard by shard. The manifest is the commit point.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import __version__, schema, sources, tokenize_stage
from .config import BuildConfig
from .errors import ConfigError, OutputError, SourceError
from .formatting import make_spec
from .plan import plan as make_plan
from .recipes import BUNDLED_TOKENIZER
from .tokenization import Encoder, load_tokenizer, tokenizer_info
from .tokenize_stage import TOKENS_DIR
from .writer import STAGING, clear_output, commit, write_shards

LOCK = ".packer-lock"  # flock'd by a running build (see _output_lock); removed when it ends
BUNDLED = "bundled"  # how the manifest names the tokenizer shipped in data/, portable across checkouts


@dataclass(frozen=True, slots=True)
class BuildResult:
    out: Path
    manifest: dict[str, Any]
    reused: bool  # the folder already held this exact build; nothing was done
    seconds: float


def tokenizer_path(name: str | None) -> str:
    """Where to load a tokenizer the config or a manifest names ("bundled" is the one in data/)."""
    return str(BUNDLED_TOKENIZER) if name in (None, BUNDLED) else name


def source_info(source: sources.Source) -> dict[str, Any]:
    if source.kind == "hub":
        return {"kind": "hub", "id": source.hub_id, "config": source.hub_config, "split": source.split}
    bundled = source.recipe is not None and source.recipe.local is not None and source.name == source.recipe.name
    files = [
        {"path": Path(f).name if bundled else f, "bytes": Path(f).stat().st_size, "sha256": schema.file_sha256(f)}
        for f in source.files
    ]
    return {"kind": "local", "builder": source.builder, "files": files}


@contextmanager
def _output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``out/.packer-lock`` (creating ``out`` if needed); refuse if held.

    The lock file is removed on release (and ``out`` too if this call created it and it is empty);
    one left by a killed build is harmless: the kernel released its lock, and the next build takes it.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file, not a folder; choose another --out")
    created = not out.exists()
    path = out / LOCK
    for _ in range(10):  # retry if the holder removed the file between our open and our flock
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"--out {out}: cannot write there ({_reason(e)}); choose a writable folder") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(
                f"--out {out}: another packer build is writing there now ({LOCK} is locked); wait for it to "
                "finish or choose another --out"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:  # pragma: no cover - only under a storm of concurrent builds
        raise OutputError(f"--out {out}: could not take {LOCK}; another build keeps replacing it, retry")
    try:
        yield
    finally:
        with suppress(OSError):
            path.unlink()
        os.close(fd)
        if created:
            with suppress(OSError):
                out.rmdir()  # only if empty: a failed first build leaves no folder behind


_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT}


def _is_output_failure(e: OSError, out: Path) -> bool:
    """Whether an OSError escaping the pipeline is a failure to write the output folder."""
    for name in (e.filename, e.filename2):
        if name is not None:
            try:
                return Path(name).resolve().is_relative_to(out.resolve())
            except (OSError, ValueError):
                return False
    # pyarrow's write errors carry neither filename nor errno; the text says what failed
    text = str(e).lower()
    return e.errno in _DISK_ERRNOS or any(w in text for w in ("no space", "file too large", "quota", "read-only"))


def _reason(e: OSError) -> str:
    if e.errno == errno.EFBIG or "file too large" in str(e).lower():
        return "file too large: a file size limit (ulimit -f) was reached"
    if e.errno in (errno.ENOSPC, errno.EDQUOT) or "no space" in str(e).lower():
        return "no space left on the device"
    return e.strerror or str(e).splitlines()[0][:200]


def _discard_partial(out: Path) -> None:
    """After a failed write: remove whatever of an unfinished build is there (never a finished one)."""
    if not out.is_dir() or (out / schema.MANIFEST_NAME).exists():
        return
    with suppress(OSError):
        clear_output(out)
    for name in (STAGING, schema.MANIFEST_NAME + ".tmp"):
        with suppress(OSError):
            (out / name).unlink() if (out / name).is_file() else shutil.rmtree(out / name)


def _check_output(out: Path, identity: dict[str, Any], overwrite: bool) -> dict | None:
    """Refuse a folder that holds something else; return the manifest if it holds this exact build."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: is a file, not a folder; choose another --out")
    if not out.exists():
        return None
    manifest_path = out / schema.MANIFEST_NAME
    ours = {p.name for p in out.iterdir()}
    foreign = {
        n
        for n in ours
        if not (n.startswith(schema.SHARD_PREFIX) and n.endswith(schema.SHARD_SUFFIX))
        and n not in (schema.MANIFEST_NAME, schema.MANIFEST_NAME + ".tmp", STAGING, LOCK, *schema.DATASETS_FILES)
    }
    if overwrite:
        if foreign:
            raise OutputError(
                f"--out {out}: holds files packer did not write ({', '.join(sorted(foreign)[:3])}); "
                "refusing to delete them even with --overwrite; choose an empty or new folder"
            )
        return None
    if foreign:
        raise OutputError(
            f"--out {out}: is not empty and not a packer build ({', '.join(sorted(foreign)[:3])} ...); "
            "choose an empty or new folder"
        )
    if manifest_path.is_file():
        try:
            previous = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            previous = None
        same = isinstance(previous, dict) and all(previous.get(k) == v for k, v in identity.items())
        if same and previous.get("format_version") == schema.FORMAT_VERSION:
            return previous
        raise OutputError(
            f"--out {out}: holds another build (different config, source or tokenizer); pass --overwrite "
            "to replace it or choose another --out"
        )
    return None  # an interrupted build of ours: it is redone below


def build(config: BuildConfig, *, progress: bool = False) -> BuildResult:
    """Build ``config.out`` from ``config.source``, holding the output folder's lock throughout.

    A second build into the same folder meanwhile is refused. A write that fails (disk full, a file
    size limit, a read-only or vanished folder) becomes an ``OutputError`` and the partial build is
    removed: the folder holds no manifest, no shards and no staging files afterwards.
    """
    out = Path(config.out)
    with _output_lock(out):
        try:
            return _build(config, progress=progress)
        except OSError as e:
            if not _is_output_failure(e, out):
                raise
            _discard_partial(out)
            raise OutputError(
                f"--out {out}: writing failed ({_reason(e)}); the partial build was removed; free space or "
                "fix the folder's permissions and rerun, or choose another --out"
            ) from e


def _build(config: BuildConfig, *, progress: bool = False) -> BuildResult:
    started = time.perf_counter()
    out = Path(config.out)
    source = sources.resolve(config.source, recipe=config.recipe, split=config.split, from_hub=config.from_hub)
    tokenizer_name = tokenizer_path(config.tokenizer)
    tokenizer = load_tokenizer(tokenizer_name, config.chat_template)
    tok_info = tokenizer_info(tokenizer, config.tokenizer or BUNDLED)
    identity = {"config": config.identity(), "tokenizer": tok_info, "source": source_info(source)}
    previous = _check_output(out, identity, config.overwrite)
    if previous is not None:
        return BuildResult(out, previous, True, time.perf_counter() - started)

    dataset = sources.load(source, progress=progress)
    if config.limit is not None and config.limit < len(dataset):
        dataset = dataset.select(range(config.limit))
    if len(dataset) == 0:
        raise SourceError(f"{source.name}: holds no records; check the file or --split")
    spec = make_spec(recipe=source.recipe, config=config, columns=list(dataset.column_names))
    encoder = Encoder(tokenizer, spec, skip_errors=config.on_error == "skip")

    try:
        out.mkdir(parents=True, exist_ok=True)
        clear_output(out, keep=(TOKENS_DIR,))  # a matching interrupted tokenize stage is resumed below
        (out / STAGING).mkdir(exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot write there ({e.strerror}); choose a writable folder") from e
    where = f"{source.files[0]} record" if len(source.files) == 1 else f"{source.name} record"
    spill = tokenize_stage.tokenize(
        dataset, encoder, out / STAGING / TOKENS_DIR, identity,
        num_proc=config.num_proc, engine=config.engine, where=where, progress=progress,
    )
    lengths, skipped = spill.lengths, spill.skipped
    if len(lengths) == 0:
        raise SourceError(f"{source.name}: every record was skipped ({skipped}); nothing to pack")

    plan = make_plan(
        lengths,
        mode=config.pack,
        max_len=config.max_len,
        max_tokens=config.max_tokens,
        batch_size=config.batch_size,
        overlong=config.overlong,
        seed=config.seed,
        world_size=config.world_size,
        balance=config.balance,
    )
    if plan.num_rows == 0:  # every example was over-long and --overlong drop dropped it
        raise ConfigError(
            f"all {len(lengths):,} examples are longer than --max-len {config.max_len:,} and --overlong drop drops "
            "them: nothing to pack; raise --max-len or use --overlong truncate or split"
        )
    totals: dict[str, int] = {}
    if config.engine == "ray":
        from .ray_engine import write_shards as ray_write_shards

        shards = ray_write_shards(plan, spill, out, shard_bytes=config.shard_size_mb << 20, totals=totals)
    else:
        with tqdm(total=plan.num_rows, desc="write", unit="row", disable=not progress, dynamic_ncols=True) as bar:
            shards = list(write_shards(plan, spill.store(), out, shard_bytes=config.shard_size_mb << 20,
                                       totals=totals, on_rows=bar.update))

    stats = dict(plan.stats)
    stats["examples_read"] = len(dataset)
    stats["records_skipped"] = sum(skipped.values())
    dropped = {"overlong": stats["examples_dropped"], **skipped}
    stats["dropped_by_reason"] = {k: v for k, v in sorted(dropped.items()) if v}
    stats["loss_tokens"] = totals["loss_tokens"]
    # A completion-only example truncated before its completion trains on nothing: say how many.
    stats["segments_without_loss"] = totals["segments_without_loss"]
    manifest = {
        "format": schema.FORMAT_NAME,
        "format_version": schema.FORMAT_VERSION,
        "created_by": f"packer {__version__}",
        "note": source.recipe.note if source.recipe and source.recipe.note and source.kind == "local" else None,
        **identity,
        "stats": stats,
        "shards": shards,
    }
    commit(out, manifest)
    return BuildResult(out, manifest, False, time.perf_counter() - started)
