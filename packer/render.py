"""What the CLI prints: pure functions from a view (a build result, an inspect view, a verify report)
to lines of text. No I/O here; ``color`` says whether lines carry ANSI styles (click.style)."""

from __future__ import annotations

import math
import re
import time

import click

from .building.mix import ran_out
from .building.pipeline import BUNDLED, BuildResult, source_parts
from .checking.report import Report
from .checking.views import Elided, Example, MixPart, Mode, Row, Summary
from .contract.schema import Stats

# One colour per segment of a drawn row, in turn.
PALETTE = ("cyan", "magenta", "yellow", "green", "blue", "red")


def plural(n: int, noun: str) -> str:
    """``1 row``, ``2 rows``: a count and its noun, singular for one."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def size_text(nbytes: float) -> str:
    """A size in the unit that shows it: ``12.3 MB``, ``45.6 kB``, ``789 bytes`` (never ``0.0 MB``)."""
    if nbytes >= 1e6:
        return f"{nbytes / 1e6:,.1f} MB"
    return f"{nbytes / 1e3:,.1f} kB" if nbytes >= 1e3 else plural(int(nbytes), "byte")


def padding_removed(tokens: int, padded_tokens: int) -> float:
    """The share of a padded run's tokens that packing does not compute."""
    return 1 - tokens / max(1, padded_tokens)


def truncation_text(left: int, too_long: int) -> str:
    """What --overlong truncate-left did, in words."""
    return (f"{left:,} at the prompt's start (answer and EOS whole) · {too_long:,} whose answer alone exceeds "
            "--max-len, cut at the end")


def padding_text(s, cfg) -> str:
    """What a padded build's padding (packer.planning.context_parallel) costs, and what it was for."""
    why = [f"a CP group of {cfg.cp_size} ({cfg.cp_layout})"] if cfg.cp_size > 1 else []
    why += [f"segments to a multiple of {cfg.pad_to_multiple_of}"] if cfg.pad_to_multiple_of > 1 else []
    return (f"{s.pad_tokens:,} tokens, {s.pad_tokens / max(1, s.tokens + s.pad_tokens):.1%} of the rows, for "
            f"{' and '.join(why)} (token id {s.pad_token_id}, untrained, in the budget)")


def disk_cost_text(epochs: int, size: int) -> str:
    """What holding every planned epoch costs on disk."""
    return f"{epochs} epochs × {size_text(size / epochs)}: the tokens are read once and written {epochs} times"


