"""`packer cache`: the token store's entries listed (size, sources, tokenizer, last use) or cleared."""

from __future__ import annotations

import json

import click

from . import render, terminal
from .building import token_store


@click.command()
@click.argument("action", type=click.Choice(["list", "clear"]), default="list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable listing.")
def cache(action: str, as_json: bool) -> None:
    """List the token store's entries, most recently used first (ACTION list, the default), or remove them all
    (clear), with the tokenizers kept beside them; a build using an entry keeps what it took. The cache's root is
    $PACKER_CACHE, else $XDG_CACHE_HOME/packer, else ~/.cache/packer; $PACKER_CACHE_LIMIT bounds its size.

    \b
    packer cache              the entries: size, sources, --limit, tokenizer, records, tokens
    packer cache clear        remove them
    """
    if action == "clear":
        n = len(token_store.entries())
        freed = token_store.clear()
        click.echo(f"removed {n:,} token store entr{'y' if n == 1 else 'ies'} ({freed / 1e6:,.1f} MB) from "
                   f"{token_store.folder()}")
        return
    found = token_store.entries()
    if as_json:
        click.echo(json.dumps({"root": str(token_store.folder()), "entries": [
            {"path": str(e.path), "bytes": e.bytes, "last_used": e.last_used, "sound": e.sound, **e.about}
            for e in found]}, indent=2, default=str))
    else:
        terminal.echo(render.cache_lines(token_store.folder(), found))
