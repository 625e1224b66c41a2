"""BuildConfig: the mode/budget rule is plan.row_size's, so a config is accepted exactly when its plan
can be made, and normalisation fills what the mode takes."""

from __future__ import annotations

import itertools

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