def build_lines(result: BuildResult) -> list[str]:
    """The summary of ``packer build``."""
    m = result.manifest
    s = m.stats
    cfg = m.config
    lines = []
    if result.reused:
        lines.append(f"{result.out}: already holds this build (same source, config and tokenizer); nothing to do")
    if m.note:
        lines.append(f"note: {m.note}")
    elif m.tokenizer.get("name_or_path") == BUNDLED:  # one's own data, no --tokenizer: say whose tokens these are
        vocab = m.tokenizer.get("vocab_size", 0)
        lines.append(f"note: tokenized by packer's bundled toy tokenizer (vocab {vocab:,}, trained on its FLAN-style "
                     "sample), as no --tokenizer was given: pass your model's (a folder or a Hub id) to train on these")
    mode = _budget_text(cfg, s)
    dropped = ", ".join(f"{k} {v:,}" for k, v in s.dropped_by_reason.items()) or "none"
    size = sum(sh.bytes for sh in m.shards)
    if s.paired:  # a record is a pair: counted as pairs (packer.planning.pairs), held as two sequences
        lines.append(f"pairs     {s.examples_read:,} read · {s.examples_packed:,} packed whole · "
                     f"{s.examples_truncated:,} truncated (a sequence cut to --max-len) · dropped: {dropped}")
        lines.append(f"          {pairs_text(s)}")
    else:
        lines.append(f"examples  {s.examples_read:,} read · {s.examples_packed:,} packed whole · "
                     f"{s.examples_split:,} split · {s.examples_truncated:,} truncated · dropped: {dropped}")
    if s.examples_truncated_left is not None:
        lines.append(f"truncated {truncation_text(s.examples_truncated_left, s.examples_answer_too_long)}")
    over = f" over {s.epochs} epochs" if s.epochs else ""
    lines.append(f"tokens    {s.tokens:,} in rows{over} ({s.loss_tokens:,} trained) · "
                 f"{s.tokens_truncated:,} truncated · {s.tokens_dropped:,} dropped")
    if s.segments_without_loss:
        cut = cfg.pack == "wrap" or cfg.overlong == "split"
        why = ("pieces of cut examples: all prompt, or a lone token, a segment's first, which is never trained" if cut
               else "prompts cut before their completion")
        fix = "raise --max-tokens" if cfg.pack == "wrap" else "raise --max-len or use --overlong drop"
        lines.append(f"warning   {s.segments_without_loss:,} segments hold no trained token ({why}): they cost "
                     f"compute and teach nothing; {fix}")
    if s.epochs:
        mode += f"; {s.epochs} epochs × {s.rows // s.epochs:,} rows, each its own shuffle"
    if cfg.pack == "batch":
        # Batch mode keeps the padded run's steps; its win is the padding it removes, not fewer rows.
        padded = (f"padded DPO batches ({2 * cfg.batch_size} sequences each)" if s.paired else "padded batches")
        lines.append(f"rows      {s.rows:,} ({mode}) · {padded} would hold {s.padded_tokens:,} tokens: "
                     f"packing removes {padding_removed(s.tokens, s.padded_tokens):.1%} of them")
    else:
        lines.append(f"rows      {s.rows:,} ({mode}) · fill {s.fill:.1%} · "
                     f"{s.rows / max(1, s.lower_bound):.3f} × lower bound {s.lower_bound:,}")
    if s.padded:
        lines.append(f"padding   {padding_text(s, cfg)}")
    ended = ran_out_text(cfg, s)
    if ended:
        lines.append(f"mix       {ended}")
    lines.append(f"shards    {len(m.shards)} in {result.out} ({size_text(size)}"
                 + (f"; {disk_cost_text(s.epochs, size)})" if s.epochs else ")"))
    lines.append(f"time      {result.seconds:.1f} s" + (f" (resumed: {result.resumed:,} of the {s.examples_read:,} records "
                 "were tokenized by the interrupted run)" if result.resumed is not None else "")
                 + (f" ({replanned_text(result.extended)})" if result.replanned else ""))
    lines += [f"warning   {w}" for w in result.warnings]
    return lines


def replanned_text(extended: tuple[int, ...] | None) -> str:
    """A build re-planned from the token store, and the records it tokenized beyond the entries (per part)."""
    if extended is None:
        return "re-planned from cached tokens: the source was not read nor tokenized"
    if not sum(extended):
        return "re-planned from cached tokens; the source holds no records beyond them (nothing tokenized)"
    if len(extended) == 1:
        return f"re-planned from cached tokens; tokenized {extended[0]:,} more records"
    more = [f"{n:,} {'more records ' if not said else ''}of part {k + 1}"
            for said, (k, n) in enumerate((k, n) for k, n in enumerate(extended) if n)]
    return f"re-planned from cached tokens; tokenized {', '.join(more)}"


def build_notes(result: BuildResult) -> dict:
    """What ``packer build --json`` adds beside the stats: whether it re-planned from cached tokens, the records
    it tokenized beyond the cached ones (per source; null when none were read), its warnings."""
    return {"replanned": result.replanned, "extended": None if result.extended is None else list(result.extended),
            "warnings": list(result.warnings)}


