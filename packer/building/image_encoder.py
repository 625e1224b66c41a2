"""Image+text chat records (TRL's vision format) tokenized as the processor tokenizes them.

A record is ``messages`` whose content is a string or a list of parts (``{"type": "image"}``,
``{"type": "text", "text": ...}``) and an images field holding its images in the order of its image
parts. Its text is the processor's chat template rendered by packer's chat renderer (the trained spans:
each assistant turn's text, as for text chat), tokenized as text chat is; then each image's one placeholder
token is expanded to the count the processor's own rule gives for that image's size
(``processor._get_num_multimodal_tokens``: what ``processor(text, images)`` expands it to, with no pixel
computed), never trained. The result equals ``processor.apply_chat_template(messages, images=...,
tokenize=True)`` token for token, an appended EOS aside (tests/test_images.py checks it per family).

Packing rules that need the image spans are applied here, per example, where the spans are known: an
example longer than ``--max-len`` whose cut would fall inside or before one of its images is dropped
(counted as ``image_over_max_len``), so that ``truncate`` cuts only text after the last image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..contract.vision import decode, image_token_id, images_kwargs, load_processor, processor_info
from ..errors import ConfigError, RecordError
from .chat import checked_turns, normalize_tools, require_answer
from .formatting import Formatter, Segments
from .images import Image, read_image
from .tokenization import Encoded, Encoder, Skipped

CUT_IMAGE = "image_over_max_len"  # the reason an example whose --max-len cut would fall in an image is dropped


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") == "image" or "image" in part or "image_url" in part)


def vision_messages(messages: Any, name: str, join_answers: bool = True) -> tuple[list[dict], int]:
    """A record's messages as the processor's template takes them (image parts kept, Nones dropped) and
    the number of image parts; an assistant's text parts are joined into its content where ``join_answers``
    (an untagged template: packer finds the answers by their text, chat.md), else kept as parts (a
    ``{% generation %}``-tagged template marks them itself, and some templates read parts only)."""
    if isinstance(messages, list):  # LLaVA's {"from", "value"} turns read as messages
        messages = [llava_turn(m, i) if isinstance(m, dict) and "from" in m and "value" in m else m
                    for i, m in enumerate(messages)]
    out, images = [], 0
    for i, message in enumerate(checked_turns(messages, name)):
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if _is_image_part(part):
                    images += 1
                elif not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RecordError(f"turn {i}'s content parts must be {{'type': 'image'}} or {{'type': 'text', "
                                      "'text': str}}", "wrong_type")
            if message["role"] == "assistant":
                if any(_is_image_part(p) for p in content):
                    raise RecordError(f"turn {i} (assistant) holds an image: only user and system turns may",
                                      "image_in_answer")
                if join_answers:
                    message["content"] = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise RecordError(f"turn {i}'s content is {type(content).__name__}, not text or a list of parts",
                              "wrong_type")
        out.append(message)
    require_answer(out)
    return out, images


LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
LLAVA_IMAGE = "<image>"


def llava_turn(turn: dict, i: int) -> dict:
    """A LLaVA-style turn (``{"from": "human" | "gpt", "value": "<image>\nWhat is ...?"}``) as a TRL vision
    message: each ``<image>`` in the text is an image part where it stands."""
    role = LLAVA_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
    if role is None or not isinstance(turn["value"], str):
        raise RecordError(f"turn {i} is not a {{'from': human | gpt | system, 'value': str}} turn", "wrong_type")
    parts: list[dict] = []
    for k, text in enumerate(turn["value"].split(LLAVA_IMAGE)):
        if k:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return {"role": role, "content": parts}


def image_values(values: Any) -> list:
    """A record's images field as the list of its images, in order."""
    if values is None:
        return []
    return list(values) if isinstance(values, (list, tuple)) else [values]  # one given bare: LLaVA's `image`


