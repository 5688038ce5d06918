"""Measured cache costs kept on disk, so a server that starts again on the same
checkpoint does not measure again (`cost_probe.measured_once`).

One small JSON file per checkpoint and setting, under `<cache folder>/costs/`
(`MLXSERVE_CACHE_DIR`, else ~/.cache/mlxserve), named by the SHA-256 of what the
cost depends on (`cost_probe.checkpoint_key`) and of the code that measured it (the
versions of mlx, mlx-lm, mlx-vlm and mlxserve, a digest of mlxserve's source, this
file's format). The disk is a cache, never a source of truth (rule 10 of
docs/architecture.md): a file is used only when its format, key and versions all match
and its figures are sane; anything in doubt is a miss, logged and removed, and the cost
is measured again.
Writes are atomic (temp file, fsync, rename); a folder that cannot be written
only costs the next start a measurement.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mlxserve.engine.budget import CacheCost

logger = logging.getLogger(__name__)

# Bumped whenever what the probe measures changes (its lengths, schedule or fit).
COST_FORMAT = 1
_PACKAGES = ("mlx", "mlx-lm", "mlx-vlm", "mlxserve")


def code_versions() -> dict[str, str]:
    """The versions of the code a cost was measured with ("" for a package not installed),
    and a digest of mlxserve's own source (a checkout changes without a new version)."""
    found = {}
    for package in _PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = ""
    found["mlxserve_source"] = _source_digest()
    return found


@functools.cache
def _source_digest() -> str:
    """SHA-256 of every module of the mlxserve package (about 2 MB: milliseconds, once)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


class CostStore:
    """Costs in one folder, each file named by its key and the code's versions."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.versions = code_versions()

    def _identity(self, key: tuple[Any, ...]) -> tuple[str, str]:
        text = json.dumps(list(key), default=str)
        ident = json.dumps({"format": COST_FORMAT, "key": text, "versions": self.versions})
        return text, hashlib.sha256(ident.encode()).hexdigest()

    def path(self, key: tuple[Any, ...]) -> Path:
        return self.folder / f"{self._identity(key)[1]}.json"

    def read(self, key: tuple[Any, ...]) -> CacheCost | None:
        """The cost stored for `key` by this code, or None (no file, or one in doubt,
        which is removed)."""
        text, digest = self._identity(key)
        path = self.folder / f"{digest}.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("cannot read the stored cache cost %s: %s", path, e)
            return None
        cost = _parse(raw, text, self.versions)
        if cost is None:
            logger.warning("stored cache cost %s does not match this checkpoint; removed", path)
            with contextlib.suppress(OSError):  # a file left behind is only read and refused again
                path.unlink(missing_ok=True)
        return cost

    def write(self, key: tuple[Any, ...], cost: CacheCost) -> None:
        """Store `cost` for `key` atomically; a folder that refuses is logged, not raised."""
        text, digest = self._identity(key)
        path = self.folder / f"{digest}.json"
        body = {
            "format": COST_FORMAT,
            "key": text,
            "versions": self.versions,
            "fixed_bytes": cost.fixed_bytes,
            "bytes_per_token": cost.bytes_per_token,
        }
        temp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(temp, "w", encoding="utf-8") as f:
                json.dump(body, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except OSError as e:
            with contextlib.suppress(OSError):  # it may never have been made
                temp.unlink(missing_ok=True)
            logger.warning("cannot store the measured cache cost in %s: %s", self.folder, e)


def _parse(raw: bytes, key: str, versions: dict[str, str]) -> CacheCost | None:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    if (body.get("format"), body.get("key"), body.get("versions")) != (COST_FORMAT, key, versions):
        return None
    fixed, per_token = body.get("fixed_bytes"), body.get("bytes_per_token")
    if type(fixed) is not int or fixed < 0:
        return None
    if not isinstance(per_token, int | float) or isinstance(per_token, bool):
        return None
    if not math.isfinite(per_token) or per_token < 0:
        return None
    return CacheCost(fixed, float(per_token))
