"""The `packer` command: parse → config → call the library → render → exit code.

Exit codes: 0 success; 1 a check found problems (verify); 2 bad input or usage, reported in one line
on stderr (never a traceback; `terminal.py` decides how a command ends).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import click

from . import __version__, cli_cache, cli_push, interrupt, render, terminal
from .building import output, pipeline
from .building.mix import parts_from_cli
from .building.tokenization import load_tokenizer
from .checking import inspect_
from .checking.verify import verify as run_verify
from .contract import config as cfg
from .contract import schema
from .contract.config import BuildConfig
from .planning.context_parallel import LAYOUTS as CP_LAYOUTS

# The defaults `packer build` shows are BuildConfig's own, so the CLI and the library build the same.
DEFAULTS = {f.name: f.default for f in dataclasses.fields(BuildConfig)}


@click.group(cls=terminal.OneLineErrors, commands=[cli_cache.cache, cli_push.push], context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="packer")  # the version the manifest records
def main() -> None:
    """Pack fine-tuning data once, offline, into Arrow shards that train with no padding and no collation.

    \b
    packer build flan --out shards/          pack the bundled FLAN-style sample
    packer inspect shards/ --row 0           see where the example boundaries are
    packer verify shards/                    prove the shards are intact and correct
    """


@main.command()
@click.argument("sources", nargs=-1)
@click.option("--mix", "mix_option", metavar="WEIGHTS|FILE",
              help="Mix several SOURCEs: one weight each (--mix 0.5,0.3,0.2), or a YAML/JSON mix file naming the "
                   "sources (then no SOURCE); see docs/mixtures.md.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Output folder for the shards and manifest.json; an object-storage URL (s3://...) builds in a local "
                   "staging folder under the cache and uploads it as `packer push` does.")
@click.option("--recipe", help="Format a local SOURCE as this recipe (fields and templates), e.g. --recipe gsm8k.")
@click.option("--from-hub", is_flag=True, help="Read a recipe from the Hugging Face Hub instead of its bundled sample.")
@click.option("--split", help="Split of a Hub dataset (default: the recipe's, else train).")
@click.option("--tokenizer", "-t", help="Tokenizer folder or Hub id (default: the bundled tokenizer, packer/data/tokenizer).")
@click.option("--prompt-field", help="Record field holding the prompt (not trained on unless --train-on-prompt).")
@click.option("--completion-field", help="Record field holding the completion (trained on).")
@click.option("--messages-field", help="Record field holding chat turns [{role, content}], rendered by the chat template.")
@click.option("--text-field", help="Record field holding plain text, trained on whole.")
@click.option("--train-on-prompt", is_flag=True, help="Alias of --train-on all.")
@click.option("--max-len", type=int, default=DEFAULTS["max_len"], show_default=True, help="Longest example, in tokens; longer ones follow --overlong.")
@click.option("--pack", type=click.Choice(cfg.PACK_MODES), default=DEFAULTS["pack"], show_default=True,
              help="batch: B examples per row, same optimizer steps as padded training. "
                   "bfd: fill rows up to --max-tokens. optimal: bfd, then refilled to fewer rows. wrap: concatenate and cut (plain text).")
@click.option("--batch-size", "-b", type=int, help="Examples per row in --pack batch (default 8).")
@click.option("--max-tokens", type=int, help="Row budget in tokens for --pack bfd/optimal/wrap (default: --max-len; 2 x --max-len for preference pairs).")
@click.option("--overlong", type=click.Choice(cfg.OVERLONG_POLICIES), default=DEFAULTS["overlong"], show_default=True,
              help="What happens to an example longer than --max-len; every case is counted in the manifest. "
                   "truncate keeps the first --max-len tokens; truncate-left drops prompt tokens from the start so "
                   "the answer and EOS stay whole (an answer longer than --max-len is cut as by truncate).")
@click.option("--world-size", type=int, default=DEFAULTS["world_size"], show_default=True, help="Data-parallel ranks the rows are planned for.")
@click.option("--balance", type=click.Choice(cfg.BALANCE_BY), help="Even out work across --world-size ranks in each step.")
@click.option("--seed", type=int, default=DEFAULTS["seed"], show_default=True, help="Seed of the shuffle; the same seed gives the same bytes.")
@click.option("--limit", type=int, help="Use only the first N records.")
@click.option("--shard-size", "shard_size_mb", type=int, default=DEFAULTS["shard_size_mb"], show_default=True, help="Approximate shard size, MB.")
@click.option("--on-error", type=click.Choice(cfg.ON_ERROR), default=DEFAULTS["on_error"], show_default=True,
              help="A bad record stops the build, or is skipped and counted in the manifest by reason.")
@click.option("--num-proc", "-j", type=int, default=DEFAULTS["num_proc"], show_default=True,
              help="Processes for formatting and tokenizing (0: one per core, the fastest measured; 1: one process "
                   "whose tokenizer threads use every core; N: N workers). The bytes do not depend on it.")
@click.option("--engine", type=click.Choice(cfg.ENGINES), default=DEFAULTS["engine"], show_default=True,
              help="ray: tokenize and write as Ray Data tasks on the cluster ray.init() joins (pip install 'packer[ray]').")
@click.option("--overwrite", is_flag=True, help="Replace a different build already in --out.")
@click.option("--train-on", type=click.Choice(cfg.TRAIN_ON), default=DEFAULTS["train_on"], show_default=True,
              help="Chat: every assistant turn's output, only the final one, or every token. Prompt/completion "
                   "data: assistant trains the completion, all the prompt too.")
@click.option("--chat-template", type=click.Path(dir_okay=False),
              help="Jinja file rendering chat data instead of the tokenizer's template (e.g. a {% generation %}-tagged one).")
@click.option("--tools-field", help="Record field holding tool definitions passed to the chat template (default: tools, if present).")
@click.option("--processor",
              help="Image+text data: the model's processor folder or Hub id (its chat template, image processor and "
                   "tokenizer).")
@click.option("--images-field", help="With --processor: the record field holding each record's images (default: images).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's stats as JSON instead of a summary.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option("--no-cache", "cache", flag_value=False, default=True, help="Keep no tokens in the cache, use none.")
@click.option("--epochs", type=int, default=DEFAULTS["epochs"], show_default=True,
              help="Plan E epochs, each its own shuffle of the examples (batch: the minibatches a reshuffling "
                   "sampler would give; bfd: new groupings); the shards hold all E (E × the disk), the loader "
                   "plays epoch e's rows in epoch e.")
@click.option("--cp-size", type=int, default=DEFAULTS["cp_size"], show_default=True,
              help="Pad rows for a context-parallel group of N ranks that split each row (docs/context-parallel.md); "
                   "padding is untrained and counted in the budget.")
@click.option("--cp-layout", type=click.Choice(CP_LAYOUTS),
              help="zigzag (default; TransformerEngine THD, ring-flash-attn zigzag): every segment padded to a "
                   "multiple of 2N; contiguous (ring-flash-attn llama3): the row padded to a multiple of N.")
@click.option("--pad-to-multiple-of", type=int, default=DEFAULTS["pad_to_multiple_of"], show_default=True,
              help="Pad every segment to a multiple of M (FP8 kernels: 16); composes with --cp-size.")
@click.option("--format", "format_version", type=click.Choice(["1", "2"]), default=str(DEFAULTS["format_version"]),
              show_default=True, callback=lambda ctx, param, value: int(value),
              help="On-disk format: 2 stores ids and positions in uint16 where they fit and the loss as a bit "
                   "mask (a third of the bytes); 1 is the int32 format of earlier packers (docs/format.md).")
@click.option("--compression", type=click.Choice(["zstd"]),
              help="Compress the shards' Arrow buffers (for shards that travel); readers then decompress them "
                   "into memory instead of memory-mapping them.")
def build(sources: tuple[str, ...], mix_option: str | None, as_json: bool, quiet: bool, **options) -> None:
    """Read SOURCE, format, tokenize, pack and write Arrow shards to --out.

    SOURCE is a recipe (flan, orcamath, gsm8k, alpaca, chat), a local file, folder or glob (json,
    jsonl, parquet, csv, arrow, txt) or a Hugging Face Hub dataset id (owner/name). A file or folder
    on disk wins over a recipe or Hub id of the same name (a recipe's name then sets the formatting,
    as --recipe does). Sources are read as streams: --limit N reads about N records and stops. A
    folder is read like a Hub dataset repo (data/train-*, data/test-*: --split picks one); hidden
    files and folders (.name) are skipped. Ctrl-C stops a build at any moment (exit 130); rerun the
    command to resume.

    \b
    packer build flan --out shards/
    packer build data.jsonl --prompt-field question --completion-field answer --out shards/
    packer build flan --pack bfd --max-tokens 4096 --out shards-bfd/
    packer build flan gsm8k.jsonl chat.jsonl --mix 0.5,0.3,0.2 --out mixed/
    """
    parts = parts_from_cli(sources, mix_option)
    if parts is None and not sources:
        raise click.UsageError("give a SOURCE (or a mix file with --mix)")
    name = "+".join(p["source"] for p in parts) if parts else sources[0]
    url = cli_push.staged(options)  # --out URL: built locally (a rerun resumes there), then uploaded
    config = BuildConfig(source=name, mix=None if parts is None else tuple(parts), **options)
    result = pipeline.build(config, progress=not quiet and not as_json)
    pushed = None if url is None else cli_push.publish(result.out, url)
    interrupt.ignore()  # the build is complete: a late Ctrl-C must not report it interrupted
    if as_json:
        manifest = result.manifest.to_json()
        click.echo(json.dumps({"out": str(result.out), "reused": result.reused, "seconds": round(result.seconds, 3),
                               "stats": manifest["stats"], "shards": manifest["shards"], **render.build_notes(result),
                               **({} if pushed is None else {"pushed": cli_push.pushed_json(pushed)})}, indent=2))
        return
    terminal.echo(render.build_lines(result))
    if pushed is not None:
        click.echo(cli_push.pushed_line(pushed))


@main.command()
@click.argument("directory")
@click.option("--row", "row_index", type=int, help="Draw this row: segments in colour, boundaries, masked tokens dimmed.")
@click.option("--example", "example_id", type=int, help="Find where source example ID went: row(s), offset, split/truncated.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a figure (PNG/SVG/PDF) of lengths, fill and padding; needs matplotlib.")
@click.option("--full", is_flag=True, help="With --row: show long segments whole instead of eliding their middle.")
@click.option("--ids", "show_ids", is_flag=True, help="With --row: show token ids instead of text.")
@click.option("--tokenizer", "-t", help="Tokenizer to decode with (default: the one the manifest names).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(directory: str, row_index: int | None, example_id: int | None, plot_path: str | None, full: bool,
            show_ids: bool, tokenizer: str | None, as_json: bool) -> None:
    """Summarise a shard folder and compare the pack modes on it, draw one row (--row N), find an
    example (--example ID) or plot the build (--plot FILE.png). DIRECTORY may be an fsspec URL
    (s3://, gs://, file://, memory://).

    \b
    packer inspect shards/                       summary, and batch vs bfd vs padding on this data
    packer inspect shards/ --row 0               the row drawn in the terminal
    packer inspect shards/ --example 1234        where source example 1234 went
    packer inspect shards/ --plot build.png      lengths, fill, examples per row, padding removed
    """
    if row_index is not None and example_id is not None:
        raise click.UsageError("give --row or --example, not both")
    _note_staging(directory)
    if (full or show_ids) and row_index is None:
        raise click.UsageError("--full and --ids apply to --row")
    with cli_push.readable(directory) as local:
        out: dict = {}
        if plot_path is not None:
            from .plot import plot_build  # matplotlib, an optional dependency, only for --plot

            out["plot"] = str(plot_build(inspect_.plot_data(local), plot_path))
            if not as_json:
                click.echo(f"wrote {out['plot']}")
        if example_id is not None:
            view = inspect_.find_example(local, example_id)
            rc = 0 if view.found else 1
            if as_json:
                click.echo(json.dumps({**view.to_json(), **out}, indent=2))
            else:
                terminal.echo(render.example_lines(view, directory, terminal.use_color()))
            return rc
        if row_index is not None:
            name = tokenizer or schema.read_manifest(local).tokenizer["name_or_path"]
            view = inspect_.row(local, row_index, load_tokenizer(pipeline.tokenizer_path(name)),
                                elide=None if full else inspect_.ELIDE_KEEP)
            if as_json:
                click.echo(json.dumps({**view.to_json(), **out}, indent=2, ensure_ascii=False))
            else:
                width = max(40, min(120, shutil.get_terminal_size((100, 24)).columns) - 4)
                terminal.echo(render.row_lines(view, show_ids=show_ids, color=terminal.use_color(), width=width))
            return 0
        if plot_path is not None and not as_json:
            return 0
        view = dataclasses.replace(inspect_.summary(local), directory=directory)
        if as_json:
            click.echo(json.dumps({**view.to_json(), **out}, indent=2))
        else:
            terminal.echo(render.summary_lines(view, terminal.use_color()))
        return 0


def _note_staging(directory: str) -> None:
    """inspect and verify only read: a staging folder there is reported, and left to the next build."""
    note = output.staging_note(directory)
    if note is not None:
        click.echo(f"packer: note: {note}", err=True)


@main.command()
@click.argument("directory", type=click.Path())
@click.option("--tokenizer", "-t", help="Check the shards were made with this tokenizer (its fingerprint).")
@click.option("--source", help="Re-read this source with the build's config and check every record is accounted for.")
@click.option("--quick", is_flag=True, help="Check the manifest and the shards' sizes and sha256 only.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.pass_context
def verify(ctx: click.Context, directory: str, tokenizer: str | None, source: str | None, quick: bool, as_json: bool,
           quiet: bool) -> None:
    """Check a shard folder: manifest, hashes, every row's invariants; exit 0 clean, 1 problems found.

    \b
    packer verify shards/                          full check
    packer verify shards/ --quick                  manifest and hashes only
    packer verify shards/ --tokenizer my-tok/      were these made with my tokenizer?
    packer verify shards/ --source data.jsonl      is every source record accounted for?
    """
    _note_staging(directory)
    report = run_verify(directory, tokenizer=tokenizer, source=source, quick=quick, progress=not quiet and not as_json)
    for note in report.notes:
        click.echo(f"packer: note: {note}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        terminal.echo(render.verify_lines(report))
    ctx.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