class ImageFormatter(Formatter):
    """A chat Formatter whose records keep their image parts and carry images; the images of the last
    record formatted are in ``last_images``."""

    def __init__(self, spec, tokenizer, images_field: str, base: Path | None, image_token: str, replace=None):
        super().__init__(spec, tokenizer)
        self.images_field, self.base, self.image_token = images_field, base, image_token
        self.replace = replace  # the "replace" rule: (text, spans, images) -> (text, spans, image tokens each)
        self.last_images: list[Image] = []
        self.last_counts: list[int] | None = None

    def _chat(self, record: dict[str, Any]) -> Segments:
        spec = self.spec
        tagged = getattr(self.template, "tagged", False)
        messages, parts = vision_messages(record.get(spec.messages_field), spec.messages_field, join_answers=not tagged)
        values = image_values(record.get(self.images_field))
        if len(values) != parts:
            raise RecordError(f"has {len(values)} image(s) in {self.images_field!r} and {parts} image part(s) in its "
                              "messages; give one image per {'type': 'image'} part, in order", "image_count")
        images = [read_image(v, self.base, f"image {k + 1} of {len(values)}") for k, v in enumerate(values)]
        tools = normalize_tools(record.get(spec.tools_field), spec.tools_field) if spec.tools_field else None
        rendered = self.template(messages, tools, spec.train_on)
        placed = rendered.text.count(self.image_token)
        if placed != len(images):
            raise RecordError(f"the chat template writes {placed} image placeholder(s) for its {len(images)} image(s) "
                              "(an image part in a turn the template leaves out?)", "image_count")
        text, spans = rendered.text, rendered.spans
        self.last_counts = None
        if self.replace is not None and images:
            text, spans, self.last_counts = self.replace(text, spans, images)
        segments: Segments = []
        cursor = 0
        for start, end in spans:
            segments += [(text[cursor:start], False), (text[start:end], True)]
            cursor = end
        segments.append((text[cursor:], False))
        self.last_images = images
        return [s for s in segments if s[0]]


@dataclass(slots=True)
class EncodedImages(Encoded):
    """A chunk of image+text examples: the tokens (placeholders expanded), and per example its images and
    where each image's span starts in the example's tokens and how many tokens it holds."""

    images: list[list[Image]] = field(default_factory=list)
    # per image: (its first image token, tokens from it to its last image token, its image tokens)
    spans: list[list[tuple[int, int, int]]] = field(default_factory=list)


def reordered(encoded: Encoded, parts: list[EncodedImages], order: np.ndarray) -> EncodedImages:
    """A mix chunk's examples (``encoded``, put in mix order by ``order`` from the parts' concatenation)
    with their images and spans put in the same order."""
    images = [x for part in parts for x in part.images]
    spans = [x for part in parts for x in part.spans]
    return EncodedImages(encoded.ids, encoded.trained, encoded.lengths, encoded.example_ids, encoded.skipped,
                         [images[k] for k in order.tolist()], [spans[k] for k in order.tolist()])


