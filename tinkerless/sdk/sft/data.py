"""SFT data: chat JSONL read, checked and rendered into weighted token sequences.

Each line is one example, either a conversation::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...", "train": false}, ...]}

or a prompt/completion pair ``{"prompt": "...", "completion": "..."}`` (the prompt a string, read as one
user message, or a list of messages). A conversation is rendered with the model's own chat template,
so its token ids are exactly ``tokenizer.apply_chat_template(messages)``.

Which tokens carry weight (as the Tinker cookbook's renderers decide): the content of every assistant
message and the special token that closes its turn (``<|im_end|>`` in ChatML) weigh 1, because the
model must learn to say the reply and to stop; the role header that opens the turn
(``<|im_start|>assistant\\n``), the whitespace the template writes after the closing token, and
every system, user and tool message weigh 0. An assistant message with ``"train": false`` weighs 0
entirely (an example of a reply the model should not learn, kept as context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from tinkerless.errors import ConfigError, DatasetError

ROLES = ("system", "user", "assistant", "tool")
_FORMAT_HINT = (
    'each line is {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} '
    'or {"prompt": "...", "completion": "..."}'
)


@dataclass
class SFTExample:
    """One rendered example: token ids and the weight (0 or 1) of each token as a training target."""

    tokens: np.ndarray  # int32 [N]
    weights: np.ndarray  # float32 [N]
    line: int  # 1-based line in the source file (0 for in-memory data)
    images: list | None = None  # a vision-language model's processed images (`VisionInput`), in token order

    @property
    def trained_tokens(self) -> int:
        return int(self.weights.sum())


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; a malformed line is a DatasetError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"SFT data file {str(path)!r} does not exist", hint="pass a JSONL file; " + _FORMAT_HINT)
    records = []
    with open(path, encoding="utf-8", errors="strict") as handle:
        try:
            lines = list(handle)
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path} is not UTF-8 text ({exc})", hint="save the file as UTF-8 JSON lines") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise DatasetError(
                f"{path}, line {number}: not valid JSON ({why})", hint="fix or delete that line; " + _FORMAT_HINT
            ) from None
        records.append((number, record))
    if not records:
        raise DatasetError(f"{path} holds no examples", hint=_FORMAT_HINT)
    return records


def as_records(data: Any) -> list[tuple[int, dict]]:
    """SFT data as (line, record): a JSONL path, or an in-memory list of records (line 0 = item index + 1)."""
    if isinstance(data, (str, Path)):
        return read_jsonl(data)
    if isinstance(data, (list, tuple)):
        if not data:
            raise DatasetError("the SFT data list is empty", hint=_FORMAT_HINT)
        return [(i + 1, record) for i, record in enumerate(data)]
    raise DatasetError(
        f"SFT data must be a JSONL path or a list of examples, got {type(data).__name__}", hint=_FORMAT_HINT
    )


def to_messages(record: Any, where: str) -> list[dict]:
    """The record's conversation as a list of {"role", "content"[, "train"]} dicts, checked."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}", hint=_FORMAT_HINT)
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not isinstance(completion, str):
            raise DatasetError(f"{where}: 'completion' must be a string, got {type(completion).__name__}", hint=_FORMAT_HINT)
        prompt_messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(prompt_messages, list):
            raise DatasetError(f"{where}: 'prompt' must be a string or a list of messages", hint=_FORMAT_HINT)
        messages = [*prompt_messages, {"role": "assistant", "content": completion}]
    else:
        raise DatasetError(f"{where}: no 'messages' and no 'prompt'/'completion' (keys: {sorted(record)[:8]})", hint=_FORMAT_HINT)
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list", hint=_FORMAT_HINT)
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetError(f"{where}: message {i} is a {type(message).__name__}, not an object", hint=_FORMAT_HINT)
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DatasetError(f"{where}: message {i} has role {role!r}", hint=f"use one of {', '.join(ROLES)}")
        if isinstance(content, list):  # content parts: text and images (docs/vision.md)
            from tinkerless.errors import InvalidRequest
            from tinkerless.wire.content import to_parts

            try:
                content = to_parts(content, f"message {i} content")
            except InvalidRequest as exc:
                raise DatasetError(f"{where}: {exc.message}", hint=exc.hint) from None
        elif not isinstance(content, str):
            raise DatasetError(
                f"{where}: message {i} ({role}) has no string 'content' (got {type(content).__name__})",
                hint="every message needs its text in 'content' (or a list of text and image parts)",
            )
        train = message.get("train", role == "assistant")
        if not isinstance(train, bool):
            raise DatasetError(f"{where}: message {i} has 'train': {train!r}; it must be true or false")
        if train and role != "assistant":
            raise DatasetError(
                f"{where}: message {i} is a {role} message with 'train': true; only assistant messages are trained",
                hint="drop the 'train' key there, or make the message an assistant turn",
            )
        checked.append({"role": role, "content": content, "train": train})
    if not any(m["train"] for m in checked):
        has_assistant = any(m["role"] == "assistant" for m in checked)
        raise DatasetError(
            f"{where}: no assistant turn to train on"
            + (" (every assistant message has 'train': false)" if has_assistant else " (the conversation has none)"),
            hint="SFT learns the assistant's replies: add an assistant message, or drop the example",
        )
    return checked


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template into (tokens, weights)."""

    def __init__(self, tokenizer, end_of_turn_id: int | None, vision: Any = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the model's tokenizer has no chat template, so chat SFT data cannot be rendered",
                hint="use a chat model (e.g. smollm2), or a tokenizer with a chat_template",
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("SFT needs a fast tokenizer (for token offsets)", hint="load the model's tokenizer.json")
        self.tokenizer = tokenizer
        self.end_of_turn = tokenizer.convert_ids_to_tokens(end_of_turn_id) if end_of_turn_id is not None else None
        self.vision = vision  # a VisionProcessor: image parts rendered as the template's placeholders, then expanded

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        from tinkerless.wire.content import TextPart

        plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"} for p in m["content"]]}
            for m in messages]
        return self.tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt, tokenize=False)

    def _opening(self, before: list[dict]) -> str:
        """The text up to and including the header of the next assistant turn."""
        try:
            return self._text(before, True)
        except Exception:  # a template that cannot render an empty conversation: the turn opens the text
            if before:
                raise
            return ""

    def trained_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The whole rendered text and the character spans that carry weight."""
        full = self._text(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if not message["train"]:
                continue
            opened = self._opening(messages[:i])
            closed = self._text(messages[: i + 1], False)
            if not (closed.startswith(opened) and full.startswith(closed)):
                raise ConfigError(
                    f"{where}: the model's chat template renders message {i} differently depending on what follows "
                    "it, so the assistant's tokens cannot be located",
                    hint="use a template that renders a conversation as a concatenation of its turns (ChatML, Llama 3)",
                )
            start, end = len(opened), len(closed)
            if self.end_of_turn and self.end_of_turn in closed[start:]:
                end = closed.rindex(self.end_of_turn, start) + len(self.end_of_turn)
            else:
                end = start + len(closed[start:].rstrip())
            spans.append((start, end))
        return full, spans

    def render(self, messages: list[dict], where: str, line: int) -> SFTExample:
        full, spans = self.trained_spans(messages, where)
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        weights = np.zeros(len(ids), dtype=np.float32)
        for index, (token_start, _token_end) in enumerate(offsets):
            # A token belongs to the turn its first character is in.
            if any(start <= token_start < end for start, end in spans):
                weights[index] = 1.0
        weights[0] = 0.0  # the first token has no prefix to be predicted from
        if weights.sum() == 0:
            raise DatasetError(f"{where}: the assistant turns render to no tokens", hint="give them some content")
        images = self._images(messages, where)
        if images:  # each placeholder becomes the image's tokens, never trained
            ids, weights = self._expanded(ids, weights, images)
        return SFTExample(np.asarray(ids, dtype=np.int32), weights, line, images or None)

    def _images(self, messages: list[dict], where: str) -> list:
        from tinkerless.wire.content import ImagePart

        parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if isinstance(p, ImagePart)]
        if parts and self.vision is None:
            raise DatasetError(f"{where}: the conversation holds images and this model takes none",
                               hint="use a vision-language model (docs/vision.md), or drop the images")
        return [self.vision.process(p) for p in parts]

    def _expanded(self, ids: list[int], weights: np.ndarray, images: list) -> tuple[list[int], np.ndarray]:
        placeholder = self.vision.image_token_id
        if sum(1 for t in ids if t == placeholder) != len(images):
            raise DatasetError("the text holds the model's image token itself, or the template drops images",
                               hint="do not write the image token in text; send image parts")
        out_ids, out_weights, pending = [], [], iter(images)
        for token, weight in zip(ids, weights):
            count = next(pending).num_tokens if token == placeholder else 1
            out_ids += [token] * count
            out_weights += [0.0 if token == placeholder else float(weight)] * count
        return out_ids, np.asarray(out_weights, dtype=np.float32)


