"""Content parts: the one form an image takes in a message, a task, an observation or a training datum.

A message's `content` is a string or a list of parts. On the wire a part is a `TextPart` or an `ImagePart`
(the encoded file's bytes and its media type: nothing API-specific, so OpenAI's `image_url` data URLs,
OpenAI-style `{"type": "image", "image": PIL | numpy | path}` and Anthropic's `{"type": "image", "source":
{"type": "base64", ...}}` blocks all map onto it). `to_parts` turns what a user or an API sends into parts;
`check_image` opens an image under the limits a server enforces (count, bytes, pixels, format, mode), so a
hostile image is a 400 naming its fault, never a decompression bomb or a 500 deep in a processor.

A server never fetches an image: `http(s)://` URLs are refused (no requests to addresses a caller chose).

What the update needs of an image travels as a `VisionInput`: the processed pixel tensor and its grid, keyed
by the content hash of the image's bytes, so a transcript refers to an image by hash and a batch encodes it once.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinkerless.errors import InvalidRequest

# Limits at the boundary (a server may be stricter; nothing legitimate for a policy comes near them).
MAX_IMAGES_PER_MESSAGE = 16
MAX_IMAGES_PER_REQUEST = 256
MAX_IMAGE_BYTES = 16 << 20  # one encoded image
MAX_REQUEST_IMAGE_BYTES = 64 << 20  # every image of one request together
MAX_IMAGE_PIXELS = 4096 * 4096  # decoded width x height: a 20,000 x 20,000 PNG of a few KB is a bomb
MIN_IMAGE_SIDE = 1
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
MEDIA_TYPES = {v: k for k, v in FORMATS.items()} | {"image/jpg": "JPEG"}
# Modes every image processor takes after conversion to RGB; others (CMYK, I;16, F, YCbCr...) are refused by name.
MODES = ("RGB", "RGBA", "L", "LA", "P", "1")


@dataclass
class TextPart:
    text: str
    type: str = "text"


@dataclass
class ImagePart:
    """An image as its encoded file (PNG, JPEG, WebP, GIF, BMP) and that file's media type."""

    data: bytes
    media_type: str = "image/png"
    type: str = "image"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def reference(self) -> dict:
        """What a transcript written to disk keeps of the image: its hash and type, never its bytes."""
        return {"type": "image", "sha256": self.sha256, "media_type": self.media_type, "bytes": len(self.data)}


@dataclass
class VisionInput:
    """One processed image as the model's tower takes it: `pixel_values` (float32, 2-D: patches x features for
    Qwen-VL, or channels-first pixels flattened for CLIP/SigLIP towers, with `shape` the tensor's own shape) and
    `grid_thw` (Qwen-VL's temporal/height/width patch grid; empty for fixed-size towers). `sha256`: of the image
    file the processor read, so that a batch encodes each image once."""

    sha256: str
    pixel_values: np.ndarray
    grid_thw: list[int]
    num_tokens: int


_MAX_DEPTH = 32  # as `validate.MAX_DEPTH`: how deep a request's images are looked for
_MAX_GRID = 1 << 16  # patches along one side of a processed image
_MAX_IMAGE_TOKENS = 1 << 20


def _fail(where: str, message: str, hint: str = "fix the image in the request (docs/vision.md)") -> None:
    raise InvalidRequest(f"{where} {message}", hint=hint)


# ---- what users and APIs send -> parts -------------------------------------------------------