def cache_lines(folder, entries) -> list[str]:
    """``packer cache``: the token store's entries, most recently used first."""
    if not entries:
        return [f"{folder}: the token store is empty"]
    total = sum(e.bytes for e in entries)
    lines = [f"{folder}: {len(entries):,} entr{'y' if len(entries) == 1 else 'ies'}, {total / 1e6:,.1f} MB"]
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        if not e.sound:
            lines.append(f"  {e.path.name}  {e.bytes / 1e6:9,.1f} MB  {used}  (unfinished or damaged: the next build "
                         "that needs it tokenizes again)")
            continue
        a = e.about
        held = "all its" if a.get("complete") else "its first"  # a later build may take up to that many
        lines.append(f"  {e.path.name}  {e.bytes / 1e6:9,.1f} MB  {used}  {' + '.join(a.get('sources', []))} · "
                     f"{a.get('tokenizer')} · {held} {a.get('records', 0):,} records, {a.get('tokens', 0):,} tokens")
    return lines


def _budget_text(cfg, s: Stats) -> str:
    """A build's mode and row budget, in its unit (a preference build's batch is of pairs)."""
    if cfg.pack == "batch":
        return f"batch of {cfg.batch_size}" + (" pairs" if s.paired else "")
    budget = cfg.row_budget()  # the rows' true budget: a padded build's max_tokens rounded down to its multiple
    if budget == cfg.max_tokens:
        return f"{cfg.pack}, ≤ {budget:,} tokens"
    layout = cfg.layout()
    step = math.lcm(layout.segment_multiple, layout.row_multiple)
    return f"{cfg.pack}, ≤ {budget:,} tokens: --max-tokens {cfg.max_tokens:,} rounded down to a multiple of {step}"


def pairs_text(s: Stats) -> str:
    """What a preference build's rows hold: its pairs, their sequences and rows (every epoch's)."""
    epochs = f" × {s.epochs} epochs" if s.epochs else ""
    return (f"{plural(s.pairs, 'pair')}{epochs} → {plural(s.segments, 'sequence')} in {plural(s.rows, 'row')} "
            f"({s.segments / 2 / max(1, s.rows):.1f} pairs a row, never split)")


def _plain(lines: list[str], color: bool) -> list[str]:
    """The lines as they are, or without their styles when colour is off."""
    return lines if color else [click.unstyle(line) for line in lines]


def verify_lines(report: Report) -> list[str]:
    """The verdict of ``packer verify`` and one line per problem."""
    return [report.verdict(), *(f"  {problem}" for problem in report.problems)]


def summary_lines(view: Summary, color: bool) -> list[str]:
    """The summary of ``packer inspect DIR``: the build's numbers, then the modes compared on it."""
    lines: list[str] = []
    s, cfg = view.stats, view.config
    if view.note:
        lines.append(f"note: {view.note}")
    lines.append(click.style(f"{view.directory}: {plural(s.rows, 'row')} ({_budget_text(cfg, s)}), tokenizer {view.tokenizer}",
                             bold=True))
    if s.paired:
        lines.append(f"  pairs        {s.examples_read:,} read · {s.examples_packed:,} whole · {s.examples_truncated:,} "
                     f"truncated · {sum(s.dropped_by_reason.values()):,} dropped · {pairs_text(s)}")
        if view.row_pairs is not None:
            fewest, mean, most = view.row_pairs
            lines.append(f"  pairs a row  {mean:.1f} ({fewest}..{most}); each pair is prompt + chosen, then prompt + "
                         "rejected, side by side in one row (pair_roles 1, 0)")
    else:
        lines.append(f"  examples     {s.examples_read:,} read · {s.examples_packed:,} whole · {s.examples_split:,} split · "
                     f"{s.examples_truncated:,} truncated · {sum(s.dropped_by_reason.values()):,} dropped "
                     f"· {plural(s.segments, 'segment')} in rows")
    lines.append(f"  tokens       {s.tokens:,} in rows ({s.loss_tokens:,} trained, {s.loss_tokens / max(1, s.tokens):.1%})"
                 f" · {s.tokens_truncated:,} truncated · {s.tokens_dropped:,} dropped")
    if s.examples_truncated_left is not None:
        lines.append(f"  truncated    {truncation_text(s.examples_truncated_left, s.examples_answer_too_long)}")
    if view.images is not None:  # an image build
        count, size, processor = view.images
        lines.append(f"  images       {count:,} in rows · {size / 1e6:,.1f} MB, {size / max(1, view.bytes):.0%} of the "
                     f"shards · stored as their source bytes · {processor} (docs/images.md)")
    lines.append(f"  fill         {s.fill:.1%} of {s.row_budget:,}-token rows; rows / lower bound "
                 f"{s.rows / max(1, s.lower_bound):.3f} ({s.lower_bound:,})")
    if s.padded:
        lines.append(f"  padding      {padding_text(s, cfg)}")
    if s.epochs:
        lines.append(f"  epochs       {s.epochs} planned, each its own shuffle: {s.rows:,} rows = {s.epochs} × "
                     f"{s.rows // s.epochs:,} · {size_text(view.bytes)} on disk = {disk_cost_text(s.epochs, view.bytes)}")
    if view.mix:
        lines.extend(mix_lines(view.mix))
        ended = ran_out_text(cfg, s)
        if ended:
            lines.append(f"  {ended}")
    for sh in view.shards:
        lines.append(f"  {sh.file}  {plural(sh.rows, 'row')}  {plural(sh.tokens, 'token')}  {size_text(sh.bytes)}  "
                     f"sha256 {sh.sha256[:12]}")
    if view.modes:
        lines.extend(modes_lines(view.modes, s))
    return _plain(lines, color)


