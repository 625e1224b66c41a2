"""``prepare``'s probe with images: packed rows with pictures against each example alone, eager.

Three examples, each made by the model's own processor alone (``processor(text=..., images=...)``,
placeholders expanded to its count for each image): one image below the processor's nominal size (Qwen:
under ``min_pixels``, upscaled), two of other sizes and shapes above it (another grid, more tiles), and a
text-only one. Each example's positions are the ones the model computes for it alone (captured at its
text model's input: the Qwen mRoPE families' 3-D positions from their own ``get_rope_index``; 1-D
``arange`` where the model computes none), concatenated along the row; its vision inputs concatenated
along the image axis (``row``).

The reference is an untouched float32 copy with every sub-model on eager attention, run on each example
alone; the probe copy runs the packed row with the text model on ``implementation`` and the vision tower as
the prepared model will have it. Compared: each example's logits, and the gradient of every parameter
(vision tower and projector included) of the examples' outputs weighted at random, summed; within
``guard.PROBE_TOLERANCE`` of the largest value. Cost: the model twice more in float32, one forward and
backward of each example alone and one of the row (docs/training.md).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch

from ..errors import ConfigError
from . import vision_guard

__all__ = ["examples", "row", "compare"]

# Sizes relative to the processor's nominal one (height, width): one below it, two above in other shapes
SCALES = ((0.6, 0.4), (1.5, 0.9), (1.2, 2.3))
# The examples: text with an image's placeholder where {image} is, and which of the three images
SPECS = (("look {image} here", [0]), ("a {image} then {image} and", [1, 2]), ("only some text", []))
SEQUENCE_KEYS = ("input_ids", "token_type_ids", "mm_token_type_ids", "image_token_type_ids")


def nominal_size(image_processor: Any) -> int:
    """The side the processor resizes to or tiles by (its ``size``, ``max_image_size``, ``min_pixels``)."""
    for name in ("max_image_size", "size", "crop_size"):
        size = getattr(image_processor, name, None)
        if isinstance(size, dict):
            for key in ("longest_edge", "height", "shortest_edge"):
                if isinstance(size.get(key), int):
                    return size[key]
    pixels = getattr(image_processor, "min_pixels", None)
    if isinstance(pixels, int):
        return int(pixels**0.5)
    return 64


def _image(height: int, width: int, seed: int):
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def examples(processor: Any) -> list[dict]:
    """The probe's examples, each its processor's output alone (no attention_mask: one sequence, no padding)."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        raise ConfigError(f"{type(processor).__name__} has no image_token, so the probe cannot place images")
    s = nominal_size(processor.image_processor)
    images = [_image(max(8, int(s * h)), max(8, int(s * w)), i) for i, (h, w) in enumerate(SCALES)]
    out = []
    for text, which in SPECS:
        text, imgs = text.format(image=token), [images[i] for i in which]
        kwargs = dict(text=[text], return_tensors="pt")
        if imgs:
            kwargs["images"] = [imgs]
        try:
            got = dict(processor(**kwargs))
        except ValueError:
            if imgs:
                raise
            continue  # a family whose every example has an image (PaliGemma's processor takes no text alone)
        got.pop("attention_mask", None)
        out.append({k: v for k, v in got.items() if isinstance(v, torch.Tensor)})
    return out


def _text_model(model: Any) -> Any:
    text = model.config.get_text_config()
    return next(m for m in model.modules() if m is not model and hasattr(m, "set_attn_implementation")
                and m.config is text)  # fmt: skip


def _positions(model: Any, ex: dict) -> torch.Tensor | None:
    """The position_ids the model hands its text model for ``ex`` alone (None: it computes none)."""
    seen = []
    handle = _text_model(model).register_forward_pre_hook(
        lambda m, a, k: seen.append(k.get("position_ids")), with_kwargs=True)  # fmt: skip
    try:
        with torch.no_grad():
            model(**ex, use_cache=False)
    finally:
        handle.remove()
    return seen[0] if seen else None


def row(model: Any, exs: list[dict], images: list[int]) -> dict:
    """The packed row of ``exs`` as the loader yields it: tokens and each example's own positions
    concatenated, ``cu_seq_lens``, and the vision inputs along the image axis (``images``: how many
    images each example has; one of them two, which tells each key's image axis)."""
    lens = [e["input_ids"].shape[1] for e in exs]
    pos = [_positions(model, e) for e in exs]
    shape = next((p.shape[:-2] for p in pos if p is not None and p.dim() == 3), ())
    device = exs[0]["input_ids"].device
    pos = [(p if p is not None else torch.arange(n, device=device).view(1, n)).expand(*shape, 1, n)
           for p, n in zip(pos, lens, strict=True)]  # fmt: skip
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    out = dict(position_ids=torch.cat(pos, dim=-1), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
               max_length_q=max(lens), max_length_k=max(lens))  # fmt: skip
    # a key's image axis: dim 0 (LLaVA's images, Qwen's patches and grids), but dim 1 where the two-image
    # example's value has a per-text batch axis of 1 in front (Idefics3's [1, images, C, H, W])
    two = next((e for e, n in zip(exs, images, strict=True) if n == 2), exs[0])
    for key in dict.fromkeys(k for e in exs for k in e):
        parts = [e[key] for e in exs if key in e]
        if key in SEQUENCE_KEYS:
            out[key] = torch.cat(parts, dim=1)
            continue
        axis = 1 if key in two and two[key].dim() >= 2 and two[key].shape[0] == 1 else 0
        out[key] = _cat_padded(parts, axis)
    return out