def to_parts(content: Any, where: str = "content") -> list[TextPart | ImagePart] | str:
    """A message's content as a string, or as a list of `TextPart`/`ImagePart` (images checked by `check_image`).

    Takes a string; or a list of: strings, parts, `{"type": "text", "text"}`, `{"type": "image_url",
    "image_url": {"url": "data:..."} | "data:..."}`, `{"type": "image", "image": PIL | ndarray | path | bytes}`,
    `{"type": "image", "source": {"type": "base64", "media_type", "data"}}` (Anthropic), `{"type": "image",
    "data", "media_type"}` (a part after a round trip through plain data)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        _fail(where, f"must be a string or a list of content parts, got {type(content).__name__}",
              "send text, or a list of {'type': 'text'|'image_url'|'image', ...} parts")
    # Counted before any image is decoded: a thousand images cost nothing to refuse.
    images = sum(1 for item in content if not isinstance(item, (str, TextPart)) and not (
        isinstance(item, dict) and item.get("type") == "text"))
    if images > MAX_IMAGES_PER_MESSAGE:
        _fail(where, f"holds {images} images, more than {MAX_IMAGES_PER_MESSAGE} in one message",
              f"send at most {MAX_IMAGES_PER_MESSAGE} images per message")
    if len(content) > 4 * MAX_IMAGES_PER_MESSAGE + 256:
        _fail(where, f"has {len(content)} parts", "send fewer, larger text parts")
    parts: list[TextPart | ImagePart] = []
    for i, item in enumerate(content):
        parts.append(_part(item, f"{where}[{i}]"))
    return parts


def _part(item: Any, where: str) -> TextPart | ImagePart:
    if isinstance(item, ImagePart):
        check_image(item, where)
        return item
    if isinstance(item, TextPart):
        if not isinstance(item.text, str):
            _fail(f"{where}.text", "must be a string", "send text as a string")
        return item
    if isinstance(item, str):
        return TextPart(item)
    if not isinstance(item, dict):
        return image_part(item, where)  # PIL, ndarray, path
    kind = item.get("type")
    if kind == "text":
        if not isinstance(item.get("text"), str):
            _fail(f"{where}['text']", "must be a string", "send {'type': 'text', 'text': '...'}")
        return TextPart(item["text"])
    if kind == "image_url":
        url = item.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return image_part(url, f"{where}['image_url']")
    if kind in ("image", "input_image"):
        if "source" in item:  # an Anthropic Messages block
            source = item["source"]
            if not isinstance(source, dict) or source.get("type") != "base64":
                _fail(f"{where}['source']", "must be {'type': 'base64', 'media_type', 'data'}",
                      "send the image's bytes; a server never fetches a URL")
            return image_part(_data_url(source.get("media_type"), source.get("data"), where), where)
        if "data" in item:
            part = ImagePart(item["data"], item.get("media_type", "image/png"))
            if not isinstance(part.data, bytes) or not isinstance(part.media_type, str):
                _fail(where, "must hold 'data' bytes and a 'media_type' string", "send the image file's bytes")
            check_image(part, where)
            return part
        key = "image" if "image" in item else "image_url"
        return image_part(item.get(key), f"{where}[{key!r}]")
    _fail(f"{where}['type']", f"is {str(kind)[:40]!r}, not 'text', 'image_url' or 'image'",
          "send {'type': 'text', 'text': ...} or {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}")
    raise AssertionError  # unreachable


def _data_url(media_type: Any, data: Any, where: str) -> str:
    if not isinstance(media_type, str) or not isinstance(data, str):
        _fail(where, "needs a 'media_type' string and base64 'data'", "send the image as base64 text")
    return f"data:{media_type};base64,{data}"


def image_part(image: Any, where: str = "image") -> ImagePart:
    """An `ImagePart` from a data URL, a PIL image, a numpy array, a file path or the file's bytes, checked."""
    if isinstance(image, ImagePart):
        check_image(image, where)
        return image
    if isinstance(image, str):
        if image.startswith("data:"):
            return _from_data_url(image, where)
        if image.split(":", 1)[0].lower() in ("http", "https", "ftp", "file", "s3", "gs"):
            _fail(where, f"is a URL ({image[:60]!r}); a server never fetches images from addresses a caller names",
                  "send the image's bytes: a data:image/png;base64,... URL, a PIL image or a numpy array")
        return _from_path(Path(image), where)
    if isinstance(image, Path):
        return _from_path(image, where)
    if isinstance(image, (bytes, bytearray)):
        part = ImagePart(bytes(image), "image/png")
        part.media_type = FORMATS.get(_open(part, where).format or "", "image/png")
        return part
    if isinstance(image, np.ndarray):
        return _from_array(image, where)
    if type(image).__module__.startswith("PIL.") and hasattr(image, "save"):
        return _from_pil(image, where)
    _fail(where, f"is a {type(image).__name__}, not an image",
          "send a data URL, a PIL image, a numpy array (H x W or H x W x 1/3/4, uint8 or floats in [0, 1]) or a path")
    raise AssertionError


