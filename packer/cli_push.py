"""`packer push`: a finished build uploaded to object storage, shards first and the manifest last (docs/loader.md,
"Publishing"); `build --out URL` ends the same way."""

from __future__ import annotations

import contextlib
import json

import click

from .contract import schema
from .contract.remote import check_target, is_remote, local_view, publish, staging_folder
from .errors import RemoteError


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def push(directory: str, url: str, as_json: bool) -> None:
    """Upload a finished build to object storage: shards first, the manifest last, so a reader never sees
    half a build; a rerun uploads only what is missing or differs.

    \b
    packer push shards/ s3://bucket/flan/        then: make_dataloader("s3://bucket/flan/")
    packer verify s3://bucket/flan/              fetches it through the cache and checks it
    """
    pushed = publish(directory, url)
    if as_json:
        click.echo(json.dumps(pushed_json(pushed), indent=2))
    else:
        click.echo(pushed_line(pushed))


def pushed_json(pushed) -> dict:
    return {"url": pushed.url, "uploaded": pushed.uploaded, "kept": pushed.kept, "bytes": pushed.bytes,
            "removed": pushed.removed, "seconds": round(pushed.seconds, 3)}


def pushed_line(pushed) -> str:
    removed = f", removed {len(pushed.removed)} stale shard(s)" if pushed.removed else ""
    return (f"pushed {len(pushed.uploaded)} file(s), {pushed.bytes / 1e6:,.1f} MB, to {pushed.url} in "
            f"{pushed.seconds:.1f}s; {len(pushed.kept)} already there{removed}")


def staged(options: dict) -> str | None:
    """``build --out URL``: the URL, with ``options["out"]`` set to its local staging folder (docs/loader.md,
    "Publishing"); None for a local --out. A URL that push could not reach is refused first."""
    if not is_remote(options["out"]):
        return None
    check_target(options["out"])  # unreachable, no credentials, no bucket: one line, before the build
    url, options["out"] = options["out"], str(staging_folder(options["out"]))
    return url


@contextlib.contextmanager
def readable(directory: str):
    """A folder inspect reads: the directory itself, or a remote build's local view (its shards fetched
    into the cache once, checked on arrival; docs/loader.md, "Remote builds")."""
    if not is_remote(directory):
        yield directory
        return
    schema.read_manifest(directory)  # no folder or no build there: the same one line as for a local path
    with local_view(directory) as (folder, failed):
        if failed:
            raise RemoteError(next(iter(failed.values())))
        yield str(folder)
