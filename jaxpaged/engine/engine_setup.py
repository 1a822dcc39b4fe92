"""What LLMEngine's construction reads and checks before an engine exists: a model loaded for
it (config, params on their shards, tokenizer, EOS ids), the models speculative decoding
names, a vision model's image setup, and the checks on settings and params in memory."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax

from jaxpaged.args import EngineArgs
from jaxpaged.config import MultiModalConfig, ParallelConfig, SchedulerConfig
from jaxpaged.engine.images import ImagePrompts, check_chunk_room
from jaxpaged.engine.patch_images import image_prompts, image_spec_for_folder
from jaxpaged.engine.process import configure_process
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.eagle3 import Eagle3Config, load_eagle3
from jaxpaged.models.hub import resolve_model_path
from jaxpaged.models.image_spec import ImageSpec
from jaxpaged.models.llama import Params
from jaxpaged.spec import SpeculativeConfig
from jaxpaged.worker.images import min_image_slots
from jaxpaged.worker.logits_processors import LogitsProcessor

logger = logging.getLogger(__name__)


def load_model(
    args: EngineArgs, parallel_config: ParallelConfig
) -> tuple[ModelConfig, Params, Any, tuple[int, ...]]:
    """(config, params, tokenizer, EOS ids) of ``args.model`` (None = the bundled SmolLM2;
    a folder, hub id or .gguf file), the weights sent straight to their shards."""
    from jaxpaged.distributed.loading import load_params
    from jaxpaged.distributed.parallel import make_mesh
    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.loader import load_eos_token_ids
    from jaxpaged.models.resolve import resolve_model_folder

    if args.configure_process:
        configure_process(args.gpu_memory_utilization)  # before the load starts JAX
    n = parallel_config.tensor_parallel_size
    mesh = make_mesh(n) if n > 1 else None
    folder = resolve_model_folder(
        args.model, revision=args.revision, download_dir=args.download_dir
    )
    # Orbax folders (jaxpaged.convert) are detected
    model_config, params = load_params(
        folder,
        mesh=mesh,
        dtype=args.load_dtype,
        progress=args.show_progress,
        quantization=args.quantization,
    )
    eos = load_eos_token_ids(folder, model_config)
    image = getattr(model_config, "image", None)
    if isinstance(image, ImageSpec):  # the processor's size, mean and std
        model_config = dataclasses.replace(model_config, image=image_spec_for_folder(image, folder))
    return model_config, params, load_tokenizer(folder, args.tokenizer_mode), eos


def model_for_engine(
    args: EngineArgs,
    parallel_config: ParallelConfig,
    *,
    model_config: ModelConfig | None,
    params: Params | None,
    tokenizer: Any,
    eos_token_ids: Sequence[int] | None,
    own_model: bool,
) -> tuple[ModelConfig, Params, Any, Sequence[int] | None]:
    """(config, params, tokenizer, EOS ids) an engine runs: ``args.model`` loaded when no
    params are given, else the params in memory checked against the settings (and quantized
    on the host when ``args.quantization`` asks)."""
    if params is not None:
        check_in_memory(args, model_config, params)
        if args.quantization is not None:  # quantized on the host, then placed as loaded
            from jaxpaged.models.quant import quantize_params

            params = quantize_params(jax.device_get(params), model_config, args.quantization)
        return model_config, params, tokenizer, eos_token_ids
    from jaxpaged.engine.runner_choice import choose_runner

    if choose_runner(args) != "generate":
        raise ValueError(
            f"model {args.model!r} is a pooling model (an encoder: embeddings and "
            "scores, no generation): use LLM(model, runner='pooling') and embed() / "
            "score(), or `jaxpaged serve` (its runner is chosen from the checkpoint)"
        )
    if model_config is not None or tokenizer is not None or eos_token_ids is not None or own_model:
        raise ValueError(
            "model_config, tokenizer and eos_token_ids come with params "
            "(without params, args.model is loaded with its own)"
        )
    return load_model(args, parallel_config)


def shard_for_tp(
    parallel_config: ParallelConfig, model_config: ModelConfig, params: Params, *, own_model: bool
) -> tuple[Any, ModelConfig, Params]:
    """(mesh, config, params) split over ``tensor_parallel_size`` devices; (None, as given)
    for one device."""
    if parallel_config.tensor_parallel_size == 1:
        return None, model_config, params
    from jaxpaged.distributed.parallel import make_mesh, shard_params

    if own_model:
        raise ValueError(
            "tensor_parallel_size > 1 is not supported for a model of your own "
            "(jaxpaged knows how to split only its own families' weights)"
        )
    mesh = make_mesh(parallel_config.tensor_parallel_size)
    return (mesh, *shard_params(model_config, params, mesh))


def check_in_memory(args: EngineArgs, model_config: ModelConfig | None, params: Params) -> None:
    """ValueError for settings that contradict params already in memory."""
    if model_config is None:
        raise ValueError("params need their model_config")
    if args.model is not None:
        raise ValueError(f"give either model ({args.model!r}) or params, not both")
    have = str(dtype_of(params))
    if args.load_dtype is not None and args.load_dtype != have:
        raise ValueError(
            f"dtype={args.dtype!r}, but the params given are {have}: dtype applies when "
            "loading a model (cast the params, or leave dtype unset)"
        )


def load_speculative_models(
    args: EngineArgs, parallel_config: ParallelConfig
) -> tuple[tuple[ModelConfig, Params] | None, tuple[Eagle3Config, Params] | None]:
    """(draft model's config and params, EAGLE-3 head's) that ``args.speculative_config``
    names: each None when its method is not the one configured. A draft model is split
    over the target's devices as the target is."""
    spec = args.speculative_config
    draft = eagle = None
    if spec is not None and spec.method == "draft_model":
        draft_args = dataclasses.replace(
            args,
            model=spec.model,
            quantization=spec.quantization,
            revision=spec.revision,
            speculative_config=None,
            configure_process=False,
        )
        draft = load_model(draft_args, parallel_config)[:2]
    if spec is not None and spec.method == "eagle3":
        folder = resolve_model_path(
            spec.model, revision=spec.revision, download_dir=args.download_dir
        )
        eagle = load_eagle3(folder)
    return draft, eagle