def _from_data_url(url: str, where: str) -> ImagePart:
    # The base64 text is 4/3 of the bytes: refuse an oversized string before decoding it.
    if len(url) > MAX_IMAGE_BYTES * 4 // 3 + 256:
        _fail(where, f"is a {len(url) / 1e6:.1f} MB data URL, over the {MAX_IMAGE_BYTES >> 20} MB limit per image",
              "send a smaller image (resize it: the model's processor shrinks it anyway)")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        _fail(where, "is a data URL without ';base64,'", "encode the image as data:image/png;base64,<base64 bytes>")
    media_type = header[len("data:") : -len(";base64")].lower()
    if media_type not in MEDIA_TYPES:
        _fail(where, f"has media type {media_type[:40]!r}, not one of {', '.join(sorted(MEDIA_TYPES))}",
              "send PNG, JPEG, WebP, GIF or BMP")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        _fail(where, "holds text that is not valid base64", "base64-encode the image file's bytes")
    part = ImagePart(data, "image/jpeg" if media_type == "image/jpg" else media_type)
    check_image(part, where)
    return part


def _from_path(path: Path, where: str) -> ImagePart:
    """A file on the caller's own machine (client side only: a server's boundary gets bytes, see `to_parts`)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        _fail(where, f"names a file that cannot be read ({str(path)[:80]!r}: {exc.strerror})",
              "pass an existing image file, a PIL image, a numpy array or a data URL")
    if size > MAX_IMAGE_BYTES:
        _fail(where, f"is a {size / 1e6:.1f} MB file, over the {MAX_IMAGE_BYTES >> 20} MB limit per image", "send a smaller image")
    return image_part(path.read_bytes(), where)


def _from_pil(image: Any, where: str) -> ImagePart:
    if image.width * image.height > MAX_IMAGE_PIXELS:
        _fail(where, f"is {image.width} x {image.height} pixels, more than {MAX_IMAGE_PIXELS} in all", "resize the image")
    if image.mode not in MODES:
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    part = ImagePart(buffer.getvalue(), "image/png")
    check_image(part, where)
    return part


def _from_array(array: np.ndarray, where: str) -> ImagePart:
    from PIL import Image

    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        _fail(where, f"is an array of shape {array.shape}; an image is H x W, or H x W x 1, 3 or 4 (channels last)",
              "send uint8 pixels, channels last")
    if min(array.shape[:2]) < MIN_IMAGE_SIDE or array.shape[0] * array.shape[1] > MAX_IMAGE_PIXELS:
        _fail(where, f"is an array of {array.shape[0]} x {array.shape[1]} pixels, outside 1 .. {MAX_IMAGE_PIXELS} pixels",
              "resize the image")
    if array.dtype == np.uint8:
        pixels = array
    elif array.dtype.kind == "f":
        if not np.isfinite(array).all():
            _fail(where, "is an array holding NaN or infinite values", "send finite pixels in [0, 1] or uint8")
        if array.min() < 0 or array.max() > 1:
            _fail(where, f"is a float array with values in [{array.min():.3g}, {array.max():.3g}], outside [0, 1]",
                  "scale float pixels to [0, 1], or send uint8")
        pixels = np.round(array * 255).astype(np.uint8)
    else:
        _fail(where, f"is an array of dtype {array.dtype}; images are uint8, or floats in [0, 1]", "convert it to uint8")
    return _from_pil(Image.fromarray(np.ascontiguousarray(pixels)), where)


# ---- opening an image under the limits ----------------------------------------------------------


def _open(part: ImagePart, where: str):
    """The image decoded (and fully loaded), or an InvalidRequest naming what is wrong with it."""
    from PIL import Image

    if len(part.data) > MAX_IMAGE_BYTES:
        _fail(where, f"is {len(part.data) / 1e6:.1f} MB, over the {MAX_IMAGE_BYTES >> 20} MB limit per image", "send a smaller image")
    if not part.data:
        _fail(where, "is empty", "send the image file's bytes")
    try:
        image = Image.open(io.BytesIO(part.data), formats=list(FORMATS))
    except Image.DecompressionBombError as exc:  # Pillow's own guard, past twice its default limit
        _fail(where, f"declares too many pixels ({str(exc)[:90]}), over {MAX_IMAGE_PIXELS} in all", "resize the image")
    except Exception as exc:  # UnidentifiedImageError, and any decoder's own error on hostile headers
        _fail(where, f"is not a readable image ({type(exc).__name__})", "send a PNG, JPEG, WebP, GIF or BMP file")
    # The header's size is checked before decoding a pixel: a small file may declare billions of pixels.
    width, height = image.size
    if width < MIN_IMAGE_SIDE or height < MIN_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        _fail(where, f"is {width} x {height} pixels, outside 1 .. {MAX_IMAGE_PIXELS} pixels in all "
              f"(a {int(math.sqrt(MAX_IMAGE_PIXELS))} x {int(math.sqrt(MAX_IMAGE_PIXELS))} image)", "resize the image")
    if image.mode not in MODES:
        _fail(where, f"has mode {image.mode!r}, not one of {', '.join(MODES)}", "save it as an RGB or grayscale image")
    try:
        # verify() reads every chunk to the end with its checksum (a PNG cut after its pixel data still decodes);
        # it leaves the image unusable, so the pixels are loaded from a second opening.
        Image.open(io.BytesIO(part.data), formats=list(FORMATS)).verify()
        image.load()  # a truncated file fails here too (Pillow refuses truncated images by default)
    except Exception as exc:
        _fail(where, f"cannot be decoded ({type(exc).__name__}: {str(exc)[:80]}): the file is truncated or corrupt",
              "send the whole image file")
    return image


def check_image(part: ImagePart, where: str = "image") -> None:
    """Refuse an image a server must not take: too large in bytes or pixels, not an image, truncated, odd mode."""
    if not isinstance(part.data, bytes):
        _fail(f"{where}.data", f"must be bytes, got {type(part.data).__name__}", "send the image file's bytes")
    if part.media_type not in MEDIA_TYPES:
        _fail(f"{where}.media_type", f"is {str(part.media_type)[:40]!r}, not one of {', '.join(sorted(MEDIA_TYPES))}",
              "send PNG, JPEG, WebP, GIF or BMP")
    image = _open(part, where)
    declared = MEDIA_TYPES[part.media_type]
    if image.format != declared:
        _fail(f"{where}.media_type", f"says {part.media_type} but the file is {image.format}",
              "send the media type of the file you send")


def open_rgb(part: ImagePart, where: str = "image"):
    """The checked image as an RGB PIL image (what every processor here takes)."""
    return _open(part, where).convert("RGB")


def images_in(messages: Any) -> list[ImagePart]:
    """Every ImagePart of a list of messages, in order."""
    found: list[ImagePart] = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found += [p for p in content if isinstance(p, ImagePart)]
    return found


def count_request_images(parts: list[ImagePart], where: str) -> None:
    """The per-request limits: how many images, and their bytes together."""
    if len(parts) > MAX_IMAGES_PER_REQUEST:
        _fail(where, f"holds {len(parts)} images, more than {MAX_IMAGES_PER_REQUEST} in one request",
              "split the request into smaller ones")
    total = sum(len(p.data) for p in parts)
    if total > MAX_REQUEST_IMAGE_BYTES:
        _fail(where, f"holds {total / 1e6:.1f} MB of images, over {MAX_REQUEST_IMAGE_BYTES >> 20} MB in one request",
              "split the request into smaller ones, or send smaller images")


def text_of(content: Any) -> str:
    """A message's text (its text parts joined) - what a text-only reader of the transcript sees."""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, TextPart)) if isinstance(content, list) else str(content)


