"""Hugging Face hub names -> local folders, through the HF cache.

`org/name` (optionally `org/name@revision`) is fetched with `huggingface_hub.snapshot_download`
into the usual cache (`HF_HOME`, `HF_HUB_CACHE`), so a name downloaded once works offline after:
with `HF_HUB_OFFLINE=1`, or with no network at all, the cached snapshot is used. A local folder
always wins over a hub name spelled the same. Only configs, safetensors weights and tokenizer
files are fetched, never code: nothing here (or anywhere in zerostack) sets `trust_remote_code`.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.errors import ModelError

# config.json, safetensors weights, tokenizer files (json, SentencePiece .model, BPE merges .txt)
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken")
TOKENIZER_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken")
_PICKLED_WEIGHTS = "*.bin"  # fetched only where a repository has no safetensors


def is_hub_name(spec: str | os.PathLike) -> bool:
    """Whether `spec` is spelled like a hub repository (`org/name`, `org/name@rev`) and is not a
    local path. Bare names (`gpt2`) are not taken: they would shadow typos of our presets."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    spec = os.fspath(spec)
    repo = spec.partition("@")[0]
    if repo.count("/") != 1 or spec.startswith((".", "/", "~")) or Path(spec).exists():
        return False
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return False
    return True


def resolve_pretrained(
    spec: str | os.PathLike, *, what: str = "--model", files: tuple[str, ...] = MODEL_FILES
) -> Path:
    """The local folder `spec` names: itself if it is a folder, else the cached snapshot of the
    hub repository `org/name[@revision]` (downloaded if the hub is reachable and it is not cached).

    what: how the caller names the value in an error (a flag such as --model).
    files: the glob patterns to fetch (MODEL_FILES or TOKENIZER_FILES).
    Raises ModelError with one line when it is neither a folder nor a name the cache or hub has.
    """
    spec = os.fspath(spec)
    if Path(spec).is_dir():
        return Path(spec)
    if not is_hub_name(spec):
        raise ModelError(f"{what} {spec}: no such folder (nor a hub name such as org/name)")
    repo, _, revision = spec.partition("@")
    folder = _snapshot(f"{what} {spec}", repo, revision or None, files)
    if files == MODEL_FILES and not any(folder.glob("*.safetensors")):
        # Older repositories ship pickled weights only (loaded with weights_only=True).
        folder = _snapshot(f"{what} {spec}", repo, revision or None, (*files, _PICKLED_WEIGHTS))
    return folder


def _snapshot(named: str, repo: str, revision: str | None, files: tuple[str, ...]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(files)))
    except GatedRepoError:
        why = "is gated on the hub: accept its terms there and log in (`hf auth login`)"
    except RepositoryNotFoundError:
        why = "is not on the hub (or is private: log in with `hf auth login`)"
    except RevisionNotFoundError:
        why = f"has no revision {revision!r} on the hub"
    except LocalEntryNotFoundError as e:
        reach = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub is unreachable"
        held = "only partly in" if "incomplete" in str(e) else "not in"  # an interrupted download
        why = f"is {held} the cache {constants.HF_HUB_CACHE} and {reach}"
    except (OSError, ValueError) as e:
        why = f"could not be fetched: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
    raise ModelError(f"{named}: not a local folder, and the hub repository {repo} {why}")
