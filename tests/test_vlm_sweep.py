"""The vision-language sweep as a test: an image-text-to-text type is refused (and left unchanged), exact on
packed rows with images (logits and every parameter's gradient against each example alone through an
untouched eager copy) and guarded, or not buildable here; never accepted and wrong.

The whole sweep (every image-text-to-text type of the installed transformers, ~3 min on two cores) is
``python benchmarks/sweep_architectures.py --vlm``; here two families plus a fixed, seeded sample of the
other types."""

from __future__ import annotations

import random

import pytest

from benchmarks.sweep_architectures import image_text_to_text_types, judge_vlm

# Qwen2.5-VL, LLaVA and Gemma 3 are judged in tests/test_vlm.py (rows by hand, the guard's refusals)
EXPECTED = {
    "qwen3_5": "exact",  # 3-D positions per example, GatedDeltaNet layers once per example
    "idefics3": "exact",  # a per-text batch axis of tiles
}
SAMPLE = sorted(random.Random(38).sample(sorted(set(image_text_to_text_types()) - set(EXPECTED)), 2))


@pytest.mark.parametrize("model_type", [*EXPECTED, *SAMPLE])
def test_refused_or_exact(model_type):
    verdict = judge_vlm(model_type)
    assert verdict.outcome != "LEAK", verdict.detail
    if model_type in EXPECTED:
        assert verdict.outcome == EXPECTED[model_type], verdict.detail
