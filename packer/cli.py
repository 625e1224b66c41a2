"""The `packer` command: parse → config → call the library → render → exit code.

Exit codes: 0 success; 1 a check found problems (verify); 2 bad input or usage, reported in one line
on stderr (never a traceback).
"""

from __future__ import annotations

import json
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


def _fmt(n: float) -> str:
    return f"{n:,}" if isinstance(n, int) else f"{n:,.2f}"


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
@click.option("--train-on-prompt", is_flag=True, help="Train on prompt / user tokens too (default: completion-only loss).")
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
@click.option("--num-proc", "-j", type=int, default=1, show_default=True, help="Processes for formatting and tokenizing.")
@click.option("--overwrite", is_flag=True, help="Replace a different build already in --out.")
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
@click.argument("directory", type=click.Path())
@click.option("--row", "row_index", type=int, help="Show this row segment by segment.")
@click.option("--tokenizer", "-t", help="Tokenizer to decode with (default: the one the manifest names).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(directory: str, row_index: int | None, tokenizer: str | None, as_json: bool) -> None:
    """Summarise a shard folder, or take one row apart (--row N)."""
    from . import inspect_

    if row_index is None:
        view = inspect_.summary(directory)
        if as_json:
            click.echo(json.dumps(view, indent=2))
        else:
            _render_summary(view)
        return
    from . import schema
    from .build import tokenizer_path
    from .tokenization import load_tokenizer

    name = tokenizer or schema.read_manifest(directory)["tokenizer"]["name_or_path"]
    view = inspect_.row(directory, row_index, load_tokenizer(tokenizer_path(name)))
    if as_json:
        click.echo(json.dumps(view, indent=2, ensure_ascii=False))
    else:
        _render_row(view)


def _render_summary(view: dict) -> None:
    s = view["stats"]
    if view.get("note"):
        click.echo(f"note: {view['note']}")
    budget = f"{view['pack']}" + (f" of {view['batch_size']}" if view["pack"] == "batch" else f", ≤ {view['max_tokens']:,} tokens")
    click.echo(f"{view['directory']}: {s['rows']:,} rows ({budget}), tokenizer {view['tokenizer']}")
    click.echo(f"  examples     {s['examples_read']:,} read, {s['segments']:,} segments in rows")
    click.echo(f"  tokens       {s['tokens']:,} ({s['loss_tokens']:,} trained, {s['loss_tokens'] / max(1, s['tokens']):.1%})")
    click.echo(f"  fill         {s['fill']:.1%} of {s['row_budget']:,}-token rows; rows / lower bound "
               f"{s['rows'] / max(1, s['lower_bound']):.3f} ({s['lower_bound']:,})")
    if "padded_tokens" in s:
        click.echo(f"  padding      a padded batch would hold {s['padded_tokens']:,} tokens: packing removes "
                   f"{1 - s['tokens'] / max(1, s['padded_tokens']):.1%} of them")
    for sh in view["shards"]:
        click.echo(f"  {sh['file']}  {sh['rows']:,} rows  {sh['tokens']:,} tokens  {sh['bytes'] / 1e6:,.1f} MB  sha256 {sh['sha256'][:12]}")


def _render_row(view: dict) -> None:
    click.echo(f"row {view['row']} ({view['shard']}): {view['tokens']:,} tokens, {len(view['segments'])} segments, "
               f"{view['num_loss_tokens']:,} trained, longest {view['max_seqlen']:,}")
    for seg in view["segments"]:
        click.echo(click.style(f"── segment {seg['segment']}: example {seg['example_id']}, tokens "
                               f"{seg['offset']}..{seg['offset'] + seg['length']} ({seg['length']}), "
                               f"{seg['trained_tokens']} trained ──", bold=True))
        for run in seg.get("runs", []):
            label = "train" if run["trained"] else "mask "
            text = run["text"]
            click.echo(f"[{label}] " + (click.style(text) if run["trained"] else click.style(text, dim=True)))


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
