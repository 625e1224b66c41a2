"""The pipeline, end to end: source → format → tokenize → plan → write → manifest.

Tokens go to a flat spill file in the output's staging folder as they are made; only the lengths stay
in memory for planning (a few bytes per example). The plan is global (all lengths at once), then rows
are gathered from the memory-mapped spill and written shard by shard. The manifest is the commit point.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from . import __version__, schema, sources, tokenize_stage
from .config import BuildConfig
from .errors import OutputError, SourceError
from .formatting import make_spec
from .plan import plan as make_plan
from .recipes import BUNDLED_TOKENIZER
from .tokenization import Encoder, load_tokenizer, tokenizer_info
from .tokenize_stage import TOKENS_DIR
from .writer import STAGING, clear_output, commit, write_shards

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


def _source_info(source: sources.Source) -> dict[str, Any]:
    if source.kind == "hub":
        return {"kind": "hub", "id": source.hub_id, "config": source.hub_config, "split": source.split}
    bundled = source.recipe is not None and source.recipe.local is not None and source.name == source.recipe.name
    files = [
        {"path": Path(f).name if bundled else f, "bytes": Path(f).stat().st_size, "sha256": schema.file_sha256(f)}
        for f in source.files
    ]
    return {"kind": "local", "builder": source.builder, "files": files}


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
        and n not in (schema.MANIFEST_NAME, schema.MANIFEST_NAME + ".tmp", STAGING, *schema.DATASETS_FILES)
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
    started = time.perf_counter()
    out = Path(config.out)
    source = sources.resolve(config.source, recipe=config.recipe, split=config.split, from_hub=config.from_hub)
    tokenizer_name = tokenizer_path(config.tokenizer)
    tokenizer = load_tokenizer(tokenizer_name)
    tok_info = tokenizer_info(tokenizer, config.tokenizer or BUNDLED)
    identity = {"config": config.identity(), "tokenizer": tok_info, "source": _source_info(source)}
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
        num_proc=config.num_proc, engine=getattr(config, "engine", "local"), where=where, progress=progress,
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
    store = spill.store()
    with tqdm(total=plan.num_rows, desc="write", unit="row", disable=not progress, dynamic_ncols=True) as bar:
        shards = list(write_shards(plan, store, out, shard_bytes=config.shard_size_mb << 20, on_rows=bar.update))

    stats = dict(plan.stats)
    stats["examples_read"] = len(dataset)
    stats["records_skipped"] = sum(skipped.values())
    dropped = {"overlong": stats.get("examples_dropped", 0), **skipped} if skipped or stats.get("examples_dropped") else {}
    stats["dropped_by_reason"] = {k: v for k, v in sorted(dropped.items()) if v}
    stats["loss_tokens"] = 0  # filled from the shards below, the numbers a reader will see
    manifest = {
        "format": schema.FORMAT_NAME,
        "format_version": schema.FORMAT_VERSION,
        "created_by": f"packer {__version__}",
        "note": source.recipe.note if source.recipe and source.recipe.note and source.kind == "local" else None,
        **identity,
        "stats": stats,
        "shards": shards,
    }
    manifest["stats"]["loss_tokens"] = _loss_tokens(out / STAGING, shards)
    commit(out, manifest)
    return BuildResult(out, manifest, False, time.perf_counter() - started)


def _loss_tokens(folder: Path, shards: list[dict]) -> int:
    import pyarrow.compute as pc

    return sum(int(pc.sum(schema.open_shard(folder / s["file"]).column("num_loss_tokens")).as_py() or 0) for s in shards)
