"""``python -m jaxpaged.convert MODEL OUT``: save a model's params as an Orbax model folder
(see :mod:`jaxpaged.distributed.orbax`), which ``LLM(model=OUT)`` restores into any mesh."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Sequence

from jaxpaged.distributed.orbax import MARKER, numpy_dtype, save_params
from jaxpaged.models.registry import load_config

_SKIP_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")


def convert(
    model: str | os.PathLike | None,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    progress: bool = True,
) -> str:
    """Load ``model`` (None = bundled, folder, hub id or .gguf) and write it to ``out`` as an
    Orbax model folder; returns ``out``. ``dtype`` None keeps the checkpoint's own dtype
    (``torch_dtype`` when it is float32/bfloat16/float16, else float32)."""
    from jaxpaged.models.loader import DTYPES, load_model
    from jaxpaged.models.resolve import resolve_model_folder

    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"OUT: {out!r} exists and is not empty; choose a new folder")
    folder = resolve_model_folder(model)
    config = load_config(folder)
    if dtype is None:
        dtype = config.torch_dtype if config.torch_dtype in DTYPES else "float32"
    numpy_dtype(dtype)
    _, params = load_model(folder, dtype=dtype, progress=progress)
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        src = os.path.join(folder, name)
        if os.path.isfile(src) and not name.endswith(_SKIP_SUFFIXES) and name != MARKER:
            shutil.copy2(src, os.path.join(out, name))
    save_params(params, out, dtype=dtype, source=str(folder))
    return out


def main(argv: Sequence[str] | None = None, prog: str = "python -m jaxpaged.convert") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Save a model's params as an Orbax checkpoint folder that LLM(model=OUT) "
        "and `python -m jaxpaged.serve --model OUT` restore directly into any mesh layout.",
    )
    parser.add_argument(
        "model",
        help="model folder, hub id, .gguf file, or 'bundled' for the bundled SmolLM2",
    )
    parser.add_argument("out", help="output folder (must not exist or be empty)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype to store (default: the checkpoint's own)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = convert(None if args.model == "bundled" else args.model, args.out, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
