"""The image side of the contract: what an image build's columns mean, how stored image bytes become
the picture the processor sees, and the processor itself; the one place the build, the checks and the
loader take these rules from (docs/images.md).

An image build's rows have three more columns (:data:`IMAGE_FIELDS`), each a list per row, in token
order: ``images`` (each image's encoded bytes, as the source held them), ``image_tokens`` (how many of the
family's image token each image holds in ``input_ids``) and ``image_sizes`` (each image's height and width
after its EXIF orientation, two int32 an image). A segment's images are those whose image tokens its tokens
hold, in order, so no per-segment count is stored.

Decoding is transformers' ``load_image`` (EXIF orientation applied, converted to RGB), so the loader's
pictures are the processor's when it is handed the same file. The processor is loaded as ``AutoProcessor``
loads it; where a part of it needs torchvision, which is absent here (the Qwen-VL families' video
processors), it is assembled from the folder's image processor, tokenizer and chat template by the
family's own processor class, without a video processor (:func:`load_processor`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import ConfigError

IMAGES, IMAGE_TOKENS, IMAGE_SIZES = "images", "image_tokens", "image_sizes"
IMAGE_FIELDS = (
    # large_binary: 64-bit byte offsets, so a record batch's images may pass 2 GB (a batch holds up to 2**20 tokens)
    pa.field(IMAGES, pa.list_(pa.large_binary()), nullable=False),
    pa.field(IMAGE_TOKENS, pa.list_(pa.int32()), nullable=False),
    pa.field(IMAGE_SIZES, pa.list_(pa.int32()), nullable=False),
)
# The most pixels an image may have (height x width, before any resize): PIL's own bomb threshold is
# twice its MAX_IMAGE_PIXELS (about 179 M); a 20,000 x 20,000 PNG (400 M pixels, 1.2 GB decoded) is
# refused from its header, before a byte of it is decoded.
MAX_PIXELS = 1 << 27  # 134 M pixels: 12,000 x 11,000; 400 MB as RGB
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
PROCESSOR_KEY = "processor"  # the manifest's tokenizer record holds the processor's (processor_info) in an image build


# -- families ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """What packer knows of a processor's model family.

    ``rule``: how an image's placeholder becomes its tokens. ``"count"``: the one placeholder token the chat
    template writes is repeated the count the processor's own ``_get_num_multimodal_tokens`` gives for the
    image's size (no pixel computed: what ``processor(text, images)`` expands it to, for these families).
    ``"replace"``: the processor's own replacement text for the image (``_process_images`` then
    ``get_text_with_replacements``, the code ``processor.__call__`` runs) replaces the placeholder in the
    rendered text before it is tokenized (families whose replacement holds more than the image token).
    ``rope_model``: the transformers class whose own ``get_rope_index`` gives an example's positions (None:
    1-D positions). ``text_row``: the forward takes a text-position row first (``[4, 1, T]``).
    ``type_ids``: the name under which the processor returns its 0/1 image-token mask (None: it returns none).
    ``batched``: the image processor's outputs have a per-example batch axis first ([1, images, ...]); a row's
    examples are then one batch of one, their images concatenated along axis 1."""

    name: str
    rule: str
    rope_model: str | None = None
    text_row: bool = False
    type_ids: str | None = None
    batched: bool = False


FAMILIES = {
    "Qwen2_5_VLProcessor": Family("Qwen2.5-VL", "count", "Qwen2_5_VLModel", True, "mm_token_type_ids"),
    "Qwen2VLProcessor": Family("Qwen2-VL", "count", "Qwen2VLModel", True, "mm_token_type_ids"),
    # Qwen3.5's processor is Qwen3-VL's; Qwen3_5Model.get_rope_index is Qwen3VLModel's (tests check both)
    "Qwen3VLProcessor": Family("Qwen3-VL / Qwen3.5", "count", "Qwen3VLModel", True, "mm_token_type_ids"),
    "Gemma3Processor": Family("Gemma 3", "replace", type_ids="token_type_ids"),
    "Idefics3Processor": Family("Idefics3", "replace", batched=True),
    "SmolVLMProcessor": Family("SmolVLM", "replace", batched=True),
    "LlavaProcessor": Family("LLaVA", "count"),
}


def family_of(processor) -> Family:
    """The family of a processor (or of a processor class, or its name); a ConfigError naming it when packer has
    none."""
    if not isinstance(processor, str):
        processor = (processor if isinstance(processor, type) else type(processor)).__name__
    name = processor.removesuffix(_NO_VIDEO)
    family = FAMILIES.get(name)
    if family is None:
        known = ", ".join(sorted({f.name for f in FAMILIES.values()}))
        raise ConfigError(f"--processor: {name} is not a family packer packs images for (known: {known}); build "
                          "its data with one of these, or as text")
    return family


def image_token_id(processor) -> int:
    """The id of the model's image token: what each image's span in ``input_ids`` is made of (Gemma 3's
    soft token, not the ``<start_of_image>`` its template writes)."""
    return int(processor.image_token_ids[0])


def images_kwargs(processor) -> dict[str, Any]:
    """The image processor's arguments as ``processor.__call__`` merges them (the processor's defaults)."""
    tokenizer = getattr(processor, "tokenizer", None)
    return processor._merge_kwargs(tokenizer_init_kwargs=tokenizer.init_kwargs if tokenizer is not None else {}
                                   )["images_kwargs"]


# -- decoding ----------------------------------------------------------------------------------------


def open_image(data: bytes):
    """The PIL image of encoded ``data``, its header read (nothing decoded yet); raises PIL's errors."""
    from PIL import Image

    return Image.open(io.BytesIO(data))


