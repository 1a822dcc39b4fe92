"""``speculative_config``: vLLM's keys, checked by name.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`` and
``jaxpaged serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``.
Keys (vLLM's): ``method``, ``num_speculative_tokens``, ``prompt_lookup_max``,
``prompt_lookup_min`` (n-gram), ``model``, ``quantization``, ``revision``,
``max_model_len``, ``draft_tensor_parallel_size`` (draft models), ``disable_by_batch_size``
(no drafting while more requests than this run). An unknown key, a bad
value or a combination this engine does not run is a ValueError naming it.

Methods this engine runs: ``ngram`` (prompt lookup, no extra model), ``draft_model`` (a
smaller model of the same tokenizer, or the target itself kept quantized: ``model`` its path,
``quantization`` / ``revision`` how to load it) and ``eagle3`` (an EAGLE-3 head: ``model``
its folder). ``eagle``, ``mtp`` and ``suffix`` are vLLM's names too; they are refused by
name until the engine runs them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["KNOWN_METHODS", "SUPPORTED_METHODS", "SpeculativeConfig"]

SUPPORTED_METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle3")
# refused with their own reason
_REFUSED = {
    "eagle": "EAGLE-1/2 heads (one layer over the last hidden state) are not supported; "
    "method 'eagle3' runs EAGLE-3 heads",
    "mtp": "MTP heads that ship with a model are not supported yet",
    "suffix": "suffix decoding is not supported yet",
}
KNOWN_METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix")
_DEFAULT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given
_MAX_SPECULATIVE_TOKENS = 16  # verification rows per sequence are compiled into every step


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """A validated speculative-decoding setting (see the module docstring)."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    quantization: str | None = None
    revision: str | None = None
    max_model_len: int | None = None
    draft_tensor_parallel_size: int | None = None
    # no drafts in a step while more requests than this run (where verification costs more
    # than it saves: large batches on compute-bound hardware); None: always draft
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in KNOWN_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not one of "
                f"{', '.join(KNOWN_METHODS)}"
            )
        if self.method in _REFUSED:
            raise ValueError(f"speculative_config: method {self.method!r}: {_REFUSED[self.method]}")
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported by this engine "
                f"yet (supported: {', '.join(SUPPORTED_METHODS)})"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= _MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config: num_speculative_tokens must be an int in "
                f"[1, {_MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        for name in (
            "prompt_lookup_max",
            "prompt_lookup_min",
            "max_model_len",
            "disable_by_batch_size",
        ):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {v!r}")
        if self.method == "ngram":
            for name in ("model", "quantization", "revision", "max_model_len"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"speculative_config: {name} belongs to a draft model; method 'ngram' "
                        "takes none"
                    )
            tp = self.draft_tensor_parallel_size
            if tp is not None and tp != 1:
                raise ValueError(
                    "speculative_config: draft_tensor_parallel_size applies to a draft model; "
                    f"method 'ngram' has none (got {tp!r})"
                )
            lo, hi = self.lookup_window
            if lo > hi:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({lo}) must not exceed "
                    f"prompt_lookup_max ({hi})"
                )

        if self.method in ("draft_model", "eagle3"):
            m = self.method
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config: method {m!r} needs model (a path)")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"speculative_config: {name} belongs to method 'ngram', not {m!r}"
                    )
            if m == "eagle3" and self.quantization is not None:
                raise ValueError(
                    "speculative_config: quantization is not supported for an EAGLE-3 head "
                    "(its float weights are kept in the target's dtype)"
                )
            tp = self.draft_tensor_parallel_size
            if m == "eagle3" and tp is not None and tp != 1:
                raise ValueError(
                    f"speculative_config: draft_tensor_parallel_size must be 1 for an EAGLE-3 "
                    f"head, got {tp!r}"
                )
            if tp is not None and (not _is_int(tp) or tp < 1):
                raise ValueError(
                    f"speculative_config: draft_tensor_parallel_size must be an int >= 1, "
                    f"got {tp!r}"
                )

    @property
    def lookup_window(self) -> tuple[int, int]:
        """(min, max) n-gram lengths, vLLM's rule: both unset are 5 and 5; one unset takes
        the other's value."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return _DEFAULT_LOOKUP, _DEFAULT_LOOKUP
        return (hi if lo is None else lo), (lo if hi is None else hi)

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig | None:
        """From a mapping of vLLM's keys, its JSON text, a SpeculativeConfig or None.
        ``method`` may be left out: ``model`` implies ``draft_model``, else ``ngram``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                "speculative_config must be a dict of vLLM's keys (or its JSON), got "
                f"{type(value).__name__}"
            )
        names = tuple(f.name for f in dataclasses.fields(cls))
        for key in value:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=2)
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"speculative_config: unknown key {key!r}{hint} (keys: {', '.join(names)})"
                )
        kwargs: dict[str, Any] = dict(value)
        if kwargs.get("method") is None:
            kwargs["method"] = "draft_model" if kwargs.get("model") else "ngram"
        return cls(**kwargs)