def _fill(m: Mode) -> str:
    """A mode's fill (its tokens over rows × its peak row), except the padded baseline's: its cost is said
    by its padding, and a fill of its padded peak beside that would read as a second, contradicting figure."""
    return "—" if m.mode == "padded" else f"{m.fill:.1%}"


def modes_lines(modes: tuple[Mode, ...], s: Stats) -> list[str]:
    """The modes compared on the build's segments: a table, then what it means."""
    world = s.world_size
    # modes plan the padded segments; a contiguous CP build's rows' own padding is each mode's (its computed tokens)
    segment_padding = modes[0].tokens - s.tokens
    padding = f", {segment_padding:,} of them padding" if segment_padding else ""
    unit = "pairs" if s.paired else "examples"  # a preference build's modes place pairs whole
    what = (f"{s.segments // 2:,} pairs ({s.segments:,} segments, each pair placed whole, " if unit == "pairs"
            else f"{s.segments:,} segments (")
    lines = ["", click.style(f"  the modes on these {what}{modes[0].tokens:,} tokens{padding}"
                             + (f", all {s.epochs} epochs" if s.epochs else "") + "), "
                             f"{world} rank{'s' if world != 1 else ''}, no gradient accumulation:", bold=True)]
    per_step = f"{unit}/step"
    head = f"    {'mode':<8}{'rows':>7}{'opt. steps':>12}{per_step:>15}{'computed':>11}{'padding':>9}{'peak row':>10}{'fill':>7}"
    lines.append(click.style(head, dim=True))
    for m in modes:
        mark = "▸" if m.built else " "
        line = (f"  {mark} {m.mode:<8}{m.rows:>7,}{m.optimizer_steps:>12,}{m.examples_per_step:>15.1f}"
                f"{m.computed_tokens:>11,}{m.padding:>9.1%}{m.peak_row_tokens:>10,}{_fill(m):>7}   {m.note}")
        lines.append(click.style(line, bold=True) if m.built else line)
    by = {m.mode: m for m in modes}
    pad, batch, bfd, opt = by["padded"], by["batch"], by["bfd"], by["optimal"]
    fewer = 1 - bfd.rows / max(1, batch.rows)  # negative where the batch rows are larger than bfd's budget
    lines.append(f"  ▸ = this build; fill = tokens / (rows × peak row). batch: the optimizer steps and loss of padded training, {pad.padding:.0%} fewer "
                 f"tokens computed. bfd: {abs(fewer):.0%} {'fewer' if fewer >= 0 else 'more'} rows, but "
                 f"{bfd.examples_per_step:.1f} {unit} per step instead of {batch.examples_per_step:.1f} "
                 f"(retune the learning rate; the loss curve changes). optimal: bfd's budget in {opt.rows:,} rows, "
                 f"{bfd.rows - opt.rows:,} fewer.")
    return lines


