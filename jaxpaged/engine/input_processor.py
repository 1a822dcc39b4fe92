"""Admission, in the caller's thread: tokenize a request and check it against every bound the
step relies on, so that a request the engine cannot take is refused with a ValueError naming
the problem (HTTP 400 / INVALID_ARGUMENT in the servers) before it reaches the engine thread.

This is the one place a request is checked (the servers map its ValueError to their status
codes; they check only the shape of their own API), the request id included:
:func:`check_request_id` refuses an id that a front door (``LLMEngine``, ``AsyncEngine``)
still has in use. The bounds are defined once: the vocabulary and ``max_model_len`` (the model and the
scheduler), the KV pool's size in blocks (a request must fit the whole pool on its own),
``MAX_LOGPROBS`` and ``MAX_N`` (sampling_params, also the step's static sizes), and
``MAX_BANNED_IDS`` (the step's fixed-size list of ids that ``min_tokens`` holds back: EOS
and ``stop_token_ids``).
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping, Sequence
from typing import Any

from jaxpaged.engine.core import EngineRequest
from jaxpaged.engine.images import ImagePrompts, split_prompt
from jaxpaged.engine.protocol import Prompt
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import (
    MAX_BANNED_IDS,
    SamplingParams,
    banned_ids_for_min_tokens,
    validate_prompt,
)
from jaxpaged.worker.grammar import GrammarCompiler
from jaxpaged.worker.lora import LoraAdapters

__all__ = ["InputProcessor", "check_request_id"]


def check_request_id(request_id: object, in_use: Container[str] = ()) -> None:
    """ValueError unless ``request_id`` is a non-empty string that no unfinished request of
    the caller (``in_use``) has."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")


class InputProcessor:
    """Turns (request id, prompt, params) into a validated :class:`EngineRequest`."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_kv_blocks: int,
        eos_token_ids: Sequence[int],
        logits_processors: Sequence[str] = (),
        grammars: GrammarCompiler | None = None,
        lora: LoraAdapters | None = None,
        scheduling_policy: str = "fcfs",
        images: ImagePrompts | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images  # a vision-language model's image prompts (None: text only)
        self.scheduling_policy = scheduling_policy  # fcfs takes priority 0 only
        self.grammars = grammars
        self.lora = lora  # the registered adapters a request may name (None: LoRA off)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = tuple(eos_token_ids)
        self.logits_processors = tuple(logits_processors)  # their names

    def tokenize(
        self, prompt: Prompt, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or ids; text prompts get the tokenizer's
        special tokens (BOS where the model uses one) unless ``add_special_tokens`` is off."""
        if isinstance(prompt, str):
            if not prompt:  # before tokenizing: a tokenizer may add BOS to nothing
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            if not add_special_tokens:
                return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r}")
        return None, list(prompt)

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
        in_use: Container[str] = (),
    ) -> EngineRequest:
        """Validates everything (ValueError naming the field) and returns the request.
        ``lora_name``: a registered adapter it runs with; ``in_use``: the request ids the
        caller has unfinished."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_request_id(request_id, in_use)
        if lora_name is not None and (self.lora is None or lora_name not in self.lora.registered):
            raise ValueError(f"lora: adapter {lora_name!r} is not loaded")
        if not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
        text, ids, images = self.tokenize_with_images(prompt)
        validate_prompt(ids, self.max_model_len, self.vocab_size, params)
        self.check_params(params, len(ids))
        return EngineRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=tuple(int(t) for t in ids),
            params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            output_kind=output_kind,
            lora_name=lora_name,
            images=images,
        )

    def tokenize_with_images(self, prompt: Any) -> tuple[str | None, list[int], tuple]:
        """(text, token ids, ImageItems) of a prompt: text, token ids, or a dict with
        ``multi_modal_data`` (engine/images.py). A text prompt's image markers are expanded
        to the model's placeholders; a token-id prompt holds them expanded."""
        if not isinstance(prompt, Mapping):
            text, ids = self.tokenize(prompt)
            if self.images is not None:
                self.images.images(ids, [])  # placeholders with no image: refused
            return text, ids, ()
        body, images = split_prompt(prompt)
        special = bool(prompt.get("add_special_tokens", True))
        if self.images is None:
            if images:
                raise ValueError("multi_modal_data: this model takes no images")
            text, ids = self.tokenize(body, add_special_tokens=special)
            return text, ids, ()
        if isinstance(body, str):
            if not body:
                raise ValueError("prompt must not be empty")
            _, ids = self.tokenize(self.images.expand(body, images), add_special_tokens=special)
            text = body
        else:
            text, ids = self.tokenize(body)
        return text, ids, self.images.images(ids, images)

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """The bounds of the engine (not of SamplingParams alone) a request must fit."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (this engine has none)")
        if params.priority and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {params.priority} is only honoured with --scheduling-policy "
                "priority; this engine serves first come first served"
            )
        name = params.logits_processor
        if name is not None and name not in self.logits_processors:
            raise ValueError(
                f"logits_processor: {name!r} is not registered with this engine (registered: "
                f"{list(self.logits_processors)}; EngineArgs.logits_processors)"
            )
        if params.min_tokens > 0:
            banned = banned_ids_for_min_tokens(params, self.eos_token_ids)
            if len(banned) > MAX_BANNED_IDS:
                raise ValueError(
                    f"stop_token_ids: with min_tokens > 0 the engine holds back at most "
                    f"{MAX_BANNED_IDS} ids (EOS included unless ignore_eos), got {len(banned)}"
                )
        if params.structured_output is not None:
            if self.grammars is None:
                raise ValueError("structured_output needs a tokenizer (this engine has none)")
            self.grammars.grammar(params.structured_output)  # checked and cached
        for token, _ in params.logit_bias:
            if token >= self.vocab_size:
                raise ValueError(
                    f"logit_bias names token {token}, outside the vocabulary [0, {self.vocab_size})"
                )
        max_tokens = params.effective_max_tokens(num_prompt_tokens, self.max_model_len)
        # the last output token is never fed back, so its K/V is never stored
        need = -(-(num_prompt_tokens + max_tokens - 1) // self.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(
                f"max_tokens: the request needs up to {need} KV blocks (prompt "
                f"{num_prompt_tokens} + max_tokens {max_tokens} tokens, block_size "
                f"{self.block_size}) but the pool has {self.num_kv_blocks}; lower max_tokens "
                "or enlarge the KV cache (num_kv_blocks / kv_cache_memory / "
                "gpu_memory_utilization)"
            )
