"""Named datasets: where each comes from and how one of its records becomes text.

A recipe is data, not code paths: its Hub id, split and fields, and the templates that turn a record
into a prompt (not trained on by default) and a completion (trained on). ``flan`` reads the bundled
synthetic FLAN-style sample in ``packer/data/`` (package data, so a wheel carries it) unless
``--from-hub`` asks for the real collection.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

# Found as package data, where an editable install and a wheel both put it. packer is a regular package
# on disk (never imported from a zip), so the resource is a real folder that a tokenizer can load from.
DATA_DIR = Path(resources.files("packer") / "data")
BUNDLED_SAMPLE = DATA_DIR / "flan_sample.jsonl.gz"
BUNDLED_TOKENIZER = DATA_DIR / "tokenizer"


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    name: str
    hub_id: str
    hub_config: str | None = None
    split: str = "train"
    hub_files: str | None = None  # the files of the Hub repo to read (a pattern), when not its default split
    # read from the Hub as a mix of these (files pattern, weight) parts instead of one split
    hub_mix: tuple[tuple[str, float], ...] | None = None
    local: Path | None = None  # read this instead of the Hub unless --from-hub
    # Prompt/completion data: templates are str.format templates over the record's fields. A field
    # named in ``optional`` may be empty, and ``prompt_if_empty`` is used then (alpaca's `input`).
    prompt_template: str | None = None
    completion_template: str | None = None
    optional: str | None = None
    prompt_if_empty: str | None = None
    messages_field: str | None = None  # chat data: a list of {"role", "content"} turns
    text_field: str | None = None  # plain text, trained on whole
    note: str | None = None  # said in the manifest and the build summary


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="flan",  # FLAN-style instruction data (inputs → targets); offline from the bundled synthetic sample
            hub_id="Open-Orca/FLAN",
            # The FLAN Collection as Open-Orca/FLAN holds it: one folder of parquet shards per submix and
            # template type (fields inputs, targets, _task_name, _task_source, _template_type). --from-hub
            # streams the zero-shot-with-options folder of each submix side by side, drawn at the Flan
            # Collection's mixing rates, so --limit N samples every submix instead of the first N records
            # of one file.
            hub_mix=(("flan_zsopt_data/*.parquet", 0.4), ("t0_zsopt_data/*.parquet", 0.32),
                     ("niv2_zsopt_data/*.parquet", 0.2), ("cot_zsopt_data/*.parquet", 0.05),
                     ("dialog_zsopt_data/*.parquet", 0.03)),
            local=BUNDLED_SAMPLE,
            prompt_template="{inputs}\n\n",
            completion_template="{targets}",
            note="synthetic FLAN-style sample bundled with packer (data/make_flan_sample.py), not FLAN data",
        ),
        Recipe(
            name="orcamath",  # Orca-Math word problems (question → answer)
            hub_id="microsoft/orca-math-word-problems-200k",
            prompt_template="Question: {question}\nAnswer: ",
            completion_template="{answer}",
        ),
        Recipe(
            name="gsm8k",  # GSM8K grade-school math (question → answer)
            hub_id="openai/gsm8k",
            hub_config="main",
            prompt_template="Question: {question}\nAnswer: ",
            completion_template="{answer}",
        ),
        Recipe(
            name="alpaca",  # Alpaca instructions (instruction [+ input] → output)
            hub_id="tatsu-lab/alpaca",
            prompt_template="### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
            prompt_if_empty="### Instruction:\n{instruction}\n\n### Response:\n",
            optional="input",
            completion_template="{output}",
        ),
        Recipe(
            name="chat",  # multi-turn chat (messages) through the tokenizer's chat template, assistant-only loss
            hub_id="HuggingFaceH4/ultrachat_200k",
            split="train_sft",
            messages_field="messages",
        ),
    )
}


def hub_mix_parts(name: str, source: str | None = None) -> list[dict] | None:
    """The mix parts a recipe is read as from the Hub (``source`` in their place: a local copy of the
    repo), or None for a recipe read as one split."""
    recipe = RECIPES.get(name)
    if recipe is None or recipe.hub_mix is None:
        return None
    return [{"source": source or name, "weight": w, "recipe": name, "files": files} for files, w in recipe.hub_mix]


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None