class ImageEncoder(Encoder):
    """Encoder of image+text chat records (see the module's docstring), made from the processor's facts
    (:mod:`packer.building.processor_facts`). The processor itself is loaded at first use (``ready``: when the
    build tokenizes), so that a build re-planned from the token store imports neither transformers nor torch."""

    def __init__(self, tokenizer, spec, *, facts, images_field: str, base: Path | None, max_len: int | None = None,
                 skip_errors: bool = False, template_given: bool = False):
        self.facts, self.processor_name, self.family = facts, facts.name, facts.family
        if not template_given:  # the processor's template renders the records (--chat-template: its tagged twin)
            tokenizer.chat_template = facts.chat_template
            tokenizer.chat_template_name = f"--processor {facts.name}'s chat template"
        super().__init__(tokenizer, spec, skip_errors=skip_errors)
        self.image_token = facts.image_token  # what the template writes for an image
        self.image_token_id = facts.image_token_id  # what an image's span is made of in the ids
        self.model_token = facts.model_token
        replace = self._replace if self.family.rule == "replace" else None
        self.formatter = ImageFormatter(spec, tokenizer, images_field, base, self.image_token, replace)
        self.max_len = max_len
        self._pending: list[tuple[list[Image], list[int] | None]] = []

    @cached_property
    def processor(self):
        """The processor, loaded at first use; it must be the one the build's facts (its identity, its manifest
        record) were read from: a folder changed since (while the build hashed its source) is refused."""
        processor = load_processor(self.processor_name)
        if (processor_info(processor, self.processor_name)["fingerprint"] != self.facts.record["fingerprint"]
                or image_token_id(processor) != self.image_token_id):
            raise ConfigError(f"--processor {self.processor_name}: its files changed while the build ran; rerun once "
                              "they no longer change")
        return processor

    def ready(self) -> None:
        """As ``Encoder.ready``, and the processor loaded (once, before the workers fork)."""
        super().ready()
        self.processor  # noqa: B018

    def __getstate__(self) -> dict[str, Any]:  # a spawned worker loads the processor itself
        return {k: v for k, v in self.__dict__.items() if k != "processor"}

    def example(self, record: dict[str, Any]):
        out = super().example(record)
        # only a record that made it this far is kept
        self._pending.append((self.formatter.last_images, self.formatter.last_counts))
        return out

    def _replace(self, text: str, spans: list[tuple[int, int]], images: list[Image]):
        """The "replace" rule: the processor's own replacement text for each image in place of its placeholder
        (its ``_process_images`` and ``get_text_with_replacements``, as ``processor.__call__`` runs them), the
        trained spans moved with it; and each image's count of image tokens."""
        proc = self.processor
        _, replacements = proc._process_images([[decode(im.data) for im in images]], **images_kwargs(proc))
        texts, offsets = proc.get_text_with_replacements([text], replacements)
        moved = []
        for start, end in spans:
            shift = sum(len(o["replacement"]) - (o["span"][1] - o["span"][0]) for o in offsets[0] if o["span"][1] <= start)
            moved.append((start + shift, end + shift))
        return texts[0], moved, [r.count(self.model_token) for r in replacements]

    def offsets_and_spans(self, records: list[dict]) -> list[tuple[np.ndarray, list[tuple[int, int]], bool, bool]]:
        """As the text Encoder's (``verify --source`` recomputes the loss mask from them), for the expanded
        tokens: under the "count" rule each image's tokens take its one placeholder's offsets."""
        out = []
        for record in records:
            self._pending = []
            text, spans, flag = self.example(record)
            (images, counts), self._pending = self._pending[0], []
            enc = self.backend.encode(text, add_special_tokens=self.add_special_tokens)
            offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
            if counts is None and images:
                repeat = np.ones(len(offsets), np.int64)
                repeat[np.asarray(enc.ids) == self.image_token_id] = self.image_tokens(images)
                offsets = np.repeat(offsets, repeat, axis=0)
            out.append((offsets, spans, flag, self.appends_eos(enc.ids)))
        return out

    def image_tokens(self, images: list[Image]) -> list[int]:
        """The "count" rule: each image's placeholder count, by the processor's own rule for its size."""
        if not images:
            return []
        data = self.processor._get_num_multimodal_tokens(
            image_sizes=[(im.height, im.width) for im in images])
        return [int(n) for n in data["num_image_tokens"]]

    def encode(self, records: dict[str, list], first_index: int, *, where: str = "record") -> EncodedImages:
        self._pending = []
        enc = super().encode(records, first_index, where=where)
        pending, self._pending = self._pending, []
        starts = np.zeros(len(enc.lengths) + 1, np.int64)
        np.cumsum(enc.lengths, out=starts[1:])
        repeat = np.ones(len(enc.ids), np.int64)
        spans_out, kept, dropped = [], [], 0
        for k, (images, counts) in enumerate(pending):
            ids = enc.ids[starts[k]:starts[k + 1]]
            at = np.flatnonzero(ids == self.image_token_id)
            if counts is None:  # the "count" rule: each image's one placeholder token, repeated
                if len(at) != len(images):
                    raise RecordError(f"{where} {int(enc.example_ids[k]) + 1}: the placeholder {self.image_token!r} is "
                                      f"{len(at)} token(s) for {len(images)} image(s); the tokenizer does not hold it "
                                      "as one token", "image_count")
                counts = self.image_tokens(images)
                repeat[starts[k] + at] = counts
                first = at + np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64) - 1)[:-1]]).astype(np.int64)
                spans = [(int(f), n, n) for f, n in zip(first.tolist(), counts, strict=True)]
            else:  # the "replace" rule: the ids hold each image's tokens already, in order
                if len(at) != sum(counts):
                    raise RecordError(f"{where} {int(enc.example_ids[k]) + 1}: {len(at)} image tokens for the "
                                      f"{sum(counts)} the processor's replacements hold", "image_count")
                ends = np.cumsum(counts)
                spans = [(int(at[e - n]), int(at[e - 1] - at[e - n] + 1), n)
                         for e, n in zip(ends.tolist(), counts, strict=True)]
            length = int(repeat[starts[k]:starts[k + 1]].sum())
            last = spans[-1][0] + spans[-1][1] if spans else 0
            if self.max_len is not None and length > self.max_len and last > self.max_len:
                dropped += 1  # a cut at --max-len would fall inside or before an image: dropped, counted
                repeat[starts[k]:starts[k + 1]] = 0
                continue
            kept.append(k)
            spans_out.append(spans)
        ids = np.repeat(enc.ids, repeat)
        trained = np.repeat(enc.trained, repeat)
        trained[ids == self.image_token_id] = 0  # a placeholder is never a target
        lengths = np.add.reduceat(repeat, starts[:-1]) if len(enc.lengths) else enc.lengths
        keep = np.asarray(kept, np.int64)
        skipped = enc.skipped
        if dropped:
            skipped = Skipped(({**skipped.by_part[0], CUT_IMAGE: skipped.by_part[0].get(CUT_IMAGE, 0) + dropped},))
        return EncodedImages(ids.astype(np.int32), trained.astype(np.uint8), lengths[keep].astype(np.int64),
                             enc.example_ids[keep], skipped, [pending[k][0] for k in kept], spans_out)