def _cat_padded(parts: list[torch.Tensor], axis: int) -> torch.Tensor:
    """``parts`` joined along ``axis``, each zero-padded past its end in the other dims to the largest (LLaVA's
    tiles per image: the model reads each image's own count from ``image_sizes``)."""
    if parts[0].dim() == 0:
        return torch.stack(parts)
    shape = [max(p.shape[d] for p in parts) for d in range(parts[0].dim())]
    padded = []
    for p in parts:
        pad = []
        for d in reversed(range(p.dim())):
            pad += [0, 0 if d == axis else shape[d] - p.shape[d]]
        padded.append(torch.nn.functional.pad(p, pad) if any(pad) else p)
    return torch.cat(padded, dim=axis)


def _run(model: Any, batch: dict, seeds: list[int], bounds: list[int]) -> tuple[torch.Tensor, dict]:
    """Logits, and every parameter's gradient of sum over segments of sum(logits * weights(seed))."""
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(**batch, use_cache=False).logits[0].float()
        total = 0
        for (a, b), seed in zip(itertools.pairwise(bounds), seeds, strict=True):
            part = logits[a:b]
            weights = torch.randn(part.shape, generator=torch.Generator().manual_seed(seed))
            total = total + (part * weights.to(part.device)).sum()
        total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def compare(probe: Any, implementation: str, processor: Any, tolerance: float, refuse) -> None:
    """Packed row with images on ``probe`` (text model on ``implementation``) against each example alone
    through an eager copy; ``refuse(why)`` makes the error raised."""
    reference = copy.deepcopy(probe)
    reference.set_attn_implementation("eager")
    device = next(probe.parameters()).device  # the processor's tensors to the model's device (a GPU's)
    exs = [{k: v.to(device) for k, v in e.items()} for e in examples(processor)]
    packed = row(reference, exs, [len(which) for _, which in SPECS][: len(exs)])
    lens = [e["input_ids"].shape[1] for e in exs]
    bounds = [0, *itertools.accumulate(lens)]
    reference.requires_grad_(True)
    alone = [_run(reference, e, [i], [0, n]) for i, (e, n) in enumerate(zip(exs, lens, strict=True))]
    probe.requires_grad_(True)
    try:
        logits, grads = _run(probe, packed, list(range(len(exs))), bounds)
    except ConfigError as e:  # packer_varlen's own refusals (a non-causal text attention): named for the model
        raise refuse(f"image probe: its packed row with images was refused: {e}") from e
    finally:
        probe.requires_grad_(False)
    hint = ""
    if implementation not in ("sdpa", "eager") and any("token_type_ids" in e for e in exs):
        hint = ("; its image tokens attend both ways inside each image, through the mask its model builds: "
                "implementation='sdpa' with config.use_cache=False vets that mask")
    for i, (a_logits, _) in enumerate(alone):
        d = (logits[bounds[i] : bounds[i + 1]] - a_logits).abs().max().item()
        scale = a_logits.abs().max().item()
        if d > tolerance * scale:
            what = "text only" if vision_guard.PIXEL_KEYS[0] not in exs[i] else f"{lens[i]} tokens with images"
            raise refuse(f"image probe: example {i} ({what}) gets logits {d:.3g} packed away from the ones it gets "
                         f"alone through eager attention (tolerance {tolerance * scale:.2g}), with "
                         f"attn_implementation={implementation!r}{hint}")
    summed = {n: sum(a[1][n] for a in alone if n in a[1]) for n in {n for a in alone for n in a[1]}}
    if set(summed) != set(grads):
        missing = sorted(set(summed) ^ set(grads))[:3]
        raise refuse(f"image probe: packed and alone train different parameters ({', '.join(missing)})")
    # a parameter whose gradient is small next to the others' is judged at the model's scale: its rounding is
    largest = max((g.abs().max().item() for g in summed.values()), default=0.0)
    for name, ref in summed.items():
        d = (grads[name] - ref).abs().max().item()
        scale = max(ref.abs().max().item(), 1e-3 * largest)
        if d > tolerance * scale:
            raise refuse(f"image probe: the gradient of {name} packed is {d:.3g} away from its sum over the examples "
                         f"alone (tolerance {tolerance * scale:.2g}), with attn_implementation={implementation!r}")
