"""``hf_overrides`` (vLLM's ``--hf-overrides``): config.json keys replaced at load time.
jaxpaged accepts the ones that turn a decoder's ``*ForCausalLM`` checkpoint into a
classifier scoring with vocabulary rows, as vLLM runs the original Qwen3-Reranker::

    {"architectures": ["Qwen3ForSequenceClassification"],
     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}

The classifier's head is made of the rows of the language-model head for those tokens:
``method`` "from_2_way_softmax" (what ``is_original_qwen3_reranker`` implies; two tokens)
gives one label, the second token's row less the first's, so its sigmoid is the softmax
probability of the second token against the first; "no_post_processing" keeps one label
per token. Any other key is refused by name. Imports nothing of jaxpaged's."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["HF_OVERRIDE_KEYS", "TokenClassifier", "apply_hf_overrides", "parse_hf_overrides"]

HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker",
                    "method")  # fmt: skip
METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenClassifier:
    """A classifier whose head is the LM head's rows of ``tokens`` (see the module)."""

    tokens: tuple[str, ...]
    method: str = "from_2_way_softmax"

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.tokens)


def parse_hf_overrides(value: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """The overrides as a dict (from a dict or its JSON text); ValueError naming an unknown
    key or a bad value."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides: not valid JSON ({e})") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"hf_overrides must be a JSON object (a dict), got {value!r}")
    unknown = sorted(k for k in value if k not in HF_OVERRIDE_KEYS)
    if unknown:
        raise ValueError(
            f"hf_overrides: unsupported key(s) {', '.join(map(repr, unknown))}; jaxpaged "
            f"accepts {', '.join(HF_OVERRIDE_KEYS)}"
        )
    out = dict(value)
    archs = out.get("architectures")
    if archs is not None and (
        not isinstance(archs, list | tuple)
        or len(archs) != 1
        or not isinstance(archs[0], str)
        or not archs[0].endswith("ForSequenceClassification")
    ):
        raise ValueError(
            "hf_overrides: architectures must be one *ForSequenceClassification name, got "
            f"{archs!r}"
        )
    token_classifier(out)  # checks the classifier keys
    return out


def token_classifier(overrides: Mapping[str, Any] | None) -> TokenClassifier | None:
    """The vocabulary-row classifier the overrides ask for (None: none); ValueError for
    classifier keys without a ``*ForSequenceClassification`` architecture or bad values."""
    if not overrides:
        return None
    original = overrides.get("is_original_qwen3_reranker", False)
    tokens = overrides.get("classifier_from_token")
    method = overrides.get("method")
    if not isinstance(original, bool):
        raise ValueError(
            f"hf_overrides: is_original_qwen3_reranker must be a bool, got {original!r}"
        )
    if tokens is None and not original and method is None:
        return None
    if not overrides.get("architectures"):
        raise ValueError(
            "hf_overrides: classifier_from_token, method and is_original_qwen3_reranker need "
            'architectures (e.g. ["Qwen3ForSequenceClassification"])'
        )
    if original:
        if method not in (None, "from_2_way_softmax"):
            raise ValueError(
                f"hf_overrides: is_original_qwen3_reranker scores with from_2_way_softmax, "
                f"not method {method!r}"
            )
        method = "from_2_way_softmax"
        tokens = ["no", "yes"] if tokens is None else tokens
    method = method or (
        "from_2_way_softmax" if tokens is not None and len(tokens) == 2 else "no_post_processing"
    )
    if method not in METHODS:
        raise ValueError(f"hf_overrides: method {method!r} is not one of {', '.join(METHODS)}")
    if (
        not isinstance(tokens, list | tuple)
        or not tokens
        or not all(isinstance(t, str) and t for t in tokens)
    ):
        raise ValueError(
            f"hf_overrides: classifier_from_token must be a list of token strings, got {tokens!r}"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            f"hf_overrides: from_2_way_softmax needs two tokens (false, true), got {tokens!r}"
        )
    return TokenClassifier(tokens=tuple(tokens), method=method)


def apply_hf_overrides(
    config: Mapping[str, Any], overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """config.json with the overrides' keys replaced (a copy)."""
    return {**config, **(overrides or {})}
