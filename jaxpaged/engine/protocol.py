"""What callers of an engine may rely on: the stats snapshot, the failure type, and the
``EngineClient`` protocol that the servers' front end talks to (the real ``AsyncEngine`` and
the test fakes both implement it, so neither can drift from the other)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ScoringRequestOutput,
)
from jaxpaged.sampling_params import SamplingParams

__all__ = [
    "PoolingClient",
    "EngineAsleepError",
    "EngineClient",
    "EngineDeadError",
    "EngineStats",
    "Prompt",
    "ReplicaStats",
    "Tokenizer",
]

# text, token ids, or a dict with images: {"prompt": text or "prompt_token_ids": ids,
# "multi_modal_data": {"image": PIL image or list}} (a vision-language model, engine/images.py)
Prompt = str | Sequence[int] | Mapping[str, Any]


class EngineDeadError(RuntimeError):
    """The engine failed while serving; no request can be served any more."""


class EngineAsleepError(RuntimeError):
    """A request reached an engine that is asleep (``sleep()``, its KV cache freed): call
    ``wake_up()`` first."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaStats:
    """One data-parallel replica's gauges, beside the sums of an EngineStats
    (jaxpaged.engine.data_parallel)."""

    alive: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    requests_total: int  # requests routed to it
    given_up: bool = False  # it died past its restart limit and stays dead


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for metrics endpoints and tests),
    taken by the engine thread after a step: reading it never waits for the device."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    kv_cache_waste: float  # mean over steps of 1 - stored tokens / slots of held blocks
    num_kv_blocks: int
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    num_compilations: int  # since the engine started, warm-up included
    num_compilations_after_warmup: int
    # speculative decoding (vLLM's vllm:spec_decode_* counters): verifications run, draft
    # tokens proposed, drafts accepted, and accepted drafts by position in the draft
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA adapter names (sorted) of the running and of the waiting (swapped included)
    # requests, and the device's adapter slots (0: LoRA off): vLLM's lora_requests_info
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0
    # data parallelism (--data-parallel-size): each replica's gauges, by rank (the fields
    # above are the replicas added up); empty for one engine
    replicas: tuple[ReplicaStats, ...] = ()
    # the prefix cache's host tier (kv_offloading_size): prompt tokens loaded back from it
    # (part of prefix_cache_hits), blocks and bytes copied device -> tier (stored) and tier
    # -> device (loaded), blocks it holds now and at most
    kv_offload_hits: int = 0
    kv_offload_blocks_stored: int = 0
    kv_offload_blocks_loaded: int = 0
    kv_offload_bytes_stored: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_num_blocks: int = 0
    kv_offload_capacity_blocks: int = 0
    # the disk tier behind it: blocks written there, and of the loaded ones those read back
    kv_offload_disk_blocks_stored: int = 0
    kv_offload_disk_blocks_loaded: int = 0
    # a vision model's encoder cache (vLLM's vllm:mm_cache_*: one query per distinct image a
    # step reads; the misses were encoded), slots taken back from an encoded image for
    # another, and the encoder's wall time in seconds
    mm_cache_queries: int = 0
    mm_cache_hits: int = 0
    mm_cache_evictions: int = 0
    mm_encoder_seconds: float = 0.0


class Tokenizer(Protocol):
    """What the servers use of a tokenizer (transformers' tokenizers fit)."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def apply_chat_template(self, conversation, **kwargs): ...  # noqa: ANN001, ANN003


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the servers (``jaxpaged.serving``) see it: every member they use, and
    nothing they may probe for. The real ``AsyncEngine`` and the test fakes implement all of
    it (tests check both member by member).

    Requests: ``add_request`` validates (ValueError naming the problem, a request id already
    in use included; EngineAsleepError while asleep) and returns the request's stream of
    outputs: deltas (``DELTA``: each output holds only what is new) or one final output
    (``FINAL_ONLY``). ``abort`` ends a request; its stream then ends with finish_reason
    "abort". If the engine dies, every open stream raises :class:`EngineDeadError` and
    ``dead_error`` is set.

    Admin: LoRA adapters by name (``lora_name`` on a request; ValueError for an unknown,
    taken or unfit adapter), sleep mode (RuntimeError while requests run or when the weights
    cannot come back), and new weights from a checkpoint path (ValueError / OSError for one
    that cannot be loaded; NotImplementedError from an engine that cannot load by path)."""

    # ---- what it serves
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def engine_config(self) -> Mapping[str, object]:
        """A flat summary of the engine's settings (server info endpoints); ``block_size``
        and ``dtype`` (the KV cache's) are always there."""
        ...

    # ---- health and life cycle
    @property
    def dead_error(self) -> BaseException | None: ...

    @property
    def errored(self) -> bool: ...

    def get_stats(self) -> EngineStats:
        """The latest per-step snapshot: never waits for the device and never raises (a
        dead engine answers with its last one)."""
        ...

    def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    # ---- requests
    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    # ---- LoRA adapters
    def list_loras(self) -> Mapping[str, str]:
        """Registered adapter name -> its folder (empty with LoRA off)."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registers an adapter; False if it was registered already."""
        ...

    async def remove_lora(self, name: str) -> None: ...

    # ---- sleep mode
    @property
    def is_sleeping(self) -> bool: ...

    async def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 2: the weights too); returns the bytes freed."""
        ...

    async def wake_up(self) -> None: ...

    # ---- weights
    async def update_weights_from(self, path: str) -> float:
        """Loads a checkpoint and swaps it in between steps; returns the load's seconds."""
        ...


@runtime_checkable
class PoolingClient(EngineClient, Protocol):
    """A pooling engine (embeddings, classification, scoring) as the servers see it: the
    EngineClient members (it refuses generation by name) and the pooling calls, each a batch
    of inputs answered in order (ValueError naming a bad input; EngineDeadError once the
    engine has failed). The servers tell the two apart with ``isinstance``."""

    @property
    def is_classifier(self) -> bool:
        """A cross-encoder (sequence classification head) rather than an embedder."""
        ...

    @property
    def class_labels(self) -> tuple[str, ...]:
        """A classifier's label per class (empty: none in the checkpoint)."""
        ...

    async def embed(
        self,
        prompts: Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]: ...

    async def classify(
        self, prompts: Sequence[Prompt], *, truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationRequestOutput]: ...

    async def score(
        self,
        text_1: Prompt | Sequence[Prompt],
        text_2: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]: ...
