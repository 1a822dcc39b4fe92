"""Named tensors of safetensors files, read without torch: the header parsed here, the
data memory-mapped, so bfloat16 and float8 need no conversion library."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class TensorError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape."""


# ---------------------------------------------------------------------------- safetensors


def _read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path!r} is not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsIndex:
    """Lazily read named tensors from one or more safetensors files (memory-mapped)."""

    def __init__(self, files: list[str]):
        self.files = files
        self._where: dict[str, tuple[str, dict[str, Any], int]] = {}
        for path in files:
            header, offset = _read_safetensors_header(path)
            for name, info in header.items():
                self._where[name] = (path, info, offset)
        self._maps: dict[str, np.memmap] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        path, info, offset = self._where[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise TensorError(f"tensor {name!r}: unsupported safetensors dtype {info['dtype']!r}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        buf = self._maps[path][offset + begin : offset + end]
        return buf.view(dtype).reshape(info["shape"])


def safetensors_files(folder: str) -> list[str]:
    """The weight files of a model folder: sharded via model.safetensors.index.json, or single."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {folder!r}")
    return [os.path.join(folder, n) for n in found]
