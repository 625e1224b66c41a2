"""The mark ``prepare`` leaves in a model's config, and the watch kept on a model loaded with it unprepared.

A checkpoint saved from a prepared model (``save_pretrained``) is a plain transformers checkpoint, and
``from_pretrained`` runs nothing of packer's: loaded again without ``prepare``, its attention sees the rows'
boundaries only where transformers finds them in ``position_ids``, and its mixers none (Mamba1-type hybrids
and MiniMax then train across the examples of a row, silently: logits 0.04-0.27 relative off). So
``prepare`` writes ``packer_prepared`` into the config (``mark``), which ``save_pretrained`` keeps in
config.json, and every model carrying it gets a forward pre-hook (``watch``) that refuses a packed row
(``cu_seq_lens_*`` kwargs, or ``position_ids`` restarting inside the row) in one line until ``prepare``
has put its guard on the model; unpacked forwards (generation, evaluation on padded batches) pass.

Which models get the watch: once this module is imported (with ``packer.training``: ``from packer import
prepare`` or ``make_dataloader``), every model built afterwards, through torch's module-registration hook
(``from_pretrained`` assigns the model's layers after its config: the hook sees the mark then; cost, a dict
lookup per submodule assigned, nothing per forward of an unmarked model); a model built before the import
is found once, at the import, among the live objects (only where transformers is already imported).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch

from ..errors import ConfigError

MARK = "packer_prepared"  # the config attribute (and config.json key) prepare writes

__all__ = ["MARK", "mark", "marked", "watch", "guarded", "unwatch"]


def mark(model: Any, implementation: str, max_tokens: int | None, path: str) -> None:
    """Record in the model's config that ``prepare`` vetted it (a plain dict: config.json keeps it)."""
    setattr(model.config, MARK, {"implementation": implementation, "max_tokens": max_tokens, "path": path})


def marked(module: Any) -> bool:
    config = module.__dict__.get("config") if isinstance(module, torch.nn.Module) else None
    return isinstance(getattr(config, MARK, None), dict)


def guarded(module: torch.nn.Module) -> bool:
    """Whether ``prepare``'s guard is on this module (its forward pre-hook)."""
    return any(getattr(h, "packer_guard", False) for h in module._forward_pre_hooks.values())


def _packed(kwargs: dict) -> bool:
    """cu_seq_lens, or positions restarting inside a row with no padding (a left-padded batch's restart at its
    first real token comes with an attention_mask holding zeros). Host syncs, paid only on a marked model
    without its guard."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return True
    pos, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if pos is None or pos.dim() != 2 or pos.shape[-1] < 2 or not bool((pos[:, 1:] == 0).any()):
        return False
    return mask is None or (mask.dim() == 2 and bool(mask.all()))


def _refuse_unprepared(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if guarded(module) or not _packed(kwargs):
        return None
    raise ConfigError(
        f"{type(module).__name__}: a packed row, but this model was saved after packer.prepare() and loaded without "
        "it (config.packer_prepared): nothing vouches that its examples stay apart (a Mamba or lightning-attention "
        "mixer runs across them unprepared); call packer.prepare(model, max_tokens=...) after loading it"
    )


_refuse_unprepared.packer_watch = True


def watch(module: Any) -> bool:
    """Put the watch on a marked model-like module (idempotent); whether it has one now."""
    if not marked(module) or not hasattr(module, "set_attn_implementation"):
        return False
    if not any(getattr(h, "packer_watch", False) for h in module._forward_pre_hooks.values()):
        module.register_forward_pre_hook(_refuse_unprepared, with_kwargs=True)
    return True


def unwatch(module: torch.nn.Module) -> None:
    """Take the mark and the watch off a model and its sub-models (prepare's probe copy runs packed rows bare)."""
    for m in module.modules():
        for key in [k for k, h in m._forward_pre_hooks.items() if getattr(h, "packer_watch", False)]:
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, MARK):
        delattr(config, MARK)


def _on_registration(module: torch.nn.Module, name: str, submodule: Any) -> None:
    if "config" in module.__dict__:  # a model (transformers sets config before its layers): others cost a lookup
        watch(module)


def _watch_live_models() -> None:
    """The models built before this module was imported (none can be a transformers one without transformers)."""
    if "transformers" not in sys.modules:
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.nn.Module) and "config" in obj.__dict__:  # type(): no lazy __class__
            watch(obj)


torch.nn.modules.module.register_module_module_registration_hook(_on_registration)
_watch_live_models()