def render_examples(
    records: Iterable[tuple[int, dict]], renderer: ChatRenderer, *, max_length: int, source: str
) -> list[SFTExample]:
    """Every record rendered; the first bad one (shape, no assistant turn, too long) is a DatasetError."""
    examples = []
    for line, record in records:
        where = f"{source}, line {line}" if line else source
        example = renderer.render(to_messages(record, where), where, line)
        if len(example.tokens) > max_length:
            raise DatasetError(
                f"{where}: the conversation is {len(example.tokens)} tokens, over max_length={max_length}",
                hint="shorten or split that conversation, drop it, or raise max_length (up to the model's context)",
            )
        examples.append(example)
    return examples


def split_holdout(examples: list[SFTExample], fraction: float, seed: int) -> tuple[list[SFTExample], list[SFTExample]]:
    """(train, eval): a seeded `fraction` of the examples held out, at least one of each when there are two."""
    if fraction <= 0 or len(examples) < 2:
        return list(examples), []
    order = np.random.default_rng(seed).permutation(len(examples))
    count = min(max(1, round(fraction * len(examples))), len(examples) - 1)
    held = set(order[:count].tolist())
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


__all__ = ["ChatRenderer", "SFTExample", "as_records", "read_jsonl", "render_examples", "split_holdout", "to_messages"]
