"""EngineArgs: every engine setting, defined once.

``LLM(**kwargs)``, ``jaxpaged.generate(**kwargs)``, ``LLMEngine.from_args`` / ``from_params``
and the engine flags of ``python -m jaxpaged.serve`` all derive from the fields below: each
field carries its default, its help text and its command-line form, so a setting is added
(or renamed) in one place. Values are checked where they are used: the configs built here
(:class:`CacheConfig`, :class:`SchedulerConfig`, :class:`ParallelConfig`) raise ValueError
naming the field. An unknown keyword is a ValueError naming it and its close matches.

Settings of the process rather than the engine stay with the ``serve`` command: the server's
address and limits, and the multi-host flags (``jax.distributed`` must start before any engine
exists, and the engine learns the process count from JAX). Two fields do reach beyond the
engine, and only when asked: ``configure_process`` (environment variables, malloc) and
``compile_cache_dir`` (``jax.config``). They are off for ``LLM``, ``jaxpaged.generate`` and
``LLMEngine``; commands that own their process turn them on (``add_cli_args(defaults=...)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from jaxpaged.arg_fields import CliForm, add_field_args, setting, unknown_message
from jaxpaged.arg_values import (
    fraction,
    image_limit,
    is_int,
    non_negative_float,
    normalise_size,
    optional_text,
    parse_gib,
    parse_size,
    positive_float,
    positive_int,
    speculative_json,
    stall_ratio,
)
from jaxpaged.config import (
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    CacheConfig,
    LoraConfig,
    MultiModalConfig,
    ParallelConfig,
    ProcessConfig,
    SchedulerConfig,
)
from jaxpaged.hf_overrides import parse_hf_overrides
from jaxpaged.models.config import ModelConfig
from jaxpaged.spec.config import SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "CHECKPOINT_QUANTIZATIONS",
    "QUANTIZATIONS",
    "CliForm",
    "EngineArgs",
    "fraction",
    "non_negative_float",
    "optional_text",
    "parse_gib",
    "parse_size",
    "positive_int",
]

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# jaxpaged.models.quant.QUANTIZATIONS (not imported here: this module stays free of JAX)
QUANTIZATIONS: tuple[str, ...] = ("int8", "fp8", "gguf", "none")
# jaxpaged.models.quant.checkpoint.CHECKPOINT_FORMATS: pre-quantized formats, valid only for
# checkpoints in that format (which are read as stored even when quantization is unset)
CHECKPOINT_QUANTIZATIONS: tuple[str, ...] = ("compressed-tensors", "awq", "gptq")
# the runners a model may run (jaxpaged.engine.pooling: "auto" reads the checkpoint)
RUNNERS: tuple[str, ...] = ("auto", "generate", "pooling")
# jaxpaged.models.loader.TOKENIZER_MODES
TOKENIZER_MODES: tuple[str, ...] = ("auto", "tokenizers")
# jaxpaged.kernels.BACKENDS (not imported here: this module stays free of JAX; a test compares)
ATTENTION_BACKENDS: tuple[str, ...] = ("reference", "xla", "pallas", "cpu", "tpu")


# A step with decodes and a prompt chunk takes at most this many decode steps' time (the cap
# measured at warm-up, jaxpaged.engine.prefill_budget). Measured under `vllm bench serve` (16
# in flight, 256-token prompts): see bench/RESULTS.md.
DEFAULT_PREFILL_STALL_RATIO = 3.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Everything that configures an engine (vLLM's names and meanings)."""

    model: str | os.PathLike[str] | None = setting(
        None,
        "HF hub id (REPO:FILE.gguf for one GGUF of a hub repo), local folder, Orbax folder or "
        ".gguf file (default: bundled SmolLM2); positional or --model",
        "model",
        "--model",
        metavar="MODEL",
    )
    revision: str | None = setting(
        None,
        "hub branch, tag or commit of MODEL (default: main)",
        "--revision",
        parse=optional_text,
    )
    download_dir: str | os.PathLike[str] | None = setting(
        None,
        "folder to download hub models into (default: the Hugging Face cache, $HF_HUB_CACHE "
        "or $HF_HOME/hub or ~/.cache/huggingface/hub)",
        "--download-dir",
        parse=optional_text,
        metavar="DIR",
    )
    dtype: str | None = setting(
        None,
        "weights and KV cache dtype of a loaded model; auto/unset: float32 on CPU, else the "
        "checkpoint's half dtype (or bfloat16)",
        "--dtype",
        choices=DTYPES,
    )
    tokenizer_mode: str = setting(
        "auto",
        "auto: transformers' tokenizer of the model; tokenizers: its tokenizer.json through "
        "the tokenizers library and its chat template through jinja2, without importing "
        "transformers (the terminal commands' faster start; a folder without tokenizer.json "
        "or with a model-specific tokenizer class still gets transformers')",
        "--tokenizer-mode",
        choices=TOKENIZER_MODES,
    )
    quantization: str | None = setting(
        None,
        "weight-only quantization: int8 or fp8 (e4m3) values with one float32 scale per "
        "output channel, applied at load and dequantized inside each matmul; gguf: a GGUF "
        "model's own quantized weights (4- or 8-bit groups; unset: what the checkpoint holds, "
        "so gguf for a GGUF model unless --dtype is given); none: float weights (a GGUF "
        "model's float expansion); compressed-tensors, awq, gptq: a pre-quantized "
        "checkpoint's format, read as stored (unset reads it so too)",
        "-q",
        "--quantization",
        choices=QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS,
    )
    runner: str = setting(
        "auto",
        "what the model runs: generate (text generation, the paged engine) or pooling "
        "(embeddings, scores and reranks of an encoder: BERT, RoBERTa, XLM-R); auto: what "
        "the checkpoint's architecture declares",
        "--runner",
        choices=RUNNERS,
    )
    hf_overrides: dict[str, Any] | str | None = setting(
        None,
        "config.json keys replaced at load time, vLLM's JSON (jaxpaged.hf_overrides): the "
        'original Qwen3-Reranker as {"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}',
        "--hf-overrides",
        parse=str,
        metavar="JSON",
    )
    tensor_parallel_size: int = setting(
        1,
        "devices the weights and KV pool are split over (all hosts together)",
        "-tp",
        "--tensor-parallel-size",
        parse=positive_int,
    )
    data_parallel_size: int = setting(
        1,
        "engine replicas behind one server, each on its own tensor_parallel_size devices "
        "(its own process); requests go to the least-loaded replica, keeping a prompt "
        "prefix on the replica that served it while that one is not overloaded",
        "-dp",
        "--data-parallel-size",
        parse=positive_int,
    )
    data_parallel_health_check_period: float = setting(
        10.0,
        "seconds within which a data-parallel replica that stopped answering the server's "
        "health probes (hung) stops receiving requests, fails its open ones and is killed "
        "and restarted (a replica that exits is seen at once and restarted too)",
        "--data-parallel-health-check-period",
        parse=positive_float,
    )
    data_parallel_max_restarts: int = setting(
        3,
        "restarts a data-parallel replica gets within 10 minutes; one that dies again is "
        "given up (logged; /health names it; with none left the server is NOT_SERVING)",
        "--data-parallel-max-restarts",
        parse=int,
    )
    max_model_len: int | None = setting(
        None,
        "most tokens (prompt + output) of one request (default: the model's context length)",
        "--max-model-len",
        parse=positive_int,
    )
    max_num_seqs: int = setting(
        64,
        "most requests running at once (sequences in one step)",
        "--max-num-seqs",
        parse=positive_int,
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "token budget of one step, prefill chunks plus decodes (default: "
        "max(512, min(2048, max_num_seqs)))",
        "--max-num-batched-tokens",
        parse=positive_int,
    )
    max_prefill_tokens_with_decodes: int | None = setting(
        None,
        "most prefill tokens in a step that also carries decodes, so a new prompt does not "
        "stall the running requests (default: measured at warm-up, see "
        "--prefill-stall-ratio; max_num_batched_tokens turns the cap off)",
        "--max-prefill-tokens-with-decodes",
        parse=positive_int,
    )
    prefill_stall_ratio: float = setting(
        DEFAULT_PREFILL_STALL_RATIO,
        "without --max-prefill-tokens-with-decodes: the engine times a decode step and one "
        "with a prompt chunk at warm-up and caps the prefill tokens of a step with decodes so "
        "that it takes at most this many decode steps' time (the inter-token latency's tail)",
        "--prefill-stall-ratio",
        parse=stall_ratio,
    )
    fit_prefill_to_buckets: bool = setting(
        False,
        "in a step with decodes, lower the prefill cap to end the step on a compiled size "
        "(shorter mixed steps: a lower inter-token latency tail, a slower prefill)",
        "--fit-prefill-to-buckets",
    )
    block_size: int = setting(16, "tokens per KV cache block", "--block-size", parse=positive_int)
    gpu_memory_utilization: float = setting(
        0.9,
        "share of accelerator memory for weights, activations and the KV pool",
        "--gpu-memory-utilization",
        parse=fraction,
    )
    kv_cache_memory: int | str | None = setting(
        None,
        "bytes for the KV cache (CPU), a number or a size such as 2GiB",
        "--kv-cache-memory",
        parse=parse_size,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype: auto (the model's), bfloat16, or 8-bit fp8 (e4m3) / int8 with a "
        "float32 scale per token and KV head (about 1.9x the tokens of bfloat16 in the same "
        "memory)",
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
    )
    num_kv_blocks: int | None = setting(
        None,
        "exact KV block count (overrides memory sizing)",
        "--num-kv-blocks",
        parse=positive_int,
    )
    swap_space: float | str = setting(
        4.0,
        "host memory for the blocks of swapped-out requests: GiB, or a size such as 16GiB",
        "--swap-space",
        parse=parse_gib,
    )
    kv_offloading_size: float | str | None = setting(
        None,
        "host memory for a tier of the prefix cache: GiB, or a size such as 16GiB (unset: "
        "off); full blocks evicted from the device's prefix cache are kept there, least "
        "recently used out, and copied back when a later prompt starts with them",
        "--kv-offloading-size",
        parse=parse_gib,
    )
    kv_offloading_backend: str | None = setting(
        None,
        "where --kv-offloading-size keeps blocks: native (unset: native; this engine's host "
        "memory tier; other backends, such as lmcache, are refused by name)",
        "--kv-offloading-backend",
    )
    kv_offloading_disk_dir: str | None = setting(
        None,
        "a folder for a disk tier behind the host tier (--kv-offloading-size): blocks the "
        "host tier forgets are written there and read back on a prefix hit",
        "--kv-offloading-disk-dir",
        parse=optional_text,
        metavar="DIR",
    )
    kv_offloading_disk_size: float | str | None = setting(
        None,
        "how much of --kv-offloading-disk-dir the disk tier may fill: GiB, or a size such as 64GiB",
        "--kv-offloading-disk-size",
        parse=parse_gib,
    )
    preemption_mode: str = setting(
        "recompute",
        "what a preempted request's blocks become: freed and recomputed, or swapped to host",
        "--preemption-mode",
        choices=PREEMPTION_MODES,
    )
    scheduling_policy: str = setting(
        "fcfs",
        "the order requests are served in: first come first served, or by each request's "
        "priority (lower first; preemption takes the lowest priority first)",
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
    )
    enable_prefix_caching: bool = setting(
        True, "share the KV blocks of equal prompt prefixes", "--enable-prefix-caching"
    )
    enforce_eager: bool = setting(
        False, "skip warm-up; compile shapes on first use", "--enforce-eager"
    )
    attention_backend: str | None = setting(
        None,
        "paged-attention kernel (default: by platform)",
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
    )
    seed: int = setting(0, "seed of unseeded requests' sampling", "--seed", parse=int)
    show_progress: bool = setting(
        True, "progress bars while loading and warming up", "--show-progress"
    )
    configure_process: bool = setting(
        False,
        "process-wide settings, before JAX starts: XLA_PYTHON_CLIENT_PREALLOCATE=false and "
        "XLA_PYTHON_CLIENT_MEM_FRACTION=gpu_memory_utilization (so the KV pool gets the "
        "accelerator's memory) and, on a CPU-only JAX, glibc malloc tuning (off: the process "
        "is left as it is)",
        "--configure-process",
    )
    compile_cache_dir: str | os.PathLike[str] | None = setting(
        None,
        "folder of JAX's persistent compilation cache, set in jax.config for the whole "
        "process (unset, or '' on the command line: jax.config is left as it is)",
        "--compile-cache-dir",
        parse=optional_text,
        metavar="DIR",
    )
    program_cache_dir: str | os.PathLike[str] | None = setting(
        None,
        "folder where the engine keeps its compiled step programs whole, so a restart loads "
        "them without tracing (unset: off)",
        "--program-cache-dir",
        parse=optional_text,
        metavar="DIR",
    )
    huge_pages: bool = setting(
        True,
        "on a CPU, move the weights every step reads onto 2 MiB pages at load (Linux 6.1+; "
        "up to ~0.3 s once, ~1.8 ms less a batch-32 decode step)",
        "--huge-pages",
    )
    enable_lora: bool = setting(
        False,
        "serve LoRA adapters over the base model (Llama family): requests choose one by name",
        "--enable-lora",
    )
    max_loras: int = setting(
        1,
        "LoRA adapters on the device at once; requests of further adapters wait for a slot",
        "--max-loras",
        parse=positive_int,
    )
    max_lora_rank: int = setting(
        16, "the largest LoRA rank an adapter may have", "--max-lora-rank", parse=positive_int
    )
    lora_modules: tuple[str, ...] | dict[str, str] = setting(
        (),
        "LoRA adapters registered at start-up, as name=path (a PEFT folder: "
        "adapter_config.json + adapter_model.safetensors); Python: also a dict name -> path",
        "--lora-modules",
        metavar="NAME=PATH",
        nargs="+",
    )
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = setting(
        None,
        "speculative decoding, vLLM's keys as JSON, e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}' + " (ngram: drafts from the request's own text, verified "
        "in the same step; draft_model: a smaller model's drafts; eagle3: an EAGLE-3 head's, "
        "model its folder or hub id; greedy output unchanged, sampling keeps the model's "
        "distribution)",
        "--speculative-config",
        parse=speculative_json,
        metavar="JSON",
    )
    limit_mm_per_prompt: int | dict[str, int] | str = setting(
        4,
        'most images in one prompt of a vision-language model: N, or vLLM\'s JSON {"image": N}',
        "--limit-mm-per-prompt",
        parse=str,
        metavar="N|JSON",
    )
    encoder_cache_images: int = setting(
        16,
        "encoded images a vision-language model's encoder cache keeps beyond the most one "
        "step reads (a resent image is not encoded again)",
        "--encoder-cache-images",
        parse=int,
    )
    logits_processors: tuple[Any, ...] = setting(
        (),
        "jittable logits processors (jaxpaged.worker.logits_processors.LogitsProcessor) that "
        "requests may choose by name; Python only (no command-line form)",
    )

    def __post_init__(self) -> None:
        known = QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS
        if self.quantization is not None and self.quantization not in known:
            raise ValueError(
                f"quantization: {self.quantization!r} is not one of {', '.join(known)}"
            )
        # N, {"image": N} or either as text: kept as N
        object.__setattr__(self, "limit_mm_per_prompt", image_limit(self.limit_mm_per_prompt))
        if self.runner not in RUNNERS:
            raise ValueError(f"runner: {self.runner!r} is not one of {', '.join(RUNNERS)}")
        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        backend = self.attention_backend
        if backend is not None and backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
            )
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config)
        )
        # sizes may be given as text, as on the command line: LLM(swap_space="16GiB")
        object.__setattr__(
            self, "swap_space", normalise_size("swap_space", self.swap_space, parse_gib)
        )
        object.__setattr__(
            self,
            "kv_offloading_size",
            normalise_size("kv_offloading_size", self.kv_offloading_size, parse_gib),
        )
        object.__setattr__(
            self,
            "kv_offloading_disk_size",
            normalise_size("kv_offloading_disk_size", self.kv_offloading_disk_size, parse_gib),
        )
        object.__setattr__(
            self,
            "kv_cache_memory",
            normalise_size("kv_cache_memory", self.kv_cache_memory, parse_size),
        )

    # ------------------------------------------------------------ keywords
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keywords, with a ValueError (not a TypeError) for an unknown one:
        LLM(...) and jaxpaged.generate(...) pass their keywords through here."""
        names = cls.field_names()
        for key in kwargs:
            if key not in names:
                raise ValueError(unknown_message(key, names))
        return cls(**kwargs)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    # ------------------------------------------------------------ command line
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None
    ) -> argparse._ArgumentGroup:
        """Adds one argument per field to ``parser`` (in an "engine" group) and returns the
        group; :meth:`from_cli_args` reads them back. ``defaults`` replace fields' defaults on
        this command line (a command that owns its process configures it)."""
        defaults = dict(defaults or {})
        for key in defaults:
            if key not in cls.field_names():
                raise ValueError(unknown_message(key, cls.field_names()))
        group = parser.add_argument_group("engine")
        add_field_args(group, cls._cli_fields(), defaults)
        return group

    @classmethod
    def _cli_fields(cls) -> list[dataclasses.Field[Any]]:
        """The fields with a command-line form (not the Python-only ones)."""
        return [f for f in dataclasses.fields(cls) if f.metadata["cli"].flags]

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed with :meth:`add_cli_args`'s arguments (other
        attributes, e.g. the server's, are ignored)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in cls._cli_fields()})

    # ------------------------------------------------------------ configs
    @property
    def load_dtype(self) -> str | None:
        """The dtype to load weights in; None (also for "auto") leaves it to the loader."""
        return None if self.dtype == "auto" else self.dtype

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_offloading_size=self.kv_offloading_size,
            kv_offloading_backend=self.kv_offloading_backend,
            kv_offloading_disk_dir=self.kv_offloading_disk_dir,
            kv_offloading_disk_size=self.kv_offloading_disk_size,
        )

    def scheduler_config(self, model_config: ModelConfig) -> SchedulerConfig:
        """Per-step limits; unset ones derive from the model (max_model_len) and from
        max_num_seqs (the token budget: 512-2048, enough for one decode token per sequence)."""
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None and is_int(self.max_num_seqs):
            max_num_batched_tokens = max(512, min(2048, self.max_num_seqs))
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            max_prefill_tokens_with_decodes=self.max_prefill_tokens_with_decodes,
            prefill_stall_ratio=self.prefill_stall_ratio,
            fit_prefill_to_buckets=self.fit_prefill_to_buckets,
        )

    def mm_config(self) -> MultiModalConfig:
        return MultiModalConfig(
            limit_images_per_prompt=self.limit_mm_per_prompt,
            encoder_cache_images=self.encoder_cache_images,
        )

    def lora_config(self) -> LoraConfig:
        return LoraConfig(
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            modules=LoraConfig.parse_modules(self.lora_modules),
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            data_parallel_health_check_period=self.data_parallel_health_check_period,
            data_parallel_max_restarts=self.data_parallel_max_restarts,
        )

    def process_config(self) -> ProcessConfig:
        def folder(path: str | os.PathLike[str] | None) -> str | None:
            return os.fspath(path) if isinstance(path, os.PathLike) else path

        return ProcessConfig(
            configure_process=self.configure_process,
            compile_cache_dir=folder(self.compile_cache_dir),
            program_cache_dir=folder(self.program_cache_dir),
            huge_pages=self.huge_pages,
        )
