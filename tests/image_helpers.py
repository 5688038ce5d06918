"""Tiny test images built in memory with Pillow, good and bad, and their wire forms."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

from PIL import Image


def encoded(fmt: str, size: tuple[int, int] = (4, 3), color: Any = (200, 40, 10)) -> bytes:
    """A small solid image in Pillow format `fmt` (PNG, JPEG, WEBP, GIF)."""
    buf = io.BytesIO()
    mode = "P" if fmt == "GIF" else "RGB"
    Image.new(mode, size, color if mode == "RGB" else 1).save(buf, format=fmt)
    return buf.getvalue()


def png(size: tuple[int, int] = (4, 3), color: Any = (200, 40, 10)) -> bytes:
    return encoded("PNG", size, color)


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` over almost no data (a bomb, or zero)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 16)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def truncated_png() -> bytes:
    """A real PNG of noisy pixels cut off inside its image data."""
    im = Image.frombytes("RGB", (64, 64), bytes((i * 37) % 251 for i in range(64 * 64 * 3)))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    whole = buf.getvalue()
    return whole[: len(whole) // 2]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def openai_image(url: str, detail: str | None = "low") -> dict[str, Any]:
    spec: dict[str, Any] = {"url": url}
    if detail is not None:
        spec["detail"] = detail
    return {"type": "image_url", "image_url": spec}


def anthropic_image(data: bytes | str, media_type: str = "image/png") -> dict[str, Any]:
    text = data if isinstance(data, str) else b64(data)
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": text}}


def responses_image(url: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto"}
