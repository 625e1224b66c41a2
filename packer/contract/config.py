"""Build configuration: one frozen, keyword-only dataclass, validated when it is made.

Everything that changes the bytes of a build is a field here and is recorded in the manifest;
what does not (the output path, ``--overwrite``, ``--num-proc``, ``--engine``) is kept out of ``identity()`` so
that the same input and config give the same manifest whatever the machine.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..planning.context_parallel import LAYOUTS as CP_LAYOUTS
from ..planning.context_parallel import Layout
from ..planning.pairs import check_pair_budget, pair_budget
from ..planning.plan import BALANCE as BALANCE_BY
from ..planning.plan import MODES as PACK_MODES
from ..planning.plan import OVERLONG as OVERLONG_POLICIES
from ..planning.plan import check_epochs, padded_budget, row_size
from .recipes import hub_mix_parts

ON_ERROR = ("raise", "skip")
ENGINES = ("local", "ray")
TRAIN_ON = ("assistant", "last", "all")
DEFAULT_BATCH_SIZE = 8
# Fields added after the first manifests: recorded only when they differ from their default, so a
# build that does not use them keeps the bytes (and the identity) it had before they existed.
_RECORDED_WHEN_SET = ("train_on", "chat_template", "tools_field", "epochs", "cp_size", "cp_layout",
                      "pad_to_multiple_of", "compression", "processor", "images_field")
# Fields whose absence from a recorded config means a value other than their default: the format
# version, whose default moved to 2 when it became a field, is absent from every version-1 manifest.
_ABSENT_MEANS = {"format_version": 1}
FORMAT_VERSIONS = (1, 2)  # what a build can write (packer.contract.schema: what each holds)
COMPRESSIONS = (None, "zstd")  # Arrow IPC buffer compression of the shards
ROW_LIMIT = 2**31 - 1  # tokens a row can hold: its int32 positions, seq_lens and Arrow list offsets
RECORD_LIMIT = 2**63 - 1  # records a build can number: example ids are int64


def _option(field: str) -> str:
    """The command-line option of a field (they differ where the field names its unit)."""
    return {"shard_size_mb": "--shard-size", "mode": "--pack", "format_version": "--format"}.get(
        field, "--" + field.replace("_", "-"))


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildConfig:
    source: str
    out: str
    recipe: str | None = None
    split: str | None = None
    from_hub: bool = False
    tokenizer: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None
    text_field: str | None = None
    train_on_prompt: bool = False
    max_len: int = 4096
    pack: str = "batch"
    batch_size: int | None = None
    max_tokens: int | None = None
    overlong: str = "truncate"
    world_size: int = 1
    balance: str | None = None
    seed: int = 0
    limit: int | None = None
    shard_size_mb: int = 256
    on_error: str = "raise"
    # 0: one tokenizing process per core, the measured fastest (2 processes on 2 cores: 1.85-1.90x one
    # process, against 1.73-1.79x for one process whose Rust tokenizer threads use both cores)
    num_proc: int = 0
    engine: str = "local"
    overwrite: bool = False
    # Added later (see _RECORDED_WHEN_SET)
    train_on: str = "assistant"  # "assistant" (completion-only for prompt/completion data), "last" or "all"
    chat_template: str | None = None  # a Jinja file used instead of the tokenizer's chat template
    tools_field: str | None = None  # chat: the record field holding tool definitions (default: "tools" if present)
    epochs: int = 1  # plan this many epochs, each its own shuffle of the examples; the shards hold them all
    # padding for context parallelism and kernels (packer.planning.context_parallel): the CP group size, its layout
    # ("zigzag" when cp_size > 1 and none is given), and a multiple every segment is padded to
    cp_size: int = 1
    cp_layout: str | None = None
    pad_to_multiple_of: int = 1
    # several sources: the parts of a mix (packer.building.mix), each {source, weight | records, recipe, split, fields};
    # ``source`` then only names the mix in messages
    mix: tuple | None = None
    # the on-disk format (packer.contract.schema.RowFormat): 2 narrows the token columns, 1 is the int32
    # format every packer before it wrote; and the shards' compression (None, or "zstd": not memory-mapped)
    format_version: int = 2
    compression: str | None = None
    # whether max_tokens was given, filled in when the config is made and kept by replace(); not recorded nor
    # compared (a recorded config reads its max_tokens back as given). A preference build's default row budget
    # is a pair's, not a sequence's (for_pairs)
    max_tokens_given: bool | None = dataclasses.field(default=None, compare=False, repr=False)
    # keep the tokens in the token store and re-plan from it (packer.building.token_store); not recorded: the
    # bytes are the same either way
    cache: bool = True
    # image+text data (docs/images.md): the processor folder, and the record field holding each record's images
    processor: str | None = None
    images_field: str | None = None

    def __post_init__(self) -> None:
        self._check_names()
        self._check_values()
        # the one step that changes a frozen config: the values it derives from those given
        for name, value in self._normalised().items():
            object.__setattr__(self, name, value)
        self._check_mix()
        self._check_images()
        if self.layout() is not None:  # padding that cannot fit, in any mode: refused before anything is read
            padded_budget(self.layout(), self.pack, self.max_len, self.max_tokens)

    def _check_names(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError("SOURCE is empty; give a recipe, a file, folder or glob, or a Hub id (see --help)")
        for option, path in (("SOURCE", self.source), ("--out", self.out)):
            try:
                path.encode("utf-8")
            except UnicodeEncodeError:  # a file name of undecodable bytes, as Python's argv carries it
                shown = os.fsencode(path).decode("utf-8", "backslashreplace")
                raise ConfigError(
                    f"{option} {shown}: the name is not UTF-8 text, which the manifest and Arrow need; "
                    "rename it"
                ) from None

    def _check_values(self) -> None:
        """Each field's own rule, and the options that exclude each other (the mode's: plan.row_size)."""
        for name, allowed in (("pack", PACK_MODES), ("overlong", OVERLONG_POLICIES), ("on_error", ON_ERROR),
                              ("engine", ENGINES), ("train_on", TRAIN_ON), ("balance", (None, *BALANCE_BY))):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{_option(name)} must be one of {', '.join(a for a in allowed if a)}, got {value!r}")
        if self.train_on_prompt and self.train_on not in ("assistant", "all"):  # --train-on-prompt: --train-on all
            raise ConfigError(f"--train-on-prompt means --train-on all, not {self.train_on}; drop one of the two")
        for name in ("max_len", "batch_size", "max_tokens", "world_size", "limit", "shard_size_mb", "epochs", "cp_size",
                     "pad_to_multiple_of"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{_option(name)} must be at least 1, got {value}")
        for name in ("max_len", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value > ROW_LIMIT:
                raise ConfigError(
                    f"{_option(name)} {value:,} is more than a row can hold: at most {ROW_LIMIT:,} "
                    "tokens, as a row's positions, seq_lens and Arrow list offsets are int32"
                )
        if self.limit is not None and self.limit > RECORD_LIMIT:
            raise ConfigError(f"--limit {self.limit:,} is more records than a build can number (example ids are int64: "
                              f"at most {RECORD_LIMIT:,}); leave --limit out to read every record")
        if self.seed < 0:
            raise ConfigError(f"--seed must be 0 or more, got {self.seed}")
        if self.num_proc < 0:
            raise ConfigError(f"--num-proc must be 0 (one per core) or more, got {self.num_proc}")
        if self.max_len < 2:
            raise ConfigError(f"--max-len must be at least 2 tokens (BOS and EOS), got {self.max_len}")
        check_epochs(self.pack, self.epochs, name=_option)
        if isinstance(self.format_version, bool) or self.format_version not in FORMAT_VERSIONS:
            raise ConfigError(f"--format must be one of {', '.join(map(str, FORMAT_VERSIONS))}, got "
                              f"{self.format_version!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"--compression must be zstd or left out (no compression), got {self.compression!r}")
        if self.cp_layout not in (None, *CP_LAYOUTS):
            raise ConfigError(f"--cp-layout must be one of {', '.join(CP_LAYOUTS)}, got {self.cp_layout!r}")
        if self.cp_layout is not None and self.cp_size == 1:
            raise ConfigError("--cp-layout lays a row out for a context-parallel group: give --cp-size (its ranks) too")
        if self.balance is not None and self.world_size == 1:
            raise ConfigError("--balance spreads work across ranks: give --world-size (the data-parallel size) too")
        if self.messages_field and (self.prompt_field or self.completion_field or self.text_field):
            raise ConfigError("--messages-field cannot be combined with --prompt-field/--completion-field/--text-field")
        if self.text_field and (self.prompt_field or self.completion_field):
            raise ConfigError("--text-field (plain text) cannot be combined with --prompt-field/--completion-field")

    def _normalised(self) -> dict[str, Any]:
        """The fields whose value follows from the others: --train-on-prompt as --train-on all, the row
        size the mode takes, and a recipe read from the Hub as the mix of its parts (flan)."""
        train_on = "all" if self.train_on_prompt else self.train_on
        batch_size, max_tokens = row_size(self.pack, self.max_len, self.max_tokens, self.batch_size,
                                          default_batch=DEFAULT_BATCH_SIZE, name=_option)
        mix = self.mix
        if mix is None and self.from_hub:
            parts = hub_mix_parts(self.source)
            mix = None if parts is None else tuple(parts)
        cp_layout = "zigzag" if self.cp_size > 1 and self.cp_layout is None else self.cp_layout
        given = self.max_tokens is not None if self.max_tokens_given is None else self.max_tokens_given
        tokenizer = self.processor if self.tokenizer is None else self.tokenizer  # a processor's folder holds its tokenizer
        return {"tokenizer": tokenizer, "train_on": train_on, "train_on_prompt": train_on == "all", "batch_size": batch_size,
                "max_tokens": max_tokens, "mix": mix, "cp_layout": cp_layout, "max_tokens_given": given}

    def _check_images(self) -> None:
        """What an image build cannot do (its examples are never cut inside an image)."""
        if self.processor is None:
            if self.images_field is not None:
                raise ConfigError("--images-field names the images of image+text records: give --processor too")
            return
        refused = [(self.pack == "wrap", "--pack wrap cuts examples anywhere, inside an image too; use --pack batch, "
                                         "bfd or optimal"),
                   (self.overlong == "split", "--overlong split cuts examples anywhere, inside an image too; use "
                                              "--overlong truncate (text after the last image) or drop"),
                   (self.overlong == "truncate-left", "--overlong truncate-left would cut the images at the start; "
                                                      "use --overlong truncate or drop"),
                   (self.engine == "ray", "--engine ray does not carry images yet; use --engine local"),
                   (self.cp_size > 1 or self.pad_to_multiple_of > 1, "--cp-size/--pad-to-multiple-of: padding an "
                                                                     "image build is not supported yet")]
        for bad, why in refused:
            if bad:
                raise ConfigError(f"--processor (image+text data): {why}")

    def _check_mix(self) -> None:
        if self.mix is None:
            return
        given = [_option(n) for n in ("recipe", "split", "prompt_field", "completion_field", "messages_field",
                                      "text_field") if getattr(self, n)]
        if given:
            raise ConfigError(f"{', '.join(given)} cannot apply to every source of a mix; set them per source in "
                              "a mix file (--mix mix.yaml)")

    def identity(self) -> dict[str, Any]:
        """The fields that decide the output's bytes (recorded in the manifest, compared on rebuild)."""
        skip = {"out", "overwrite", "num_proc", "engine", "max_tokens_given", "cache"}
        if self.mix is None:
            skip.add("mix")  # absent from a one-source build's manifest, as it always was
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in skip and not (f.name in _RECORDED_WHEN_SET and getattr(self, f.name) == f.default)
               and not (f.name in _ABSENT_MEANS and getattr(self, f.name) == _ABSENT_MEANS[f.name])}
        if self.mix is not None:
            out["mix"] = [dict(p) for p in self.mix]
        return out

    def layout(self, pad_id: int = 0) -> Layout | None:
        """The padding this build asks for, its tokens given ``pad_id``; None when it asks for none."""
        if self.cp_size == 1 and self.pad_to_multiple_of == 1:
            return None
        return Layout(cp_size=self.cp_size, cp_layout=self.cp_layout or "zigzag", multiple=self.pad_to_multiple_of,
                      pad_id=pad_id)

    def row_budget(self) -> int | None:
        """The most tokens a row may hold, padding included: ``max_tokens``, rounded down to the padding's
        multiples in a padded build (``Layout.budget``); None in mode ``batch``, whose rows hold a count of
        examples instead."""
        if self.pack == "batch":
            return None
        layout = self.layout()
        return self.max_tokens if layout is None else layout.budget(self.max_tokens)

    def longest_segment(self) -> int:
        """The most tokens a segment may hold, padding included (what version 2's positions must count
        to): the row budget in mode ``wrap``, else ``max_len`` padded (a contiguous layout's last
        segment also takes its row's padding), and never more than the row budget."""
        if self.pack == "wrap":
            return self.row_budget()
        layout = self.layout()
        if layout is None:
            return self.max_len
        longest = -(-self.max_len // layout.segment_multiple) * layout.segment_multiple + layout.row_multiple - 1
        budget = self.row_budget()
        return longest if budget is None else min(longest, budget)

    def for_pairs(self) -> BuildConfig:
        """The config a preference build plans and records: in ``bfd``/``optimal`` a row must hold a pair, two
        sequences of up to ``max_len`` (padded as the layout pads each), so the default ``max_tokens`` is
        that (``pairs.pair_budget``: the SFT default, ``max_len``, doubled) and a given one that cannot hold
        it is refused in one line, before anything is read."""
        if self.pack not in ("bfd", "optimal"):
            return self
        if self.max_tokens_given:
            check_pair_budget(self.max_len, self.max_tokens, self.layout())
            return self
        return self.replace(max_tokens=max(self.max_tokens, pair_budget(self.max_len, self.layout())),
                            max_tokens_given=False)

    def replace(self, **changes: Any) -> BuildConfig:
        """A copy with ``changes``. A ``max_tokens`` among them counts as given (for_pairs checks it, never
        widens it); a new ``max_len`` on a config whose ``max_tokens`` was derived derives it again."""
        if "max_tokens" in changes:
            changes.setdefault("max_tokens_given", changes["max_tokens"] is not None)
        elif "max_len" in changes and not self.max_tokens_given:
            changes["max_tokens"] = None
        return dataclasses.replace(self, **changes)

