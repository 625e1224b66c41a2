"""Where an image build differs from a text build, in the pipeline's terms: the encoder of its records and
what the manifest records of its processor, both from the processor's facts (the pipeline calls these;
docs/images.md)."""

from __future__ import annotations

from pathlib import Path

from ..contract.config import BuildConfig
from ..contract.vision import PROCESSOR_FILES, PROCESSOR_KEY, processor_folder
from ..errors import ConfigError, PackerError
from . import hub, processor_facts, sources
from .image_encoder import ImageEncoder

DEFAULT_IMAGES_FIELDS = ("images", "image")


def encoder(config: BuildConfig, tokenizer, spec, stream, *, skip_errors: bool,
            memo: processor_facts.Kept | None = None) -> ImageEncoder:
    """The encoder of one source's image+text records (TRL's vision format: messages and images), made from the
    processor's facts (kept in ``memo`` for a processor folder met before: the processor is then loaded only if
    the build tokenizes)."""
    if spec.kind != "chat":
        raise ConfigError(f"--processor: image+text records are chat records (messages with image parts); this "
                          f"data is {spec.kind} data: give --messages-field")
    columns = stream.columns()
    # TRL's vision format names its images `images`; LLaVA-style data (`image` + `conversations`) `image`
    field = config.images_field or next((f for f in DEFAULT_IMAGES_FIELDS if f in columns), DEFAULT_IMAGES_FIELDS[0])
    if field not in columns:
        raise ConfigError(f"--images-field {field}: the data has no such field; its columns are {', '.join(columns)}")
    if not Path(config.processor).expanduser().is_dir():  # a Hub id: its files fetched into the cache, if the Hub answers
        processor_folder(config.processor, download=hub.reachable())
    base = Path(stream.files[0]).parent if stream.source.kind == "local" and stream.files else None
    facts = processor_facts.facts(config.processor, memo)
    return ImageEncoder(tokenizer, spec, facts=facts, images_field=field, base=base,
                        max_len=config.max_len if config.overlong == "truncate" else None, skip_errors=skip_errors,
                        template_given=config.chat_template is not None)


def default_processor(config: BuildConfig) -> BuildConfig:
    """``--processor`` left out: the ``--tokenizer`` folder, when it holds a processor's config and the
    (first) source's records have an images field; else the config as it is (a text build)."""
    if config.processor is not None or not config.tokenizer:
        return config
    try:
        folder = Path(config.tokenizer).expanduser()
        if not any((folder / f).is_file() for f in PROCESSOR_FILES):
            return config
    except (OSError, RuntimeError):  # no such user's home, a name too long: loading the tokenizer says so
        return config
    part = (config.mix or ({"source": config.source},))[0]
    try:
        stream = sources.open_stream(sources.resolve(part["source"], recipe=part.get("recipe"),
                                                     split=part.get("split"), from_hub=config.from_hub,
                                                     files=part.get("files")), limit=1)
        columns = stream.columns()
    except PackerError:
        return config  # the build reports what is wrong with the source
    fields = (config.images_field,) if config.images_field else DEFAULT_IMAGES_FIELDS
    return config.replace(processor=config.tokenizer) if any(f in columns for f in fields) else config


def for_columns(config: BuildConfig, columns: list[str]) -> BuildConfig:
    """An image build's config for a source's columns: LLaVA-style data (``conversations`` of ``{"from",
    "value"}`` turns, ``<image>`` in the text) is chat data in its ``conversations`` field."""
    if config.processor is None or config.messages_field or "messages" in columns or "conversations" not in columns:
        return config
    return config.replace(messages_field="conversations")


def tokenizer_record(record: dict, facts: processor_facts.Facts | None) -> dict:
    """The manifest's tokenizer record, with the processor's (its class and fingerprint: ``facts``') in an image
    build."""
    return record if facts is None else {**record, PROCESSOR_KEY: facts.record}
