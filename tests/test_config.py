"""BuildConfig: the mode/budget rule is plan.row_size's, so a config is accepted exactly when its plan
can be made, and normalisation fills what the mode takes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from packer import BuildConfig
from packer.contract.config import DEFAULT_BATCH_SIZE
from packer.errors import ConfigError
from packer.planning.context_parallel import Layout
from packer.planning.plan import MODES, plan_epochs


def _outcome(make, **kwargs):
    try:
        return make(**kwargs)
    except ConfigError:
        return None


# (cp_size, cp_layout, pad_to_multiple_of): none, each layout, a kernel multiple alone and with each layout
PADDINGS = [(1, None, 1), (2, "zigzag", 1), (3, "contiguous", 1), (1, None, 3), (2, "zigzag", 4),
            (3, "contiguous", 2), (2, "contiguous", 5)]


@pytest.mark.parametrize("mode", MODES)
def test_a_config_is_accepted_exactly_when_its_plan_can_be_made(mode):
    for max_len, max_tokens, batch_size, epochs, padding in itertools.product((8, 16), (None, 4, 8, 16, 18), (None, 2),
                                                                               (1, 2), PADDINGS):
        cp_size, cp_layout, multiple = padding
        config = _outcome(BuildConfig, source="flan", out="-", pack=mode, max_len=max_len, max_tokens=max_tokens,
                          batch_size=batch_size, epochs=epochs, cp_size=cp_size, cp_layout=cp_layout,
                          pad_to_multiple_of=multiple)
        layout = None if padding == (1, None, 1) else Layout(cp_size=cp_size, cp_layout=cp_layout or "zigzag",
                                                             multiple=multiple)
        planned = _outcome(plan_epochs, lengths=[3, 9, 5], epochs=epochs, mode=mode, max_len=max_len,
                           max_tokens=max_tokens,
                           batch_size=DEFAULT_BATCH_SIZE if mode == "batch" and batch_size is None else batch_size,
                           layout=layout)
        assert (config is None) == (planned is None), (mode, max_len, max_tokens, batch_size, epochs, padding)
        if config is not None:  # the one that applies is filled in, the other stays unset
            assert (config.batch_size is None) == (mode != "batch") and (config.max_tokens is None) == (mode == "batch")
            budget = config.max_tokens if layout is None or mode == "batch" else layout.budget(config.max_tokens)
            assert planned.stats["row_budget"] == (budget or planned.stats["max_row_tokens"])


def test_normalising_is_its_own_step_and_a_replace_keeps_it():
    config = BuildConfig(source="flan", out="-", train_on_prompt=True, pack="bfd", max_len=64)
    assert (config.train_on, config.train_on_prompt, config.max_tokens, config.batch_size) == ("all", True, 64, None)
    assert config.replace(seed=3).identity() == {**config.identity(), "seed": 3}


def test_a_replace_derives_max_tokens_as_a_new_config_would():
    """for_pairs widens a derived max_tokens to hold a pair and refuses a given one too small: a replace
    must say which it is as a fresh config would, or two configs that compare equal plan differently."""
    fresh = BuildConfig(source="flan", out="-", pack="bfd", max_len=1024, max_tokens=1500)
    replaced = BuildConfig(source="flan", out="-", pack="bfd", max_len=1024).replace(max_tokens=1500)
    assert replaced == fresh
    for config in (fresh, replaced):
        with pytest.raises(ConfigError, match="--max-tokens 1,500 cannot hold a preference pair"):
            config.for_pairs()
    # a new max_len on a derived max_tokens derives it again (it was max_len's), a given one stays
    narrowed = BuildConfig(source="flan", out="-", pack="bfd", max_len=4096).replace(max_len=1024)
    assert narrowed.max_tokens == 1024 and narrowed.for_pairs().max_tokens == 2048
    assert fresh.replace(max_len=512).max_tokens == 1500
    # for_pairs' own widening is derived, not given: a pair build's recorded config replays as built
    widened = BuildConfig(source="flan", out="-", pack="bfd", max_len=1024).for_pairs()
    assert widened.max_tokens == 2048 and not widened.max_tokens_given


def test_a_pair_plan_is_made_for_any_budget_its_pairs_fit():
    """The "cannot hold a longest pair" rule refuses a build before it starts; re-planning (verify --source)
    a build whose rows hold its actual pairs must not refuse it."""
    from packer.planning.pairs import plan_pairs

    # what 30ee65e built: zigzag CP 2 pads each sequence to a multiple of 4, rows of 76; a longest pair
    # (38 + 38, padded 80) would not fit them, these pairs (padded 64 and 56) do
    layout = BuildConfig(source="flan", out="-", pack="bfd", max_len=38, max_tokens=78, cp_size=2).layout()
    with pytest.raises(ConfigError, match="cannot hold a preference pair"):
        BuildConfig(source="flan", out="-", pack="bfd", max_len=38, max_tokens=78, cp_size=2).for_pairs()
    plan = plan_pairs([30, 30, 20, 30], prompts=[5, 5, 5, 5], mode="bfd", max_len=38, max_tokens=78, layout=layout)
    assert sorted(np.diff(plan.row_splits).tolist()) == [2, 2]  # two rows of one pair each