def ran_out_text(cfg, s: Stats) -> str | None:
    """Which part of a weighted mix ran out and so ended it (None: not a weighted mix, or it ended at
    --limit), with what each part gave."""
    parts = source_parts(cfg)
    k = ran_out(list(parts), cfg.seed, cfg.limit, s.examples_read)
    if k is None:
        return None
    read = [part.get("records_read") for part in s.sources or ()]
    gave = f" after {read[k]:,} records" if k < len(read) and read[k] is not None else ""
    rest = "; the other parts' records past their draws were not read" + \
        (" (--limit not reached)" if cfg.limit is not None else "")
    return f"ended when part {k + 1}, {parts[k]['source']}, ran out{gave} (its weight {parts[k]['weight']:g}){rest}"


def mix_lines(parts: tuple[MixPart, ...]) -> list[str]:
    """A mix's sources, one line each: what was asked (weight or records) and what each gave."""
    lines = [click.style(f"  {'mix':<13}{'asked':>9}{'read':>9}{'whole':>9}{'split':>7}{'trunc.':>8}{'dropped':>9}"
                         f"{'tokens':>12}{'share':>7}", dim=True)]
    for p in parts:
        c = p.counts
        asked = f"w {p.weight:g}" if p.weight is not None else f"{p.records:,}"
        name = p.source if len(p.source) <= 12 else "…" + p.source[-11:]
        lines.append(f"  {name:<13}{asked:>9}{c['records_read']:>9,}{c['examples_packed']:>9,}{c['examples_split']:>7,}"
                     f"{c['examples_truncated']:>8,}{sum(c['dropped_by_reason'].values()):>9,}{c['tokens']:>12,}"
                     f"{p.token_share:>7.1%}")
    return lines


def example_lines(view: Example, directory: str, color: bool) -> list[str]:
    """Where ``packer inspect DIR --example ID`` found the example."""
    lines: list[str] = []
    ex = view.example_id
    if not view.found:
        lines.append(f"{'pair' if view.paired else 'example'} {ex}: in no row; {view.why_missing}")
        return _plain(lines, color)
    pieces = view.pieces
    what = []
    if view.split:
        what.append(f"split into {len(pieces)} pieces (--overlong {view.overlong}, --max-len {view.max_len})"
                    if view.pack != "wrap" else f"cut into {len(pieces)} pieces at row ends (--pack wrap)")
    if view.truncated:
        what.append(f"truncated to --max-len {view.max_len} " + (
            "(its last token is not EOS)" if view.overlong == "truncate" else "(--overlong truncate-left)"))
    if view.truncated and view.paired:
        what[-1] = f"a sequence truncated to --max-len {view.max_len} (--overlong {view.overlong})"
    epochs = view.epochs
    per_epoch = [p for p in pieces if not p.epoch]
    kind = "pair" if view.paired else "example"
    lines.append(click.style(f"{kind} {ex}: {view.tokens:,} tokens in {len(per_epoch)} segment{'s' if len(per_epoch) > 1 else ''}"
                             + (" (prompt + chosen, prompt + rejected)" if view.paired else "")
                             + (f" in each of {epochs} epochs" if epochs > 1 else "")
                             + (f", {'; '.join(what)}" if what else ", whole"), bold=True))
    for p in pieces:
        role = "" if p.role is None else f"  {p.role:<8}"
        lines.append(f"  row {p.row:>6,}  segment {p.segment:>3}{role}  tokens {p.offset:,}..{p.offset + p.length:,} "
                     f"({p.length:,})  {p.shard}" + (f"  epoch {p.epoch}" if epochs > 1 else ""))
    lines.append(click.style(f"  see it: packer inspect {directory} --row {pieces[0].row}", dim=True))
    return _plain(lines, color)


def _flow(text: str) -> str:
    """One line per source line: newlines become ↵ followed by a break, tabs become spaces."""
    return text.replace("\r", "").replace("\t", "    ").replace("\n", "↵\n")