# On a CPU a step's time follows its rows, so verifying drafts for many sequences costs more
# than it saves: bench/speculative.py on the 2-core VM measured n-gram at 1.40x at batch 1 on
# copy-heavy work, 0.71x at 8 (0.67x on chat). Unless told otherwise, a CPU engine drafts only
# while this many requests run at most.
CPU_SPEC_MAX_BATCH = 1


def spec_defaults(config: SpeculativeConfig | None, device: str) -> SpeculativeConfig | None:
    """``disable_by_batch_size`` left unset on a CPU: :data:`CPU_SPEC_MAX_BATCH`."""
    if config is None or config.disable_by_batch_size is not None or device != "cpu":
        return config
    logger.info(
        "speculative decoding: drafting while at most %d request(s) run (CPU default; set "
        "disable_by_batch_size to change it)",
        CPU_SPEC_MAX_BATCH,
    )
    return dataclasses.replace(config, disable_by_batch_size=CPU_SPEC_MAX_BATCH)


def check_processors(processors: Sequence[LogitsProcessor]) -> tuple[LogitsProcessor, ...]:
    processors = tuple(processors)
    for p in processors:
        if not isinstance(p, LogitsProcessor):
            raise ValueError(f"logits_processors must hold LogitsProcessor objects, got {p!r}")
    names = [p.name for p in processors]
    if len(set(names)) != len(names):
        raise ValueError(f"logits_processors: names must be unique, got {names}")
    return processors


def image_setup(
    model_config: ModelConfig,
    mm: MultiModalConfig,
    scheduler: SchedulerConfig,
    speculative: SpeculativeConfig | None,
    parallel: ParallelConfig,
) -> tuple[ImagePrompts | None, int]:
    """A vision-language model's image prompts and encoder-cache slots ((None, 0): the
    model takes no images); ValueError for the features images do not run with yet."""
    spec = getattr(model_config, "image", None)
    if not isinstance(spec, ImageSpec):
        return None, 0
    for on, what in (
        (speculative is not None, "speculative decoding"),
        (parallel.tensor_parallel_size > 1, "tensor parallelism"),
        (jax.process_count() > 1, "several hosts"),
    ):
        if on:
            raise ValueError(f"{what} is not supported with a vision-language model yet")
    check_chunk_room(
        spec, scheduler.max_num_batched_tokens, scheduler.max_prefill_tokens_with_decodes
    )
    slots = min_image_slots(
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        tokens_per_image=spec.min_tokens_per_image,
        limit=mm.limit_images_per_prompt,
    )
    return image_prompts(spec, mm.limit_images_per_prompt), slots + mm.encoder_cache_images


def dtype_of(params: Params) -> Any:
    """The dtype of the model's floating-point state (its embedding for jaxpaged's own)."""
    embed = params.get("embed") if isinstance(params, dict) else None
    if hasattr(embed, "scales"):  # a quantized embedding (a GGUF model's): the norms' dtype
        embed = params.get("final_norm")
    if hasattr(embed, "dtype"):
        return embed.dtype
    leaves = jax.tree.leaves(params)
    floats = [x.dtype for x in leaves if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
    if not floats:
        raise ValueError("the model's state holds no floating-point arrays")
    return floats[0]


def check_one_replica(parallel_config: ParallelConfig) -> None:
    if parallel_config.data_parallel_size != 1:
        raise ValueError(
            f"data_parallel_size {parallel_config.data_parallel_size}: an LLMEngine is one "
            "replica; several run behind jaxpaged.engine.data_parallel.DataParallelClient "
            "(`jaxpaged serve --data-parallel-size N`, LLM(data_parallel_size=N))"
        )


def eos_ids(config: ModelConfig, tokenizer: Any, extra: Sequence[int] | None) -> tuple[int, ...]:
    ids = list(dict.fromkeys([*config.eos_token_ids, *(extra or ())]))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    return tuple(ids)
