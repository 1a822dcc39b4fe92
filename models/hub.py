"""Turn a model name into local files: an existing folder, or a Hugging Face hub repo downloaded
once into the hub cache by ``huggingface_hub`` (and found there, offline too, next time).

Environment, read at each call (``huggingface_hub`` reads its own copies only at import):
``HF_ENDPOINT`` (the hub's address), ``HF_HUB_CACHE`` / ``HF_HOME`` (the cache),
``HF_HUB_OFFLINE=1`` (cache only, no request) and ``HF_TOKEN`` (sent for gated and private
repos). Every failure becomes a :class:`ModelNotFoundError` that says what to do.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from collections.abc import Iterator

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
TOKEN_HINT = (
    "accept the model's terms on its hub page, then pass a token that may read it: "
    "`export HF_TOKEN=hf_...` (or `hf auth login`); with Docker, `-e HF_TOKEN`"
)


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


def split_hub_gguf(name: str) -> tuple[str, str] | None:
    """(repo id, file or quantization) of ``REPO:FILE.gguf`` or ``REPO:QUANT`` (e.g.
    ``Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M``), or None for any other name."""
    repo, sep, spec = name.partition(":")
    if not sep or not spec or not _REPO_ID.match(repo) or os.path.exists(name):
        return None
    return repo, spec


def resolve_model_path(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
) -> str:
    """Return a local folder for `name_or_path`.

    A path that exists is used as is. Anything that looks like a path (absolute, ./, ~, or not a
    valid repo id) must exist. Otherwise it is a hub repo id: `snapshot_download` fetches the
    config, safetensors and tokenizer files at ``revision`` into ``download_dir`` (default: the
    hub cache).
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
    folder = _download(name, list(HUB_ALLOW_PATTERNS), revision, download_dir)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelNotFoundError(
            f"model: hub repo {name!r} has no config.json (a GGUF-only repo? name one of its "
            f"files: {name}:FILE.gguf or {name}:Q4_K_M)"
        )
    return folder


def hub_gguf_file(
    repo_id: str,
    spec: str,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
) -> str:
    """The local path of one GGUF file of a hub repo: ``spec`` is its file name, or a
    quantization (``Q4_K_M``) that exactly one ``.gguf`` file's name contains."""
    name = f"{repo_id}:{spec}"
    pattern = spec if spec.endswith(".gguf") else f"*{spec}*.gguf"
    folder = _download(repo_id, [pattern, f"*/{pattern}"], revision, download_dir, label=name)
    found = sorted(
        os.path.relpath(os.path.join(root, f), folder)
        for root, _, files in os.walk(folder)
        for f in files
        if fnmatch.fnmatch(f.lower(), pattern.lower())
    )
    if len(found) != 1:
        what = "no .gguf file matches" if not found else f"{len(found)} files match ({found})"
        raise ModelNotFoundError(
            f"model: {name!r}: {what} {spec!r} in hub repo {repo_id!r}; name one file: "
            f"{repo_id}:FILE.gguf"
        )
    return os.path.join(folder, found[0])


@contextlib.contextmanager
def _hub_errors(
    name: str, revision: str | None, cache_dir: str | None, offline: bool
) -> Iterator[None]:
    """Turns huggingface_hub's exceptions into ModelNotFoundErrors that say what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    try:
        yield
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"model: hub repo {name!r} is gated and "
            f"{'the token sent may not read it' if _token() else 'no token was sent'}: "
            f"{TOKEN_HINT}"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(
            f"model: hub repo {name!r} has no revision {revision!r} (a branch, tag or commit)"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"model: {name!r} is not a local folder and not a hub repo you can access at "
            f"{endpoint} (check the id; for a private or gated repo, {TOKEN_HINT})"
        ) from e
    except LocalEntryNotFoundError as e:
        where = cache_dir or constants.HF_HUB_CACHE
        if offline:
            why = "offline mode (HF_HUB_OFFLINE=1) and it is not in the hub cache"
        else:
            why = f"the hub ({endpoint}) is unreachable and it is not in the hub cache"
        raise ModelNotFoundError(
            f"model: cannot get {name!r}: {why} {where!r}; download it where the hub is "
            "reachable (unset HF_HUB_OFFLINE) or pass a local folder"
        ) from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise ModelNotFoundError(
                f"model: the hub refused {name!r} (HTTP {status}): it is gated or private; "
                f"{TOKEN_HINT}"
            ) from e
        raise ModelNotFoundError(f"model: the hub failed for {name!r}: {e}") from e


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _download(
    repo_id: str,
    patterns: list[str],
    revision: str | None,
    download_dir: str | os.PathLike | None,
    *,
    label: str | None = None,
) -> str:
    """``snapshot_download`` of the files matching ``patterns``: a progress bar while it
    downloads, nothing but the cache when offline."""
    from huggingface_hub import constants, snapshot_download

    offline = _env_flag("HF_HUB_OFFLINE") or bool(constants.HF_HUB_OFFLINE)
    cache_dir = os.fspath(download_dir) if download_dir is not None else _hub_cache_dir()
    with _hub_errors(label or repo_id, revision, cache_dir, offline):
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            cache_dir=cache_dir,
            local_files_only=offline,
            token=_token(),
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