def for_disk(value: Any, depth: int = 0) -> Any:
    """`value` (a transcript, a task) with every image a reference by hash: episodes.jsonl never inlines an image's
    bytes (an `ImagePart`, or an image array a task carries, becomes {"type": "image", "sha256", ...})."""
    if depth > 64:
        return value
    if isinstance(value, ImagePart):
        return value.reference()
    if isinstance(value, TextPart):
        return {"type": "text", "text": value.text}
    if isinstance(value, np.ndarray) and value.ndim >= 2 and value.size > 256:
        return {"type": "image_array", "sha256": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest(),
                "shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: for_disk(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [for_disk(v, depth + 1) for v in value]
    return value


# ---- a whole request's images ---------------------------------------------------------------


def check_request_images(request: Any) -> None:
    """Every image anywhere in a request (tasks, messages, env arguments) within the per-request limits and each
    one readable under the limits of `content.check_image`; every processed image of a datum well formed."""
    from tinkerless.wire import messages as m

    found: list[ImagePart] = []

    def walk(value: Any, path: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            return
        if isinstance(value, ImagePart):
            found.append(value)
            if len(found) > MAX_IMAGES_PER_REQUEST:
                count_request_images(found, type(request).__name__)
            check_image(value, path)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]", depth + 1)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type) and not isinstance(value, m.Datum):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{path}.{f.name}", depth + 1)

    walk(request, type(request).__name__, 0)
    count_request_images(found, type(request).__name__)
    for i, datum in enumerate(getattr(request, "data", None) or []):
        if isinstance(datum, m.Datum) and datum.images:
            if len(datum.images) > MAX_IMAGES_PER_REQUEST:
                _fail(f"{type(request).__name__}.data[{i}].images", f"holds {len(datum.images)} images, more than "
                      f"{MAX_IMAGES_PER_REQUEST}")
            for j, image in enumerate(datum.images):
                _vision_input(image, f"{type(request).__name__}.data[{i}].images[{j}]")


