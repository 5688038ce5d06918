"""Where a model argument points: a local directory, a GGUF file, or a Hugging Face id.

`mlxserve serve ORG/NAME[@REVISION]` is how users name models they copy
from Hugging Face. A directory of that name wins (a checkout next to the
server is what the user meant); otherwise `huggingface_hub` resolves the id
into its cache, downloading what is missing with its progress bar. It reads
its own environment: `HF_HOME` / `HF_HUB_CACHE` (where the cache is),
`HF_HUB_OFFLINE` (cache only) and `HF_TOKEN` (private and gated repos).
Only the files a load reads are fetched: weights, config and tokenizer,
never a repository's Python code (mlxserve runs no code from a checkpoint).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from mlxserve.models.loaded import ModelLoadError

logger = logging.getLogger(__name__)

# What a load reads: weights (sharded or not, with their index), config.json and
# generation_config.json, the tokenizer (HF fast, sentencepiece, tiktoken, BPE
# vocab/merges) and the chat template (in tokenizer_config.json or its own file).
ALLOW_PATTERNS = (
    "*.safetensors",
    "*.json",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
)

# ORG/NAME with an optional @REVISION (a branch, tag or commit), as the hub spells them.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) for an `ORG/NAME[@REVISION]`, else None."""
    match = _HUB_ID.match(spec)
    if match is None:
        return None
    return match["repo"], match["rev"]


def resolve_model(spec: str | Path, gguf_requantize: int | None = None) -> Path:
    """The local directory `spec` names: itself, a hub id's snapshot in the cache, or
    the conversion of a GGUF file (`spec` is one, or a folder holding one; see
    `models/gguf.py`; `gguf_requantize`: bits for tensor types MLX does not read).

    Raises ModelLoadError with the reason when none works.
    """
    from mlxserve.models.gguf import convert_gguf, find_gguf

    path = Path(spec).expanduser()
    gguf = find_gguf(path)
    if gguf is not None:
        return convert_gguf(gguf, gguf_requantize)
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        raise ModelLoadError(f"GGUF file {path} does not exist")
    hub_id = parse_hub_id(str(spec))
    if hub_id is None:
        raise ModelLoadError(
            f"model {str(spec)!r} is not a directory, nor a Hugging Face id (ORG/NAME[@REVISION])"
        )
    return download(*hub_id)


def download(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision`, fetched into the hub cache if needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo_id if revision is None else f"{repo_id}@{revision}"
    logger.info("resolving %s through the Hugging Face cache", name)
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS))
    except GatedRepoError as e:
        raise ModelLoadError(
            f"Hugging Face model {name} is gated: accept its terms on the hub and set HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelLoadError(
            f"Hugging Face has no model {repo_id} (or it is private: set HF_TOKEN), "
            f"and no directory of that name exists"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelLoadError(f"Hugging Face model {repo_id} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(_not_cached(name, e)) from e
    except (OSError, ValueError) as e:  # HTTP errors, a malformed id, a full disk
        raise ModelLoadError(f"cannot fetch Hugging Face model {name}: {e}") from e
    logger.info("%s is %s", name, folder)
    return Path(folder)


def _not_cached(name: str, error: Exception) -> str:
    from huggingface_hub import constants

    where = f"model {name} is neither a directory nor in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        return f"{where} ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set"
    return f"{where} ({constants.HF_HUB_CACHE}), and cannot be downloaded: {error}"
