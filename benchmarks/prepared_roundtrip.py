"""prepare keeps its word, per model type (tiny random configs of ``sweep_architectures``):

- ``generate``: greedy ``generate(use_cache=True)`` after ``prepare`` against the unprepared model's tokens;
- ``reload``: the prepared model saved (``save_pretrained``) and loaded (``from_pretrained``) without
  ``prepare``, one packed row of 9 + 40 + 13 tokens: refused, or how far each example's logits are from
  its logits alone (max |diff| / max |alone|); then after ``prepare``.

    python benchmarks/prepared_roundtrip.py llama qwen3_next mamba falcon_mamba jamba minimax
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import tempfile
import warnings

import torch

from benchmarks.sweep_architectures import tiny_model
from packer import prepare
from packer.training import guard

LENGTHS = (9, 40, 13)


def _relative(model, exs, alone) -> float:
    out = model(**guard._row(exs), use_cache=False).logits[0].split(LENGTHS)
    return max(((o - a).abs().max() / a.abs().max()).item() for o, a in zip(out, alone, strict=True))


def generate(model_type: str) -> str:
    model = tiny_model(model_type)
    reference = copy.deepcopy(model)
    prepare(model, max_tokens=128)
    prompt = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(0))
    try:
        want = reference.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    except Exception as e:  # the tiny config's own cache fails in transformers (jamba, granitemoehybrid)
        return f"unprepared model fails itself ({type(e).__name__})"
    try:
        got = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    except Exception as e:
        return f"raises {type(e).__name__}: {str(e)[:90]}"
    return "same tokens" if torch.equal(got, want) else "DIFFERENT tokens"


def reload(model_type: str) -> str:
    from transformers import AutoModelForCausalLM

    model = prepare(tiny_model(model_type), max_tokens=128)
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    gen = torch.Generator().manual_seed(0)
    exs = [torch.randint(3, 200, (n,), generator=gen) for n in LENGTHS]
    with torch.no_grad():
        alone = [loaded(input_ids=e.view(1, -1), use_cache=False).logits[0] for e in exs]
        try:
            before = f"trains across examples: {_relative(loaded, exs, alone):.3g} relative"
        except Exception as e:
            before = f"refused ({type(e).__name__}: {str(e)[:70]}…)"
        prepare(loaded, max_tokens=128)
        return f"{before}; after prepare {_relative(loaded, exs, alone):.2g}"


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    for model_type in sys.argv[1:] or ["llama", "qwen3_next", "mamba", "falcon_mamba", "jamba", "minimax"]:
        with contextlib.redirect_stderr(io.StringIO()):
            g, r = generate(model_type), reload(model_type)
        print(f"{model_type:<14} generate: {g}\n{'':<14} reload:   {r}")