def _vision_input(image: Any, path: str) -> None:
    pixels = image.pixel_values
    if pixels.ndim < 2 or pixels.ndim > 4 or pixels.dtype.kind != "f" or pixels.size == 0:
        _fail(f"{path}.pixel_values", f"must be a non-empty float array of 2 to 4 dimensions, got {pixels.dtype} {pixels.shape}",
              "send the processor's pixel values as float32")
    if pixels.size > MAX_IMAGE_PIXELS * 4:
        _fail(f"{path}.pixel_values", f"holds {pixels.size} values, more than an image of {MAX_IMAGE_PIXELS} pixels",
              "send smaller images")
    if not np.isfinite(pixels).all():
        _fail(f"{path}.pixel_values", "holds NaN or infinite values", "send the processor's own pixel values")
    if len(image.grid_thw) not in (0, 3) or any(g < 1 or g > _MAX_GRID for g in image.grid_thw):
        _fail(f"{path}.grid_thw", f"is {image.grid_thw!r}: three positive sizes (t, h, w), or none", "send the processor's grid")
    if not 1 <= image.num_tokens <= _MAX_IMAGE_TOKENS:
        _fail(f"{path}.num_tokens", f"is {image.num_tokens}, out of range [1, {_MAX_IMAGE_TOKENS}]")
    if len(image.sha256) != 64 or any(c not in "0123456789abcdef" for c in image.sha256):
        _fail(f"{path}.sha256", "must be 64 lowercase hex digits (the image file's sha256)")
