"""Parsers of setting values (sizes with units, bounded numbers, the JSON forms of a few
settings): argparse ``type=`` functions that are also used on keyword arguments, each raising
an error that names what it expects."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxpaged.spec.config import SpeculativeConfig

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
GiB = 1 << 30


class SizeError(argparse.ArgumentTypeError, ValueError):
    """A malformed or out-of-range size: argparse reports it as a bad flag value, Python
    callers catch a ValueError."""


def _size_parts(text: str) -> tuple[float, str]:
    """(number, lower-case unit) of a size; ArgumentTypeError (a ValueError too) if it is none."""
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise SizeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 1000000)")
    return float(m.group(1)), m.group(2).lower()


def parse_size(text: str) -> int:
    """Bytes from '4294967296', '4GiB', '512MiB', '1.5G' (argparse type)."""
    number, unit = _size_parts(text)
    value = int(number * _UNITS[unit])
    if value <= 0:
        raise SizeError(f"size must be > 0, got {text!r}")
    return value


def parse_gib(text: str) -> float:
    """GiB from '4' or '0.5' (a bare number is GiB, vLLM's unit for swap_space) or from a size
    with its unit: '16GiB', '512MiB', '2G' (argparse type). Zero is allowed (no swap)."""
    number, unit = _size_parts(text)
    return number if unit == "" else number * _UNITS[unit] / GiB


def normalise_size(name: str, value: Any, parse: Callable[[str], Any]) -> Any:
    """A size given as text (``LLM(swap_space="16GiB")``) in the field's own unit; other
    values pass through unchanged for the configs to check."""
    if not isinstance(value, str):
        return value
    try:
        return parse(value)
    except SizeError as e:
        raise ValueError(f"{name}: {e}") from None


def positive_int(text: str) -> int:
    """An int >= 1 (argparse type)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _number(text: str, ok: Callable[[float], bool], requirement: str) -> float:
    """``text`` as a float that passes ``ok``, else an argparse error naming ``requirement``
    (NaN passes no comparison, so it is refused too)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"{requirement}, got {text}")
    return v


def non_negative_float(text: str) -> float:
    """A float >= 0 (argparse type)."""
    return _number(text, lambda v: v >= 0, "must be >= 0")


def positive_float(text: str) -> float:
    """A float > 0 (argparse type)."""
    return _number(text, lambda v: v > 0, "must be > 0")


def stall_ratio(text: str) -> float:
    """A float > 1 (argparse type)."""
    return _number(text, lambda v: v > 1, "must be > 1")


def optional_text(text: str) -> str | None:
    """The text, or None for an empty one (argparse type: '' turns the setting off)."""
    return text or None


def speculative_json(text: str) -> SpeculativeConfig | None:
    """A speculative_config from its JSON text, vLLM's keys (argparse type); '' = off."""
    if not text:
        return None
    try:
        return SpeculativeConfig.from_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fraction(text: str) -> float:
    """A float in (0, 1] (argparse type)."""
    return _number(text, lambda v: 0 < v <= 1, "must be in (0, 1]")


def image_limit(value: int | Mapping[str, int] | str) -> int:
    """The images-per-prompt limit of ``limit_mm_per_prompt``: an int, ``{"image": N}``,
    or either as text (the command line)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(
                f'limit_mm_per_prompt: {value!r} is neither N nor JSON {{"image": N}}'
            ) from None
    if isinstance(value, Mapping):
        if set(value) - {"image"}:
            raise ValueError(f"limit_mm_per_prompt: only 'image' is supported, got {sorted(value)}")
        value = value.get("image", 4)
    if not is_int(value) or value < 1:
        raise ValueError(
            f"limit_mm_per_prompt: images per prompt must be an int >= 1, got {value!r}"
        )
    return int(value)


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
