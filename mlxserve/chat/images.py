"""Images in a chat request: what a client sent, and the checked image the prompt holds.

Every dialect turns its image parts (OpenAI `image_url`, Anthropic `image`,
Responses `input_image`) into an `ImageInput` in place of the part, in the
content list of the chat message it belongs to: the typed object itself, never
a dict, so nothing a client writes in JSON can pose as one. `check_image` turns
it into an `ImagePart` (the decoded bytes, their media type, pixel size and
content hash) or raises `ImageError` naming the part. Only PNG, JPEG, WebP and
GIF (its first frame) are read; the pixel count is checked from the header,
before any pixel is decoded, so a small file that claims a huge image (a
decompression bomb) costs nothing.

No server-side fetching: an `http(s)` URL is refused (rule 13 of
docs/architecture.md: a server that fetches what a prompt names is a
request-forgery hole); only `data:` URLs and inline base64 are read.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from PIL import Image

from mlxserve.chat.errors import PromptError
from mlxserve.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES_PER_REQUEST

# Pillow's format name -> the media type clients use for it.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MEDIA_TYPES = tuple(FORMATS.values())
# Spellings clients send for a type above.
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}
_KINDS = "PNG, JPEG, WebP or GIF"
# What Pillow raises on bytes it cannot decode (a cut-off or corrupt stream).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)


class ImageError(PromptError):
    """An image the server will not read; `where` names the part (e.g. `messages[2].content[0]`)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry (`--max-image-pixels`, `--max-images-per-request`)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES_PER_REQUEST

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ValueError("max_image_pixels must be at least 1")
        if self.max_images < 0:
            raise ValueError("max_images_per_request must be >= 0")


@dataclass(frozen=True)
class ImageInput:
    """An image as the client sent it, not checked yet (any field may hold anything):
    a `url` (OpenAI, Responses), or base64 `data` and the `media_type` it claims
    (Anthropic's base64 source)."""

    where: str
    url: object = None
    data: object = None
    media_type: object = None


@dataclass(frozen=True)
class ImagePart:
    """A checked image: its bytes, what they are, and a hash of them (its identity)."""

    data: bytes
    media_type: str
    width: int
    height: int
    sha256: str
    where: str = ""

    def note(self) -> str:
        """The text that stands in for the image for a model that reads text only.

        Made of the image's own facts only, so history re-sent next turn renders
        byte for byte the same (rule 7) and stays a prefix-cache hit."""
        return (
            f"[image: {self.media_type}, {self.width}x{self.height}, "
            "not shown: this model reads text only]"
        )


def declared_type(media_type: object, where: str) -> str | None:
    """A media type a client named, checked against the kinds read here (None: not named)."""
    if media_type is None or media_type == "":
        return None
    if not isinstance(media_type, str):
        raise ImageError("the media type must be a string", where)
    kind = media_type.strip().lower()
    kind = _ALIASES.get(kind, kind)
    if kind not in MEDIA_TYPES:
        raise ImageError(
            f"unsupported image media type {media_type!r}: send {_KINDS} "
            f"({', '.join(MEDIA_TYPES)})",
            where,
        )
    return kind


def _payload(image: ImageInput) -> tuple[str, str | None]:
    """The base64 text and the declared media type (None: not named) of an image."""
    where = image.where
    if image.url is not None:
        return data_url_parts(image.url, where)
    if not isinstance(image.data, str) or not image.data.strip():
        raise ImageError("the image data must be a non-empty base64 string", where)
    return image.data, declared_type(image.media_type, where)


