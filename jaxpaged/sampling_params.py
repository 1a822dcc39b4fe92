"""SamplingParams: how one request is decoded, checked once when the request arrives.

Every bad value raises ``ValueError`` whose message starts with the field name, so a server
can turn it into a 400 naming the argument while the engine keeps serving other requests.
:func:`validate_prompt` checks a tokenized prompt against the model and the params
(empty, too long, prompt + max_tokens over max_model_len, ids outside the vocabulary).

Conventions (vLLM's): ``temperature == 0`` is greedy; ``top_k == -1``, ``top_p == 1``,
``min_p == 0`` and the neutral penalties switch their stage off; ``max_tokens=None`` means
"until max_model_len"; ``logprobs=k`` returns the sampled token's logprob plus the top k
(0 = sampled token only); ``prompt_logprobs=k`` returns the log-probability of every prompt
token after the first (raw model distribution) plus the top k at each position (such a
request's first sample computes its whole prompt: no prefix-cache hit); ``min_tokens`` bans EOS and ``stop_token_ids`` (and disables stop
checks) until that many tokens are out. ``stop`` strings are matched by the detokenizer.
``logit_bias`` (OpenAI's: token id -> bias in [-100, 100], added to the logits before
penalties and filters) is held in the step's fixed-size per-request state, hence bounded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

__all__ = [
    "MAX_BANNED_IDS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROCESSOR_ARGS",
    "SamplingParams",
    "StructuredOutput",
    "banned_ids_for_min_tokens",
    "validate_prompt",
]

MAX_N = 128  # most samples of one prompt (OpenAI's limit)
MAX_LOGPROBS = 20  # most top logprobs per token (OpenAI's limit; the step's static top-k)
# most ids min_tokens holds back (EOS + stop_token_ids): the step's fixed-size ban list
MAX_BANNED_IDS = 32
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_PROCESSOR_ARGS = 8  # per-request parameters of a logits processor (the step's fixed width)
MAX_LOGIT_BIAS = 300  # most logit_bias entries: the step's fixed-size per-request bias list
MAX_BIAS = 100.0  # |bias| (OpenAI's range)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_tuple(name: str, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}")
    items = tuple(value)
    for t in items:
        if not _is_int(t) or t < 0:
            raise ValueError(f"{name} must hold non-negative int token ids, got {t!r}")
    return items


def _str_tuple(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Sequence):
        raise ValueError(f"{name} must be a string or a sequence of strings, got {value!r}")
    items = tuple(items)
    for s in items:
        if not isinstance(s, str):
            raise ValueError(f"{name} must hold strings, got {s!r}")
        if not s:
            raise ValueError(f"{name} must not contain an empty string")
    return items


def _bias_tuple(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or a sequence of pairs."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = list(value)
    else:
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        token, bias = item
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        if not _is_finite(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ValueError(
                f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias!r} "
                f"for token {token}"
            )
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutput:
    """Constrains the output to a grammar (exactly one field set): a JSON schema (``json``,
    a dict or its JSON text), any JSON object (``json_object``), a regular expression, one of
    some strings (``choice``), or a Lark grammar (``grammar``, llguidance's dialect). Invalid
    grammars are refused when the request arrives (ValueError naming ``structured_output``).

    ``strict`` (JSON only, the default): an object schema that declares its properties takes
    no others unless it allows them (``additionalProperties``, ...), and the JSON is compact
    (no whitespace between tokens), as OpenAI's strict schemas and vLLM's default backend
    produce; ``strict=False`` is the permissive reading (extra properties, any whitespace)."""

    json: str | None = None  # also accepts a dict; stored as canonical JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # also accepts a list
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))  # keeps key order
        if self.choice is not None:
            object.__setattr__(self, "choice", _str_tuple("structured_output.choice", self.choice))
            if not self.choice:
                raise ValueError("structured_output.choice must hold at least one string")
        kinds = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(kinds) != 1:
            raise ValueError(
                "structured_output must set exactly one of json, json_object, regex, choice "
                f"or grammar, got {kinds or 'none'}"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_output.{name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_output.json_object must be a bool")
        if not isinstance(self.strict, bool):
            raise ValueError("structured_output.strict must be a bool")
        if not self.strict and kinds[0] not in ("json", "json_object"):
            raise ValueError(
                "structured_output.strict applies to json and json_object; "
                f"{kinds[0]} has no permissive reading"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request decoding settings (immutable; ``dataclasses.replace`` to derive)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # also accepts a str or a list; stored as a tuple
    stop_token_ids: tuple[int, ...] = ()  # also accepts a list
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # a logits processor registered with the engine (EngineArgs.logits_processors), by name,
    # and its parameters for this request (numbers; the processor says what they mean)
    logits_processor: str | None = None
    logits_processor_args: tuple[float, ...] = ()
    # token id -> bias; also accepts a dict; stored as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None  # also accepts a dict of its fields
    # the request's place in the queue under scheduling_policy="priority": lower first
    # (vLLM's request priority); 0 is the only value the fcfs policy takes
    priority: int = 0
    # False: this request never drafts (one token per step) on an engine with
    # speculative_config; requests whose settings speculation does not follow (penalties,
    # min_tokens, logit_bias, a logits processor, structured output) never draft either
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.structured_output, dict):
            object.__setattr__(
                self, "structured_output", StructuredOutput(**self.structured_output)
            )
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise ValueError(
                f"structured_output must be a StructuredOutput, got {self.structured_output!r}"
            )
        # Normalise the sequence fields first so the frozen instance is hashable.
        object.__setattr__(self, "stop", _str_tuple("stop", self.stop))
        object.__setattr__(
            self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids)
        )
        object.__setattr__(self, "logit_bias", _bias_tuple(self.logit_bias))
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}"
                )
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "speculative",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_logits_processor()

    def _check_logits_processor(self) -> None:
        name, args = self.logits_processor, self.logits_processor_args
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"logits_processor must be a non-empty string or None, got {name!r}")
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
            raise ValueError(f"logits_processor_args must be a sequence of numbers, got {args!r}")
        args = tuple(args)
        if any(not _is_finite(a) for a in args):
            raise ValueError(f"logits_processor_args must hold finite numbers, got {args!r}")
        if len(args) > MAX_PROCESSOR_ARGS:
            raise ValueError(
                f"logits_processor_args: at most {MAX_PROCESSOR_ARGS} values, got {len(args)}"
            )
        if args and name is None:
            raise ValueError("logits_processor_args given without a logits_processor")
        object.__setattr__(self, "logits_processor_args", tuple(float(a) for a in args))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def effective_max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """Output tokens this request may produce: max_tokens, capped by the context."""
        room = max_model_len - num_prompt_tokens
        return room if self.max_tokens is None else min(self.max_tokens, room)


def banned_ids_for_min_tokens(
    params: SamplingParams, eos_token_ids: Sequence[int]
) -> tuple[int, ...]:
    """The ids ``min_tokens`` holds back until it is reached: EOS (unless ``ignore_eos``) and
    ``stop_token_ids``, sorted. At most ``MAX_BANNED_IDS`` fit the step (checked at
    admission)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return tuple(sorted(ids))


def validate_prompt(
    prompt_token_ids: Sequence[int],
    max_model_len: int,
    vocab_size: int,
    params: SamplingParams | None = None,
) -> None:
    """Checks a tokenized prompt: not empty, at most max_model_len - 1 tokens (room for one
    output token), prompt + params.max_tokens within max_model_len, every id in the vocabulary.
    Raises ValueError naming ``prompt`` or ``max_tokens``."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt must not be empty")
    if n > max_model_len - 1:
        raise ValueError(
            f"prompt is {n} tokens long, more than max_model_len - 1 = {max_model_len - 1} "
            "(one position is needed for the output)"
        )
    if (
        params is not None
        and params.max_tokens is not None
        and n + params.max_tokens > (max_model_len)
    ):
        raise ValueError(
            f"max_tokens ({params.max_tokens}) + prompt length ({n}) = "
            f"{n + params.max_tokens} exceeds max_model_len ({max_model_len})"
        )
    for i, t in enumerate(prompt_token_ids):
        if not _is_int(t) and not (hasattr(t, "__index__") and not isinstance(t, bool)):
            raise ValueError(f"prompt token {i} is not an int: {t!r}")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(
                f"prompt token {i} has id {int(t)}, outside the vocabulary [0, {vocab_size})"
            )
