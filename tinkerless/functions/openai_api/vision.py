"""OpenAI chat messages with `image_url` parts: rendered by the model's processor, never fetched.

A message's content may hold `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` parts
(and `{"type": "image", ...}` ones); each is checked at the boundary by `wire.content` (count, bytes, pixels,
format, mode; `http(s)://` URLs refused: the server never requests an address a caller chose). The conversation
is rendered with the model's own template and the image placeholders expanded (`functions/vision/processing`);
the router hands the processed images to the backend beside the prompt's token ids.
"""

from __future__ import annotations

from typing import Any

from tinkerless.errors import InvalidRequest
from tinkerless.functions.openai_api.backend import OpenAIError
from tinkerless.functions.openai_api.render import ROLES
from tinkerless.wire.content import ImagePart, count_request_images, to_parts


def has_image_parts(messages: Any) -> bool:
    """Whether any message's content is a list holding a part that is not text."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(not (isinstance(p, dict) and p.get("type") == "text") for p in m["content"]) for m in messages)


def render_vision_chat(backend: Any, messages: list, tools: list) -> tuple[list[int], tuple]:
    """(prompt token ids, processed images) of a chat with images, or an OpenAIError naming what is wrong."""
    chat = getattr(backend, "vision_chat", lambda: None)()
    if chat is None:
        raise OpenAIError("this model reads text parts only: a message holds an image", param="messages",
                          code="images_not_supported", hint="use a vision-language model, or send text parts")
    if tools:
        raise OpenAIError("tools with images are not supported yet", param="tools",
                          hint="send the images without tools, or the tools without images")
    normalized, images = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise OpenAIError(f"{where} must be an object with a role, one of {', '.join(ROLES)}", param=where)
        try:
            content = to_parts(message.get("content") or "", f"{where}.content")
        except InvalidRequest as exc:
            raise OpenAIError(exc.message, param=f"{where}.content", code="invalid_image", hint=exc.hint) from None
        if isinstance(content, list):
            images += [p for p in content if isinstance(p, ImagePart)]
        role = "system" if message["role"] == "developer" else message["role"]
        normalized.append({"role": role, "content": content})
    try:
        count_request_images(images, "messages")
    except InvalidRequest as exc:
        raise OpenAIError(exc.message, param="messages", code="invalid_image", hint=exc.hint) from None
    tokens, parts = chat.prompt(normalized)
    return tokens, tuple(chat.processor.process(p) for p in parts)
