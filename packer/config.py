"""Build configuration: one frozen, keyword-only dataclass, validated when it is made.

Everything that changes the bytes of a build is a field here and is recorded in the manifest;
what does not (the output path, ``--overwrite``, ``--num-proc``, ``--engine``) is kept out of ``identity()`` so
that the same input and config give the same manifest whatever the machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .plan import BALANCE as BALANCE_BY
from .plan import MODES as PACK_MODES
from .plan import OVERLONG as OVERLONG_POLICIES
from .recipes import hub_mix_parts

ON_ERROR = ("raise", "skip")
ENGINES = ("local", "ray")
DEFAULT_BATCH_SIZE = 8


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
    # several sources: the parts of a mix (packer.mix), each {source, weight | records, recipe, split, fields};
    # ``source`` then only names the mix in messages
    mix: tuple | None = None

    def __post_init__(self) -> None:
        def positive(name: str, value: int | None) -> None:
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

        if self.pack not in PACK_MODES:
            raise ConfigError(f"--pack must be one of {', '.join(PACK_MODES)}, got {self.pack!r}")
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}, got {self.overlong!r}")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.balance is not None and self.balance not in BALANCE_BY:
            raise ConfigError(f"--balance must be one of {', '.join(BALANCE_BY)}, got {self.balance!r}")
        for name in ("max_len", "batch_size", "max_tokens", "world_size", "limit", "shard_size_mb"):
            positive(name, getattr(self, name))
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
            if self.pack == "bfd" and self.max_len > self.max_tokens:
                raise ConfigError(
                    f"--max-len {self.max_len} exceeds the row budget --max-tokens {self.max_tokens}: an "
                    "example that long could never be placed; lower --max-len or raise --max-tokens"
                )
        if self.balance is not None and self.world_size == 1:
            raise ConfigError("--balance spreads work across ranks: give --world-size (the data-parallel size) too")
        if self.pack == "wrap" and (self.prompt_field or self.completion_field or self.messages_field):
            raise ConfigError(
                "--pack wrap is for plain text (--text-field); prompt/completion and chat data train on "
                "whole examples: use --pack batch or bfd"
            )
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
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        if self.mix is not None:
            out["mix"] = [dict(p) for p in self.mix]
        return out

    def replace(self, **changes: Any) -> BuildConfig:
        return dataclasses.replace(self, **changes)