def data_url_parts(url: object, where: str) -> tuple[str, str | None]:
    """An image URL's base64 text and declared media type: only a `data:` URL is read."""
    if not isinstance(url, str):
        raise ImageError("the image URL must be a string", where)
    text = url.strip()
    if not text:
        raise ImageError("the image URL is empty", where)
    scheme, colon, rest = text.partition(":")
    scheme = scheme.lower()
    if scheme in ("http", "https"):
        raise ImageError(
            "remote image URLs are not fetched (the server never fetches what a request "
            "names); send the image inline as a data: URL (data:image/png;base64,...)",
            where,
        )
    if not colon or scheme != "data":
        shown = scheme[:16] if colon else text[:16]
        raise ImageError(
            f"unsupported image URL scheme {shown!r}: send a data: URL (data:image/png;base64,...)",
            where,
        )
    header, comma, payload = rest.partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not comma or "base64" not in params[1:]:
        raise ImageError("a data: URL must be base64 (data:image/png;base64,...)", where)
    if not payload.strip():
        raise ImageError("the data: URL holds no image data", where)
    return payload, declared_type(params[0], where)


def check_image(image: ImageInput, limits: ImageLimits) -> ImagePart:
    """The image checked: a data: URL or base64 (never fetched), a readable PNG, JPEG,
    WebP or GIF, of the type it declares, within the limits.

    Agents re-send every image of a session with every turn: bytes read once before
    (`_READ`, by content hash) are not decoded again, only held to the limits and
    to the type the client declares this time."""
    where = image.where
    text, declared = _payload(image)
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the image data is not valid base64 ({e})", where) from e
    if not data:
        raise ImageError("the image is empty (zero bytes)", where)
    digest = hashlib.sha256(data).hexdigest()
    actual, width, height = _READ.get(digest) or _read(data, where, limits)
    if width * height > limits.max_pixels:
        raise ImageError(_too_large((width, height), limits), where)
    if declared is not None and declared != actual:
        raise ImageError(f"the image is declared {declared} but its bytes are {actual}", where)
    _READ.put(digest, (actual, width, height))
    return ImagePart(data, actual, width, height, digest, where)


def _read(data: bytes, where: str, limits: ImageLimits) -> tuple[str, int, int]:
    """Media type and size of image bytes, decoding the first frame only once its
    pixel count is known to be within the limit (a bomb is refused from its header)."""
    try:
        # `open` reads the header only; `formats` keeps every other decoder out.
        im = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError as e:
        # Pillow's own process-wide cap (twice Image.MAX_IMAGE_PIXELS, left as it is) is
        # met here before ours only when --max-image-pixels is set above it.
        raise ImageError(_too_large(None, limits), where) from e
    except _DECODE_ERRORS as e:
        raise ImageError(f"the data is not a readable {_KINDS} image", where) from e
    with im:
        width, height = im.size
        if width <= 0 or height <= 0:
            raise ImageError(f"the image has zero size ({width}x{height})", where)
        if width * height > limits.max_pixels:
            raise ImageError(_too_large((width, height), limits), where)
        actual = FORMATS[str(im.format)]
        try:
            im.load()  # decodes the (first) frame: a truncated or corrupt stream fails here
        except _DECODE_ERRORS as e:
            raise ImageError(f"the {actual} image is truncated or corrupt ({e})", where) from e
    return actual, width, height


class _ReadImages:
    """What the most recent images read were (media type, width, height), by the
    SHA-256 of their bytes; a bounded LRU shared by the render threads."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._known: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> tuple[str, int, int] | None:
        with self._lock:
            found = self._known.get(digest)
            if found is not None:
                self._known.move_to_end(digest)
            return found

    def put(self, digest: str, read: tuple[str, int, int]) -> None:
        with self._lock:
            self._known[digest] = read
            self._known.move_to_end(digest)
            while len(self._known) > self._capacity:
                self._known.popitem(last=False)


# A few hundred sessions' screenshots; each entry is a hash and three small values.
_READ = _ReadImages(capacity=1024)


def _too_large(size: tuple[int, int] | None, limits: ImageLimits) -> str:
    shown = f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels" if size else "too many pixels"
    return (
        f"the image is too large ({shown}); the limit is {limits.max_pixels} pixels "
        "(--max-image-pixels)"
    )
