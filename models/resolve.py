"""What users may name as a model: nothing (the bundled SmolLM2), a local Hugging Face folder,
a hub id, or a single .gguf file (imported once into the jaxpaged cache)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def resolve_model_folder(model: str | os.PathLike | None) -> str:
    """A local Hugging Face-format folder for ``model`` (see the module docstring)."""
    from .bundled import cache_dir, convert_into_cache, default_model_path
    from .hub import resolve_model_path

    if model is None:
        return default_model_path()
    path = Path(os.fspath(model)).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {os.fspath(model)!r} does not exist")
        stat = path.stat()
        key = hashlib.sha256(
            f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        ).hexdigest()[:16]
        return convert_into_cache(path, cache_dir() / f"gguf-{path.stem}-{key}")
    return resolve_model_path(model)
