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

from .errors import ConfigError
from .plan import BALANCE as BALANCE_BY
from .plan import MODES as PACK_MODES
from .plan import OVERLONG as OVERLONG_POLICIES
from .recipes import hub_mix_parts

ON_ERROR = ("raise", "skip")
ENGINES = ("local", "ray")
TRAIN_ON = ("assistant", "last", "all")
DEFAULT_BATCH_SIZE = 8
# Fields added after the first manifests: recorded only when they differ from their default, so a
# build that does not use them keeps the bytes (and the identity) it had before they existed.
_RECORDED_WHEN_SET = ("train_on", "chat_template", "tools_field", "epochs")
ROW_LIMIT = 2**31 - 1  # tokens a row can hold: its int32 positions, seq_lens and Arrow list offsets
RECORD_LIMIT = 2**63 - 1  # records a build can number: example ids are int64


def _option(field: str) -> str:
    """The command-line option of a field (they differ where the field names its unit)."""
    return {"shard_size_mb": "--shard-size"}.get(field, "--" + field.replace("_", "-"))


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
    # several sources: the parts of a mix (packer.mix), each {source, weight | records, recipe, split, fields};
    # ``source`` then only names the mix in messages
    mix: tuple | None = None

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and value < 1:
                raise ConfigError(f"{_option(name)} must be at least 1, got {value}")

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
        if self.pack not in PACK_MODES:
            raise ConfigError(f"--pack must be one of {', '.join(PACK_MODES)}, got {self.pack!r}")
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {self.overlong!r}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"--train-on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")
        if self.train_on_prompt:  # --train-on-prompt is kept as an alias of --train-on all
            if self.train_on not in ("assistant", "all"):
                raise ConfigError(f"--train-on-prompt means --train-on all, not {self.train_on}; drop one of the two")
            object.__setattr__(self, "train_on", "all")
        object.__setattr__(self, "train_on_prompt", self.train_on == "all")
        if self.balance is not None and self.balance not in BALANCE_BY:
            raise ConfigError(f"--balance must be one of {', '.join(BALANCE_BY)}, got {self.balance!r}")
        for name in ("max_len", "batch_size", "max_tokens", "world_size", "limit", "shard_size_mb", "epochs"):
            positive(name, getattr(self, name))
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
        if self.pack == "batch":
            if self.max_tokens is not None:
                raise ConfigError(
                    "--max-tokens is a row budget for --pack bfd or wrap; --pack batch fixes the examples "
                    "per row instead (--batch-size); drop one of the two"
                )
            if self.batch_size is None:
                object.__setattr__(self, "batch_size", DEFAULT_BATCH_SIZE)
        else:
            if self.batch_size is not None:
                raise ConfigError(
                    f"--batch-size applies to --pack batch only; --pack {self.pack} fills rows up to "
                    "--max-tokens instead; drop one of the two"
                )
            if self.max_tokens is None:
                object.__setattr__(self, "max_tokens", self.max_len)
            if self.pack in ("bfd", "optimal") and self.max_len > self.max_tokens:
                raise ConfigError(
                    f"--max-len {self.max_len} exceeds the row budget --max-tokens {self.max_tokens}: an "
                    "example that long could never be placed; lower --max-len or raise --max-tokens"
                )
        if self.epochs > 1 and self.pack == "wrap":
            raise ConfigError(
                f"--epochs {self.epochs} with --pack wrap: wrap keeps source order, so every epoch would hold the "
                "same rows; build one epoch (the loader replays it each epoch) or use --pack batch or bfd"
            )
        if self.balance is not None and self.world_size == 1:
            raise ConfigError("--balance spreads work across ranks: give --world-size (the data-parallel size) too")
        if self.messages_field and (self.prompt_field or self.completion_field or self.text_field):
            raise ConfigError("--messages-field cannot be combined with --prompt-field/--completion-field/--text-field")
        if self.text_field and (self.prompt_field or self.completion_field):
            raise ConfigError("--text-field (plain text) cannot be combined with --prompt-field/--completion-field")
        if self.mix is None and self.from_hub:  # a recipe read from the Hub as a mix of its parts (flan)
            parts = hub_mix_parts(self.source)
            if parts is not None:
                object.__setattr__(self, "mix", tuple(parts))
        if self.mix is not None:
            given = [f"--{n.replace('_', '-')}" for n in ("recipe", "split", "prompt_field", "completion_field",
                                                         "messages_field", "text_field") if getattr(self, n)]
            if given:
                raise ConfigError(f"{', '.join(given)} cannot apply to every source of a mix; set them per source in "
                                  "a mix file (--mix mix.yaml)")

    def identity(self) -> dict[str, Any]:
        """The fields that decide the output's bytes (recorded in the manifest, compared on rebuild)."""
        skip = {"out", "overwrite", "num_proc", "engine"}
        if self.mix is None:
            skip.add("mix")  # absent from a one-source build's manifest, as it always was
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in skip and not (f.name in _RECORDED_WHEN_SET and getattr(self, f.name) == f.default)}
        if self.mix is not None:
            out["mix"] = [dict(p) for p in self.mix]
        return out

    def replace(self, **changes: Any) -> BuildConfig:
        return dataclasses.replace(self, **changes)

