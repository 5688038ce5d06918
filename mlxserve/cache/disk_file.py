"""One prefix-cache entry on disk: a safetensors file whose header holds a manifest.

Layout (a standard safetensors file, readable by any safetensors reader):

    8 bytes   little-endian length N of the JSON header
    N bytes   JSON: each tensor's dtype, shape and data_offsets, and __metadata__:
              "mlxserve.manifest"        the manifest, as JSON text
              "mlxserve.manifest_sha256" SHA-256 of that text
    payload   the tensors' bytes, back to back

The manifest holds the format version, the model's signature, exactly the
token ids the snapshot holds, the cache layout (each layer's class and
settings), the tensor table again, the payload's size and its SHA-256. A file
is used only if every one of those checks out; anything else is a
`CorruptEntry`. Writes go to a temp file in the same folder, are fsynced and
renamed over the final name, and the folder is fsynced, so a crash leaves
either the old file, the new one, or a temp file that the next start removes.

No MLX here: the writer thread reads the arrays' bytes through `memoryview`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "FORMAT_VERSION",
    "CorruptEntry",
    "Manifest",
    "Tensor",
    "TEMP_PREFIX",
    "read_entry",
    "read_manifest",
    "write_entry",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
_MANIFEST = "mlxserve.manifest"
_MANIFEST_SUM = "mlxserve.manifest_sha256"
_PLACEHOLDER = "0" * 64  # a SHA-256 hex digest's length, filled in after the payload
_READ_CHUNK = 8 * 1024 * 1024
# A header larger than this is not one of ours (a 1M-token key is about 8 MB of JSON).
_MAX_HEADER = 256 * 1024 * 1024


class CorruptEntry(ValueError):
    """A file that is not a whole, intact entry of this format."""


@dataclass(frozen=True)
class Tensor:
    """One tensor's dtype (a safetensors name), shape and bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass(frozen=True)
class Manifest:
    signature: str
    tokens: list[int]
    layout: list[dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    payload_bytes: int
    payload_sha256: str
    file_bytes: int


def _header(manifest: dict[str, Any], table: dict[str, Any]) -> bytes:
    text = json.dumps(manifest, separators=(",", ":"), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    header = dict(table)
    header["__metadata__"] = {_MANIFEST: text, _MANIFEST_SUM: digest}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_entry(
    path: Path,
    signature: str,
    tokens: list[int],
    layout: list[dict[str, Any]],
    tensors: list[Tensor],
) -> int:
    """Write an entry atomically at `path`; returns the file's size in bytes.

    One pass over the payload: the header is written with a placeholder digest,
    the payload is hashed as it is written, then the header is written again
    (the same length) with the real one.
    """
    table: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        size = memoryview(t.data).nbytes
        span = [offset, offset + size]
        table[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": span}
        offset += size
    manifest = {
        "version": FORMAT_VERSION,
        "signature": signature,
        "tokens": tokens,
        "layout": layout,
        "tensors": table,
        "payload_bytes": offset,
        "payload_sha256": _PLACEHOLDER,
    }
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            header = _header(manifest, table)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            digest = hashlib.sha256()
            for t in tensors:
                digest.update(t.data)
                f.write(t.data)
            manifest["payload_sha256"] = digest.hexdigest()
            final = _header(manifest, table)
            if len(final) != len(header):
                # Cannot happen: both digests are fixed-width hex.
                raise RuntimeError("entry header changed length")
            f.seek(8)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return 8 + len(header) + offset


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a folder; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError as e:  # advisory where the file system refuses it; the rename stands
        logger.debug("fsync of %s refused: %s", folder, e)
    finally:
        os.close(fd)


def _read_header(f: BinaryIO, file_bytes: int) -> tuple[dict[str, Any], int]:
    prefix = f.read(8)
    if len(prefix) != 8:
        raise CorruptEntry("truncated before its header")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(_MAX_HEADER, file_bytes - 8):
        raise CorruptEntry("header length out of range")
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptEntry(f"unreadable header: {e}") from e
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object")
    return header, 8 + length


def _manifest(header: dict[str, Any], start: int, file_bytes: int) -> Manifest:
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict):
        raise CorruptEntry("no manifest")
    text, digest = meta.get(_MANIFEST), meta.get(_MANIFEST_SUM)
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != digest:
        raise CorruptEntry("manifest checksum mismatch")
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptEntry(f"unreadable manifest: {e}") from e
    if not isinstance(m, dict):
        raise CorruptEntry("manifest is not an object")
    if m.get("version") != FORMAT_VERSION:
        raise CorruptEntry(f"format version {m.get('version')!r}, not {FORMAT_VERSION}")
    if m.get("tensors") != header:
        raise CorruptEntry("tensor table differs from the manifest's")
    payload = m.get("payload_bytes")
    if not isinstance(payload, int) or start + payload != file_bytes:
        raise CorruptEntry(f"file is {file_bytes} bytes, expected {start} + {payload}")
    tokens = m.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        raise CorruptEntry("malformed token ids")
    layout = m.get("layout")
    if not isinstance(layout, list):
        raise CorruptEntry("malformed cache layout")
    return Manifest(
        signature=str(m.get("signature")),
        tokens=tokens,
        layout=layout,
        tensors=m["tensors"],
        payload_bytes=payload,
        payload_sha256=str(m.get("payload_sha256")),
        file_bytes=file_bytes,
    )


def read_manifest(path: Path) -> Manifest:
    """The manifest of an entry file (header only: the payload is not read or checked)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _read_header(f, size)
        return _manifest(header, start, size)


def read_entry(path: Path) -> tuple[Manifest, dict[str, Tensor]]:
    """A whole entry, its payload checked against the manifest's digest."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _read_header(f, size)
        manifest = _manifest(header, start, size)
        payload = bytearray(manifest.payload_bytes)
        view = memoryview(payload)
        digest = hashlib.sha256()
        done = 0
        while done < len(payload):
            got = f.readinto(view[done : done + _READ_CHUNK])
            if not got:
                raise CorruptEntry("truncated payload")
            digest.update(view[done : done + got])
            done += got
    if digest.hexdigest() != manifest.payload_sha256:
        raise CorruptEntry("payload checksum mismatch")
    tensors: dict[str, Tensor] = {}
    for name, spec in manifest.tensors.items():
        try:
            begin, end = spec["data_offsets"]
            shape = tuple(int(d) for d in spec["shape"])
            tensors[name] = Tensor(name, str(spec["dtype"]), shape, view[begin:end])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptEntry(f"malformed tensor entry {name!r}") from e
    return manifest, tensors
