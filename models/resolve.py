"""What users may name as a model: nothing (the bundled SmolLM2), a local Hugging Face folder,
a hub id, a single .gguf file, or one GGUF file of a hub repo (``REPO:FILE.gguf`` or
``REPO:QUANT``); GGUF files are imported once into the jaxpaged cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def resolve_model_folder(
    model: str | os.PathLike | None,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
) -> str:
    """A local Hugging Face-format folder for ``model`` (see the module docstring);
    ``revision`` and ``download_dir`` apply to hub models."""
    from .bundled import default_model_path
    from .hub import hub_gguf_file, resolve_model_path, split_hub_gguf

    if model is None:
        return default_model_path()
    hub_gguf = split_hub_gguf(os.fspath(model))
    if hub_gguf is not None:
        repo_id, spec = hub_gguf
        path = hub_gguf_file(repo_id, spec, revision=revision, download_dir=download_dir)
        return _import_gguf(Path(path))
    path = Path(os.fspath(model)).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {os.fspath(model)!r} does not exist")
        return _import_gguf(path)
    return resolve_model_path(model, revision=revision, download_dir=download_dir)


def _import_gguf(path: Path) -> str:
    """The Hugging Face folder converted from ``path``, keyed on the file's identity."""
    from .bundled import CONVERTER_VERSION, cache_dir, convert_into_cache

    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERTER_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()
    return convert_into_cache(path, cache_dir() / f"gguf-{path.stem}-{key[:16]}")