def oriented_size(image) -> tuple[int, int]:
    """(height, width) after the image's EXIF orientation (what ``load_image`` hands the processor)."""
    width, height = image.size
    orientation = image.getexif().get(0x0112, 1)  # 5-8: turned a quarter, width and height swap
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def decode(data: bytes):
    """The RGB picture the processor sees for stored bytes: transformers' ``load_image`` of the opened image
    (EXIF orientation applied, then converted to RGB, the first frame of an animation)."""
    from transformers.image_utils import load_image

    return load_image(open_image(data))


# -- the processor -----------------------------------------------------------------------------------

_NO_VIDEO = "WithoutVideo"


def _without_video(cls):
    """``cls`` (a processor class) accepting ``video_processor=None``: the family's own class and code,
    only its argument check skips the video processor, whose torchvision is absent."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and argument_name == "video_processor":
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(cls.__name__ + _NO_VIDEO, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                                    "__module__": cls.__module__})


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")  # a processor's files: no weights


def processor_folder(name: str, *, download: bool = False) -> Path:
    """The folder of processor ``name``: a local folder, or a Hub id's files in the local Hub cache
    (``download``: fetched first; the build asks, once it knows the Hub answers); a ConfigError otherwise."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    if name.startswith((".", "~", "/")) or not HUB_ID.match(name):
        raise ConfigError(f"--processor {name}: no such folder; give a processor folder (save_pretrained's) or a Hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=list(HUB_FILES), local_files_only=not download))
    except Exception as e:  # huggingface_hub's errors for a missing repo, no network, a cache miss
        where = "the Hugging Face Hub cannot give it" if download else "not in the Hub cache while offline"
        raise ConfigError(f"--processor {name}: not a local folder, and {where} ({type(e).__name__}); download it "
                          "where there is network and pass the folder") from None


def load_processor(name: str):
    """The processor ``name`` (a folder, or a Hub id in the local cache) as ``AutoProcessor`` loads it, or
    assembled without its video processor where that needs torchvision; a ConfigError in one line otherwise.
    Loaded once a process, and again once a folder's files change (a process building twice, the folder edited
    between: the second build's record is the folder's as it is then)."""
    folder = Path(name).expanduser()
    return _load_processor(name, _files_state(folder) if folder.is_dir() else None)


def _files_state(folder: Path) -> tuple:
    """What changes when a file of ``folder`` is added, removed, written to or replaced."""
    try:
        return tuple((str(p), st.st_size, st.st_mtime_ns, st.st_ino) for p in sorted(folder.rglob("*"))
                     if p.is_file() and (st := p.stat()))
    except OSError:
        return ()


@cache
def _load_processor(name: str, state: tuple | None):
    import transformers

    folder = processor_folder(name)
    if not any((folder / f).is_file() for f in PROCESSOR_FILES):
        raise ConfigError(f"--processor {name}: holds neither {' nor '.join(PROCESSOR_FILES)}, so it is not a "
                          "processor's folder; save the model's processor there (`AutoProcessor...save_pretrained`)")
    named = _processor_class(folder)
    if named is not None:  # an unknown family is refused before its tokenizer is loaded
        family_of(named)
    if named is not None and "video_processor" in named.get_attributes() and importlib.util.find_spec("torchvision") is None:
        return _checked(_assemble(folder, name), name)  # AutoProcessor would load the tokenizer, then fail on the video
    try:
        processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise ConfigError(f"--processor {name}: cannot be loaded ({str(e).strip().splitlines()[0][:200]})") from e
        processor = _assemble(folder, name)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--processor {name}: cannot be loaded ({str(e).strip().splitlines()[0][:200]})") from e
    return _checked(processor, name)


def _checked(processor, name: str):
    if not hasattr(processor, "image_processor"):
        raise ConfigError(f"--processor {name}: {type(processor).__name__} has no image processor, so it cannot "
                          "read images; give a vision-language model's processor")
    if not processor.chat_template:
        raise ConfigError(f"--processor {name}: has no chat template (chat_template.jinja); add the model's")
    return processor


def _processor_class(folder: Path):
    """The processor class the folder's configs name (as AutoProcessor reads them), or None."""
    import transformers

    cls_name = next((c for c in (_read_json(folder / f).get("processor_class") for f in
                                 (*PROCESSOR_FILES, "tokenizer_config.json")) if c), None)
    cls = getattr(transformers, cls_name, None) if cls_name else None
    return cls if isinstance(cls, type) and hasattr(cls, "get_attributes") else None


def _assemble(folder: Path, name: str):
    """The folder's processor made by its own class from its image processor, tokenizer and chat template
    (each loaded by transformers' Auto classes), without the video processor that needs torchvision."""
    import transformers

    cls = _processor_class(folder)
    if cls is None:
        cls_name = _read_json(folder / "processor_config.json").get("processor_class")
        raise ConfigError(f"--processor {name}: names no processor class transformers has ({cls_name!r}); "
                          "set processor_class in its processor_config.json")
    cls_name = cls.__name__
    if "video_processor" not in cls.get_attributes():
        raise ConfigError(f"--processor {name}: {cls_name} needs torchvision, which packer does not use; "
                          "install a CPU torchvision that matches torch, or use another family")
    image_processor = transformers.AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    template = folder / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else _read_json(folder / "chat_template.json").get(
        "chat_template", getattr(tokenizer, "chat_template", None))
    return _without_video(cls)(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                               chat_template=chat_template)


def processor_info(processor, name: str) -> dict[str, Any]:
    """What the manifest records of the processor: its class and a fingerprint of what decides its image tokens: its
    own configuration (``to_dict``: Gemma 3's ``image_seq_length``, LLaVA's ``patch_size`` and feature strategy
    beside its image processor's), its chat template, and the configuration files its folder holds (the tokens its
    tokenizer names for an image's start and end are in them). The build's identity holds it, so a processor
    changed in any of them is another build (the tokenizer has its own record)."""
    own = json.dumps(processor.to_dict(), sort_keys=True, default=str)
    template = processor.chat_template if isinstance(processor.chat_template, str) else json.dumps(
        processor.chat_template, sort_keys=True)
    folder = processor_folder(name)
    files = json.dumps([[f, hashlib.sha256((folder / f).read_bytes()).hexdigest()] for f in CONFIG_FILES
                        if (folder / f).is_file()])
    return {
        "name_or_path": name,
        "class": type(processor).__name__.removesuffix(_NO_VIDEO),
        "image_processor": type(processor.image_processor).__name__,
        "fingerprint": hashlib.sha256("\0".join((own, template or "", files)).encode()).hexdigest(),
    }


# the configuration files a processor's folder may hold (the tokenizer's vocabulary is in its own fingerprint)
CONFIG_FILES = (*PROCESSOR_FILES, "video_preprocessor_config.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "chat_template.jinja", "chat_template.json")