def row_lines(view: Row, *, show_ids: bool, color: bool, width: int) -> list[str]:
    """One row drawn segment by segment in lines of at most ``width`` characters."""
    lines: list[str] = []
    segs = view.segments
    pairs = "" if view.pairs is None else f" ({view.pairs} pairs)"
    lines.append(click.style(f"row {view.row} · {view.shard} · {view.tokens:,} tokens in {len(segs)} segments{pairs} · "
                             f"{view.num_loss_tokens:,} trained · longest {view.max_seqlen:,}", bold=True))
    if color:
        legend = (click.style("dim", dim=True) + " = masked (no loss) · " + click.style("bright", bold=True)
                  + " = trained · ⋯ = elided · one colour per segment")
    else:
        legend = "«…» = trained tokens, the rest is masked (no loss) · ⋯ = elided"
    lines.append("  " + legend)
    for k, seg in enumerate(segs):
        hue = PALETTE[k % len(PALETTE)]
        bar = click.style("▌", fg=hue) if color else "│"
        if k:
            lines.append(click.style(f"  ╞═ boundary at token {seg.offset:,}: position_ids restart at 0, label -100 " + "═" * 8,
                              dim=True))
        role = "" if seg.role is None else f"pair {seg.pair} {seg.role} · "
        padded = f" · {seg.pad_tokens:,} padding" if seg.pad_tokens else ""
        head = (f"segment {seg.segment} · {role}example {seg.example_id} · tokens {seg.offset:,}.."
                f"{seg.offset + seg.length:,} ({seg.length:,}) · {seg.trained_tokens:,} trained{padded}")
        lines.append(f"{bar} " + (click.style(head, fg=hue, bold=True) if color else head))
        if seg.images:  # an image build: the segment's images, each a span of placeholder tokens
            spans = "; ".join(f"{i['tokens']:,} tokens at {i['offset']:,}, {i['height']} x {i['width']}" for i in seg.images)
            lines.append(f"{bar} " + click.style(f"{len(seg.images)} image(s): {spans}", dim=color or None))
        pieces: list[tuple[str, str]] = []  # (text, kind): kind in masked / trained / elided
        for run in seg.runs or ():
            if isinstance(run, Elided):
                if pieces:
                    pieces[-1] = (pieces[-1][0].rstrip(), pieces[-1][1])
                pieces.append((f" ⋯ {run.elided:,} tokens ({run.trained:,} trained) ⋯ ", "elided"))
                continue
            if show_ids:
                text = (" " if pieces and pieces[-1][1] != "elided" else "") + " ".join(map(str, run.ids))
            else:
                text = _flow(run.text)
            if pieces and pieces[-1][1] == "elided":
                text = text.lstrip()
            if not color and run.trained:
                text = text[: len(text) - len(text.lstrip())] + f"«{text.lstrip()}»"
            pieces.append((text, "trained" if run.trained else "masked"))
        if seg.pad_tokens and seg.runs is not None:  # the runs stop at the segment's own end
            pieces.append((f" + {seg.pad_tokens:,} padding", "elided"))
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
            lines.append(f"{bar} {styled}")
        if _appended_after_own_end(seg, view.eos_token_id):
            lines.append(f"{bar} " + click.style("(last token: the EOS packer appends after the template's own end "
                                                  "of turn; docs/chat.md)", dim=True))
    return _plain(lines, color)


def _appended_after_own_end(seg, eos: int | None) -> bool:
    """A chat render that ends with its end-of-turn token (the EOS) and a newline gets one more EOS from
    packer: `<|im_end|>` twice, which reads like a bug unless said."""
    ids = seg.ids[: len(seg.ids) - (seg.pad_tokens or 0)]  # padding (often the EOS id) is not the render's
    return eos is not None and len(ids) >= 2 and ids[-1] == eos and eos in ids[-3:-1] and seg.runs is not None


def _wrap(pieces: list[tuple[str, str]], width: int) -> list[list[tuple[str, str]]]:
    """Lay styled pieces out in lines of at most ``width`` characters, breaking at spaces (or inside a
    word longer than a line) and at the newlines the pieces hold."""
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
