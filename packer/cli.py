"""The `packer` command: parse → config → call the library → render → exit code.

Exit codes: 0 success; 1 a check found problems (verify); 2 bad input or usage, reported in one line
on stderr (never a traceback).
"""

from __future__ import annotations

import json
import os
import sys

import click

from .config import OVERLONG_POLICIES, PACK_MODES
from .errors import PackerError


class OneLineErrors(click.Group):
    """Usage errors and PackerErrors become one line on stderr and exit code 2."""

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("packer: aborted", err=True)
            sys.exit(130)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "packer"
            click.echo(f"{command}: {e.format_message()} (see `{command} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"packer: {e.format_message()}", err=True)
            sys.exit(2)
        except PackerError as e:
            click.echo(f"packer: error: {e}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="packer")
def main() -> None:
    """Pack fine-tuning data once, offline, into Arrow shards that train with no padding and no collation.

    \b
    packer build flan --out shards/          pack the bundled FLAN-style sample
    packer inspect shards/ --row 0           see where the example boundaries are
    packer verify shards/                    prove the shards are intact and correct
    """


@main.command()
@click.argument("source")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Output folder for the shards and manifest.json.")
@click.option("--recipe", help="Format a local SOURCE as this recipe (fields and templates), e.g. --recipe gsm8k.")
@click.option("--from-hub", is_flag=True, help="Read a recipe from the Hugging Face Hub instead of its bundled sample.")
@click.option("--split", help="Split of a Hub dataset (default: the recipe's, else train).")
@click.option("--tokenizer", "-t", help="Tokenizer folder or Hub id (default: the bundled data/tokenizer).")
@click.option("--prompt-field", help="Record field holding the prompt (not trained on unless --train-on-prompt).")
@click.option("--completion-field", help="Record field holding the completion (trained on).")
@click.option("--messages-field", help="Record field holding chat turns [{role, content}], rendered by the chat template.")
@click.option("--text-field", help="Record field holding plain text, trained on whole.")
@click.option("--train-on-prompt", is_flag=True, help="Alias of --train-on all.")
@click.option("--max-len", type=int, default=4096, show_default=True, help="Longest example, in tokens; longer ones follow --overlong.")
@click.option("--pack", type=click.Choice(PACK_MODES), default="batch", show_default=True,
              help="batch: B examples per row, same optimizer steps as padded training. "
                   "bfd: fill rows up to --max-tokens, fewest rows. wrap: concatenate and cut (plain text).")
@click.option("--batch-size", "-b", type=int, help="Examples per row in --pack batch (default 8).")
@click.option("--max-tokens", type=int, help="Row budget in tokens for --pack bfd/wrap (default: --max-len).")
@click.option("--overlong", type=click.Choice(OVERLONG_POLICIES), default="truncate", show_default=True,
              help="What happens to an example longer than --max-len; every case is counted in the manifest.")
@click.option("--world-size", type=int, default=1, show_default=True, help="Data-parallel ranks the rows are planned for.")
@click.option("--balance", type=click.Choice(["tokens", "attention"]), help="Even out work across --world-size ranks in each step.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the shuffle; the same seed gives the same bytes.")
@click.option("--limit", type=int, help="Use only the first N records.")
@click.option("--shard-size", "shard_size_mb", type=int, default=256, show_default=True, help="Approximate shard size, MB.")
@click.option("--on-error", type=click.Choice(["raise", "skip"]), default="raise", show_default=True,
              help="A bad record stops the build, or is skipped and counted in the manifest by reason.")
@click.option("--num-proc", "-j", type=int,
              help="Processes for formatting and tokenizing (default: one per core; 1: one process whose "
                   "tokenizer threads use every core, measured ~5% slower). The bytes do not depend on it.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: tokenize and write as Ray Data tasks on the cluster ray.init() joins (pip install 'packer[ray]').")
@click.option("--overwrite", is_flag=True, help="Replace a different build already in --out.")
@click.option("--train-on", type=click.Choice(["assistant", "last", "all"]), default="assistant", show_default=True,
              help="Chat: every assistant turn's output, only the final one, or every token. Prompt/completion "
                   "data: assistant trains the completion, all the prompt too.")
@click.option("--chat-template", type=click.Path(dir_okay=False),
              help="Jinja file rendering chat data instead of the tokenizer's template (e.g. a {% generation %}-tagged one).")
@click.option("--tools-field", help="Record field holding tool definitions passed to the chat template (default: tools, if present).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's stats as JSON instead of a summary.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def build(as_json: bool, quiet: bool, **options) -> None:
    """Read SOURCE, format, tokenize, pack and write Arrow shards to --out.

    SOURCE is a recipe (flan, orcamath, gsm8k, alpaca, chat), a local file, folder or glob (json,
    jsonl, parquet, csv, arrow, txt) or a Hugging Face Hub dataset id (owner/name).

    \b
    packer build flan --out shards/
    packer build data.jsonl --prompt-field question --completion-field answer --out shards/
    packer build flan --pack bfd --max-tokens 4096 --out shards-bfd/
    """
    from .build import build as run_build
    from .config import BuildConfig

    if options["num_proc"] is None:
        options["num_proc"] = os.cpu_count() or 1
    config = BuildConfig(**options)
    result = run_build(config, progress=not quiet and not as_json)
    if as_json:
        click.echo(json.dumps({"out": str(result.out), "reused": result.reused, "seconds": round(result.seconds, 3),
                               "stats": result.manifest["stats"], "shards": result.manifest["shards"]}, indent=2))
        return
    _render_build(result)


def _render_build(result) -> None:
    m = result.manifest
    s = m["stats"]
    cfg = m["config"]
    if result.reused:
        click.echo(f"{result.out}: already holds this build (same source, config and tokenizer); nothing to do")
    if m.get("note"):
        click.echo(f"note: {m['note']}")
    mode = f"batch of {cfg['batch_size']}" if cfg["pack"] == "batch" else f"{cfg['pack']}, ≤ {cfg['max_tokens']:,} tokens"
    dropped = ", ".join(f"{k} {v:,}" for k, v in s.get("dropped_by_reason", {}).items()) or "none"
    size = sum(sh["bytes"] for sh in m["shards"])
    click.echo(f"examples  {s['examples_read']:,} read · {s['examples_packed']:,} packed whole · "
               f"{s['examples_split']:,} split · {s['examples_truncated']:,} truncated · dropped: {dropped}")
    click.echo(f"tokens    {s['tokens']:,} in rows ({s['loss_tokens']:,} trained) · "
               f"{s['tokens_truncated']:,} truncated · {s['tokens_dropped']:,} dropped")
    if s.get("segments_without_loss"):
        click.echo(f"warning   {s['segments_without_loss']:,} segments hold no trained token (prompts cut before their "
                   "completion): they cost compute and teach nothing; raise --max-len or use --overlong drop")
    if cfg["pack"] == "batch":
        # Batch mode keeps the padded run's steps; its win is the padding it removes, not fewer rows.
        click.echo(f"rows      {s['rows']:,} ({mode}) · padded batches would hold {s['padded_tokens']:,} tokens: "
                   f"packing removes {1 - s['tokens'] / max(1, s['padded_tokens']):.1%} of them")
    else:
        click.echo(f"rows      {s['rows']:,} ({mode}) · fill {s['fill']:.1%} · "
                   f"{s['rows'] / max(1, s['lower_bound']):.3f} × lower bound {s['lower_bound']:,}")
    click.echo(f"shards    {len(m['shards'])} in {result.out} ({size / 1e6:,.1f} MB)")
    click.echo(f"time      {result.seconds:.1f} s")


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
    from . import inspect_

    if row_index is not None and example_id is not None:
        raise click.UsageError("give --row or --example, not both")
    if (full or show_ids) and row_index is None:
        raise click.UsageError("--full and --ids apply to --row")
    out: dict = {}
    if plot_path is not None:
        from .plot import plot_build

        out["plot"] = str(plot_build(inspect_.plot_data(directory), plot_path))
        if not as_json:
            click.echo(f"wrote {out['plot']}")
    if example_id is not None:
        view = inspect_.find_example(directory, example_id)
        rc = 0 if view["found"] else 1
        if as_json:
            click.echo(json.dumps({**view, **out}, indent=2))
        else:
            _render_example(view, directory)
        return rc
    if row_index is not None:
        from . import schema
        from .build import tokenizer_path
        from .tokenization import load_tokenizer

        name = tokenizer or schema.read_manifest(directory)["tokenizer"]["name_or_path"]
        view = inspect_.row(directory, row_index, load_tokenizer(tokenizer_path(name)),
                            elide=None if full else inspect_.ELIDE_KEEP)
        if as_json:
            click.echo(json.dumps({**view, **out}, indent=2, ensure_ascii=False))
        else:
            _render_row(view, show_ids=show_ids)
        return 0
    if plot_path is not None and not as_json:
        return 0
    view = inspect_.summary(directory)
    if as_json:
        click.echo(json.dumps({**view, **out}, indent=2))
    else:
        _render_summary(view)
    return 0


# Colour: click.echo strips ANSI when stdout is not a terminal; NO_COLOR (https://no-color.org) turns it off too.
_PALETTE = ("cyan", "magenta", "yellow", "green", "blue", "red")


def _use_color() -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.color is not None:
        return bool(ctx.color)
    return not click.utils.should_strip_ansi(sys.stdout)


def _echo(text: str = "", color: bool = True) -> None:
    click.echo(text, color=color)


def _render_summary(view: dict) -> None:
    color = _use_color()
    s = view["stats"]
    if view.get("note"):
        _echo(f"note: {view['note']}", color)
    budget = f"{view['pack']}" + (f" of {view['batch_size']}" if view["pack"] == "batch" else f", ≤ {view['max_tokens'] or view['max_len']:,} tokens")
    _echo(click.style(f"{view['directory']}: {s['rows']:,} rows ({budget}), tokenizer {view['tokenizer']}", bold=True), color)
    _echo(f"  examples     {s['examples_read']:,} read · {s['examples_packed']:,} whole · {s['examples_split']:,} split · "
          f"{s['examples_truncated']:,} truncated · {sum((s.get('dropped_by_reason') or {}).values()):,} dropped "
          f"· {s['segments']:,} segments in rows", color)
    _echo(f"  tokens       {s['tokens']:,} in rows ({s['loss_tokens']:,} trained, {s['loss_tokens'] / max(1, s['tokens']):.1%})"
          f" · {s['tokens_truncated']:,} truncated · {s['tokens_dropped']:,} dropped", color)
    _echo(f"  fill         {s['fill']:.1%} of {s['row_budget']:,}-token rows; rows / lower bound "
          f"{s['rows'] / max(1, s['lower_bound']):.3f} ({s['lower_bound']:,})", color)
    for sh in view["shards"]:
        _echo(f"  {sh['file']}  {sh['rows']:,} rows  {sh['tokens']:,} tokens  {sh['bytes'] / 1e6:,.1f} MB  sha256 {sh['sha256'][:12]}", color)
    modes = view.get("modes")
    if not modes:
        return
    world = s.get("world_size", 1)
    _echo("", color)
    _echo(click.style(f"  the modes on these {s['segments']:,} segments ({s['tokens']:,} tokens), "
                      f"{world} rank{'s' if world != 1 else ''}, no gradient accumulation:", bold=True), color)
    head = f"    {'mode':<8}{'rows':>7}{'opt. steps':>12}{'examples/step':>15}{'computed':>11}{'padding':>9}{'peak row':>10}{'fill':>7}"
    _echo(click.style(head, dim=True), color)
    for m in modes:
        mark = "▸" if m["built"] else " "
        line = (f"  {mark} {m['mode']:<8}{m['rows']:>7,}{m['optimizer_steps']:>12,}{m['examples_per_step']:>15.1f}"
                f"{m['computed_tokens']:>11,}{m['padding']:>9.1%}{m['peak_row_tokens']:>10,}{m['fill']:>7.1%}"
                f"   {m['note']}")
        _echo(click.style(line, bold=True) if m["built"] else line, color)
    by = {m["mode"]: m for m in modes}
    pad, batch, bfd = by["padded"], by["batch"], by["bfd"]
    _echo(f"  ▸ = this build. batch: the optimizer steps and loss of padded training, {pad['padding']:.0%} fewer "
          f"tokens computed. bfd: {1 - bfd['rows'] / max(1, batch['rows']):.0%} fewer rows, but "
          f"{bfd['examples_per_step']:.1f} examples per step instead of {batch['examples_per_step']:.1f} "
          "(retune the learning rate; the loss curve changes).", color)


def _render_example(view: dict, directory: str) -> None:
    color = _use_color()
    ex = view["example_id"]
    if not view["found"]:
        _echo(f"example {ex}: in no row; {view['why_missing']}", color)
        return
    pieces = view["pieces"]
    what = []
    if view["split"]:
        what.append(f"split into {len(pieces)} pieces (--overlong {view['overlong']}, --max-len {view['max_len']})"
                    if view["pack"] != "wrap" else f"cut into {len(pieces)} pieces at row ends (--pack wrap)")
    if view["truncated"]:
        what.append(f"truncated to --max-len {view['max_len']} (its last token is not EOS)")
    _echo(click.style(f"example {ex}: {view['tokens']:,} tokens in {len(pieces)} segment{'s' if len(pieces) > 1 else ''}"
                      + (f", {'; '.join(what)}" if what else ", whole"), bold=True), color)
    for p in pieces:
        _echo(f"  row {p['row']:>6,}  segment {p['segment']:>3}  tokens {p['offset']:,}..{p['offset'] + p['length']:,} "
              f"({p['length']:,})  {p['shard']}", color)
    _echo(click.style(f"  see it: packer inspect {directory} --row {pieces[0]['row']}", dim=True), color)


def _flow(text: str) -> str:
    """One line per source line: newlines become ↵ followed by a break, tabs become spaces."""
    return text.replace("\r", "").replace("\t", "    ").replace("\n", "↵\n")


def _render_row(view: dict, show_ids: bool = False) -> None:
    import shutil

    color = _use_color()
    width = max(40, min(120, shutil.get_terminal_size((100, 24)).columns) - 4)
    segs = view["segments"]
    _echo(click.style(f"row {view['row']} · {view['shard']} · {view['tokens']:,} tokens in {len(segs)} segments · "
                      f"{view['num_loss_tokens']:,} trained · longest {view['max_seqlen']:,}", bold=True), color)
    if color:
        legend = (click.style("dim", dim=True) + " = masked (no loss) · " + click.style("bright", bold=True)
                  + " = trained · ⋯ = elided · one colour per segment")
    else:
        legend = "«…» = trained tokens, the rest is masked (no loss) · ⋯ = elided"
    _echo("  " + legend, color)
    for k, seg in enumerate(segs):
        hue = _PALETTE[k % len(_PALETTE)]
        bar = click.style("▌", fg=hue) if color else "│"
        if k:
            _echo(click.style(f"  ╞═ boundary at token {seg['offset']:,}: position_ids restart at 0, label -100 " + "═" * 8,
                              dim=True), color)
        head = (f"segment {seg['segment']} · example {seg['example_id']} · tokens {seg['offset']:,}.."
                f"{seg['offset'] + seg['length']:,} ({seg['length']:,}) · {seg['trained_tokens']:,} trained")
        _echo(f"{bar} " + (click.style(head, fg=hue, bold=True) if color else head), color)
        pieces: list[tuple[str, str]] = []  # (text, kind): kind in masked / trained / elided
        for run in seg.get("runs", []):
            if "elided" in run:
                if pieces:
                    pieces[-1] = (pieces[-1][0].rstrip(), pieces[-1][1])
                pieces.append((f" ⋯ {run['elided']:,} tokens ({run['trained']:,} trained) ⋯ ", "elided"))
                continue
            if show_ids:
                text = (" " if pieces and pieces[-1][1] != "elided" else "") + " ".join(map(str, run["ids"]))
            else:
                text = _flow(run["text"])
            if pieces and pieces[-1][1] == "elided":
                text = text.lstrip()
            if not color and run["trained"]:
                text = text[: len(text) - len(text.lstrip())] + f"«{text.lstrip()}»"
            pieces.append((text, "trained" if run["trained"] else "masked"))
        for line in _wrap(pieces, width):
            merged: list[list[str]] = []  # one escape sequence per run of equal style, not per word
            for t, kind in line:
                if merged and merged[-1][1] == kind:
                    merged[-1][0] += t
                else:
                    merged.append([t, kind])
            styled = "".join(
                t if not color else click.style(t, fg=hue, bold=kind == "trained" or None,
                                                dim=kind == "masked" or None, italic=kind == "elided" or None)
                for t, kind in merged
            )
            _echo(f"{bar} {styled}", color)


def _wrap(pieces: list[tuple[str, str]], width: int) -> list[list[tuple[str, str]]]:
    """Lay styled pieces out in lines of at most ``width`` characters, breaking at spaces (or inside a
    word longer than a line) and at the newlines the pieces hold."""
    import re

    lines: list[list[tuple[str, str]]] = [[]]
    used = 0
    for text, kind in pieces:
        for part in re.findall(r"\n|[^\S\n]*\S+|[^\S\n]+", text):
            if part == "\n":
                lines.append([])
                used = 0
                continue
            while used + len(part) > width and part:
                if used and part.strip():
                    lines.append([])
                    used = 0
                    part = part.lstrip()
                    continue
                lines[-1].append((part[:width - used], kind))
                part = part[width - used:]
                lines.append([])
                used = 0
            if part:
                lines[-1].append((part, kind))
                used += len(part)
    return [line for line in lines if line] or [[]]


@main.command()
@click.argument("directory", type=click.Path())
@click.option("--tokenizer", "-t", help="Check the shards were made with this tokenizer (its fingerprint).")
@click.option("--source", help="Re-read this source with the build's config and check every record is accounted for.")
@click.option("--quick", is_flag=True, help="Check the manifest and the shards' sizes and sha256 only.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.pass_context
def verify(ctx: click.Context, directory: str, tokenizer: str | None, source: str | None, quick: bool, as_json: bool) -> None:
    """Check a shard folder: manifest, hashes, every row's invariants; exit 0 clean, 1 problems found.

    \b
    packer verify shards/                          full check
    packer verify shards/ --quick                  manifest and hashes only
    packer verify shards/ --tokenizer my-tok/      were these made with my tokenizer?
    packer verify shards/ --source data.jsonl      is every source record accounted for?
    """
    from .verify import verify as run_verify

    report = run_verify(directory, tokenizer=tokenizer, source=source, quick=quick)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        click.echo(report.verdict())
        for problem in report.problems:
            click.echo(f"  {problem}")
    ctx.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
