"""Turn a model name into a local folder: an existing directory, or a Hugging Face hub id
downloaded (or found in the cache) with `huggingface_hub.snapshot_download`."""

from __future__ import annotations

import os
import re

# What a model folder needs: config, weights, tokenizer and chat template files.
HUB_ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.txt",
    "*.jinja",
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model is neither a local folder nor obtainable from the hub (also a ValueError, since
    it is a bad argument)."""


def _looks_like_path(name: str) -> bool:
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or os.sep in name.replace("/", "", 1)
        or not _REPO_ID.match(name)
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_cache_dir() -> str | None:
    """HF_HUB_CACHE, else HF_HOME/hub, read now (huggingface_hub reads them only at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Return a local folder for `name_or_path`.

    A path that exists is used as is. Anything that looks like a path (absolute, ./, ~, or not a
    valid repo id) must exist. Otherwise it is a hub repo id: `snapshot_download` fetches the
    config, safetensors and tokenizer files, honouring HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE
    (cache only) and HF_TOKEN.
    """
    name = os.fspath(name_or_path)
    if not name:
        raise ValueError("model: empty name; give a local folder or a Hugging Face hub id")
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return expanded
    if os.path.exists(expanded):
        raise ModelNotFoundError(f"model: {name!r} is a file, expected a model folder")
    if _looks_like_path(name):
        raise ModelNotFoundError(f"model: path {name!r} does not exist")
    return _snapshot(name)


def _snapshot(repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = _env_flag("HF_HUB_OFFLINE") or bool(constants.HF_HUB_OFFLINE)
    cache_dir = _hub_cache_dir()
    try:
        return snapshot_download(
            repo_id,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            cache_dir=cache_dir,
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"model: hub repo {repo_id!r} is gated; accept its licence and set HF_TOKEN ({e})"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"model: {repo_id!r} is not a local folder and not a hub repo you can access "
            "(set HF_TOKEN for private repos)"
        ) from e
    except LocalEntryNotFoundError as e:
        where = cache_dir or constants.HF_HUB_CACHE
        if offline:
            why = "offline mode (HF_HUB_OFFLINE=1) and it is not in the hub cache"
        else:
            why = "the hub is unreachable and it is not in the hub cache"
        raise ModelNotFoundError(
            f"model: cannot get {repo_id!r}: {why} {where!r}; download it where the hub is "
            "reachable (unset HF_HUB_OFFLINE) or pass a local folder"
        ) from e
