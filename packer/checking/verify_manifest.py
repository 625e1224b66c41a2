"""``packer verify``'s first two steps: the manifest, and the files of the folder against it.

- **manifest**: present, valid JSON, parsed by the contract's own parser (:func:`packer.contract.schema.parse_manifest`:
  format, version, every key and type, a config ``BuildConfig`` accepts), and stats that add up
  (examples and tokens accounted for);
- **files**: nothing under a name a build writes that the manifest does not list (a file under any
  other name is the user's, which a build leaves beside it: noted, not judged); every listed shard with the
  recorded size and sha256, and the ``datasets`` files as the manifest implies them (the checks
  :func:`packer.contract.schema.shard_file_problems` and :func:`packer.contract.schema.datasets_file_problems`).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from ..building import output
from ..contract import schema
from ..contract.schema import Manifest
from ..errors import ShardFormatError
from .report import Report


def load_manifest(directory: Path, report: Report) -> Manifest | None:
    """The manifest, parsed by the contract's own parser; each problem it finds is reported."""
    path = directory / schema.MANIFEST_NAME
    if not path.is_file():
        report.add("manifest", str(path), "missing, so the folder is not a finished build (interrupted, or not "
                   "packer's); rerun the build")
        return None
    try:
        data = schema.load_json(path.read_bytes(), str(path))
    except ShardFormatError as e:
        report.add("manifest", str(path), str(e).split(": ", 1)[1])
        return None
    manifest, problems = schema.parse_manifest(data)
    for key, message in problems:
        report.add("manifest", f"{path} {key}".rstrip(), message)
    return manifest


def check_stats_arithmetic(manifest: Manifest, report: Report) -> None:
    """The stats add up: every example and token accounted for, and no more records read than the limit."""
    s = manifest.stats
    where = f"{schema.MANIFEST_NAME} stats"
    parts = s.examples_packed + s.examples_split + s.examples_truncated + s.examples_dropped
    if parts != s.examples:
        report.add("stats", where, f"packed + split + truncated + dropped = {parts:,}, but examples = {s.examples:,}")
    if s.tokens != s.epoch_count * (s.tokens_in - s.tokens_truncated - s.tokens_dropped):  # every epoch holds them all
        report.add("stats", where, "tokens differs from epochs × (tokens_in − tokens_truncated − tokens_dropped)")
    if s.examples + s.records_skipped != s.examples_read:
        report.add("stats", where, f"examples {s.examples:,} + records_skipped {s.records_skipped:,} differs from "
                   f"examples_read {s.examples_read:,}: records are unaccounted for")
    dropped = s.examples_dropped + s.records_skipped
    if sum(v for v in s.dropped_by_reason.values() if isinstance(v, int)) != dropped:
        report.add("stats", where, f"dropped_by_reason sums to {sum(s.dropped_by_reason.values()):,}, but "
                   f"examples_dropped + records_skipped = {dropped:,}")
    if s.dropped_by_reason.get("overlong", 0) != s.examples_dropped:
        report.add("stats", where, "dropped_by_reason.overlong differs from examples_dropped")
    limit = manifest.config.limit
    if limit is not None and s.examples_read > limit:
        report.add("stats", where, f"examples_read {s.examples_read:,} exceeds the config's limit {limit:,}")


def check_folder_contents(directory: Path, manifest: Manifest | None, report: Report) -> None:
    """Nothing under a name a build writes that the manifest does not list; the ``datasets`` files as it
    implies them. Entries under other names are the user's (``packer build --overwrite`` builds beside
    them and never touches them): a note says they were left out."""
    listed = {e.file for e in manifest.shards} if manifest else set()
    users = []
    for path in sorted(directory.iterdir()):
        name = path.name
        # of packer's own names, only what a finished build holds is expected here
        if name in listed or name in (schema.MANIFEST_NAME, *schema.DATASETS_FILES):
            continue
        if manifest is None and schema.is_shard_name(name):
            continue  # no manifest: already reported; the shards are not "extra"
        if name == schema.STAGING and (left := output.staging_left(directory)):
            report.add("files", str(path), left)
            continue
        if not output.writes(name):
            users.append(name)
            continue
        # a build refuses to write beside another's file under one of its names, so rebuilding is no fix
        report.add("files", str(path), "not listed in the manifest (a leftover of another build or a foreign "
                   "file under a name a build writes); move it away")
    if users:
        shown = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
        report.notes.append(f"{directory}: holds {shown}, which packer did not write (yours: a build leaves them "
                            "untouched); not checked")
    if manifest is None:
        return
    for name, problem in schema.datasets_file_problems(directory, manifest):  # what datasets.load_from_disk reads
        report.add("files", str(directory / name), problem)


def check_files(directory: Path, manifest: Manifest, report: Report, progress: bool = False) -> list[schema.ShardEntry]:
    """Existence, size and sha256 of every shard (a bar over the bytes: every one is read); returns the
    entries whose file exists."""
    present = []
    with tqdm(total=sum(e.bytes for e in manifest.shards), desc="hash", unit="B", unit_scale=True,
              disable=not progress, dynamic_ncols=True) as bar:
        for entry in manifest.shards:
            for problem in schema.shard_file_problems(directory, entry):
                report.add("files", str(directory / entry.file), problem)
            if (directory / entry.file).is_file():
                present.append(entry)
            bar.update(entry.bytes)
    return present
