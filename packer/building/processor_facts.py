"""What an image build reads of its processor (:class:`Facts`): the manifest's processor record, its family, its
chat template and its image token; read from the processor, or kept in the cache for a folder met before.

A build needs them even when it tokenizes nothing (a re-plan from the token store: the build's identity holds the
record and the image token, and the template is the tokenizer's), and loading the processor to read them imports
transformers and torch: most of a re-plan's time from the shell. So a build that loads a processor folder keeps
its facts (:data:`PROCESSORS`: keyed by the content of every file of the folder and the versions of packer,
transformers, tokenizers, Pillow, torch and torchvision, whose presence decides which image processor class loads;
their sha256 and shape checked on use), and a later build of a folder whose files hash to that key takes them
from there; its encoder loads the processor only when it tokenizes. Facts kept damaged, or of another shape, are
not used: the processor is loaded (and they are kept again). A Hub id's processor is always loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..contract.vision import Family, family_of, image_token_id, load_processor, processor_info
from ..errors import ConfigError
from .kept_tokenizers import PROCESSOR_FACTS, Kept


@dataclass(frozen=True, slots=True)
class Facts:
    name: str  # the processor as the config names it
    record: dict[str, Any]  # the manifest's record of it (processor_info)
    chat_template: Any  # the processor's chat template (a string, or named templates)
    image_token: str  # what the template writes for an image
    image_token_id: int  # what an image's span in the ids is made of
    model_token: str  # that id's token

    @property
    def family(self) -> Family:
        return family_of(self.record["class"])


def of(processor, name: str) -> Facts:
    """The facts of a loaded ``processor`` (an unknown family refused: a ConfigError)."""
    family_of(processor)
    token_id = image_token_id(processor)
    return Facts(name, processor_info(processor, name), processor.chat_template, processor.image_token, token_id,
                 processor.tokenizer.convert_ids_to_tokens(token_id))


def facts(name: str, memo: Kept | None = None) -> Facts:
    """The facts of processor ``name``: kept in ``memo`` for its folder as it is now, else read from the processor
    loaded (and kept there)."""
    folder = Path(name).expanduser()
    local = memo is not None and folder.is_dir()
    if local:
        kept = _from_kept(memo.get(folder), name)
        if kept is not None:
            return kept
    before = memo.key(folder) if local else None  # the folder as the load begins: kept only if it is so after it
    out = of(load_processor(name), name)
    if local:
        value = asdict(out)
        del value["name"]
        value["record"] = {k: v for k, v in out.record.items() if k != "name_or_path"}  # the folder's, not its path's
        memo.keep(folder, value, before)
    return out


_TYPES = {"record": dict, "image_token": str, "image_token_id": int, "model_token": str}


def _from_kept(value: Any, name: str) -> Facts | None:
    """Facts kept for processor ``name``'s folder (None: none, or not of their shape)."""
    if not isinstance(value, dict) or set(value) != {*_TYPES, "chat_template"} or not all(
            isinstance(value[k], t) for k, t in _TYPES.items()):
        return None
    record = {"name_or_path": name, **value["record"]}
    if not all(isinstance(record.get(k), str) for k in ("class", "image_processor", "fingerprint")):
        return None
    facts = Facts(name, record, value["chat_template"], value["image_token"], value["image_token_id"],
                  value["model_token"])
    try:
        facts.family  # noqa: B018 - a family packer no longer knows: loaded, and refused as it is
    except ConfigError:
        return None
    return facts


# where the pipeline keeps them (a value not of their shape, though its sha256 holds, is made again)
PROCESSORS = Kept(PROCESSOR_FACTS, ("transformers", "tokenizers", "pillow", "pillow-simd", "torch", "torchvision"),
                  lambda value: _from_kept(value, "") is not None)
