"""The draft side of an engine with a draft model (``speculative_config={"method":
"draft_model"}``: its platform, its KV pool (as many blocks as the target's, the two pools
sized together in one budget) and its runner, wrapped as the target runner's drafter,
:mod:`jaxpaged.worker.spec_draft`) or an EAGLE-3 head (``"eagle3"``: the checks it passes
before its K/V becomes one more layer of the target's pool, :mod:`jaxpaged.worker.spec_eagle`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.distributed.parallel import shard_params
from jaxpaged.engine.engine_setup import dtype_of
from jaxpaged.engine.kv_plan import KVPlan
from jaxpaged.engine.platform_choice import engine_platform
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.eagle3 import Eagle3Config
from jaxpaged.models.llama import FAMILY as LLAMA_FAMILY
from jaxpaged.models.registry import declared_family
from jaxpaged.spec import SpeculativeConfig
from jaxpaged.worker.kv_cache import kv_storage_dtype
from jaxpaged.worker.runner import Runner
from jaxpaged.worker.spec_draft import DraftModelProposer

__all__ = [
    "DraftModel",
    "check_draft",
    "check_eagle",
    "check_spec_inputs",
    "draft_beside",
    "head_params_in",
    "shared_num_blocks",
]


def check_spec_inputs(
    speculative_config: SpeculativeConfig | None,
    *,
    draft: tuple[ModelConfig, Any] | None,
    eagle: tuple[Eagle3Config, Any] | None,
) -> None:
    """ValueError unless a method's models come with it: a draft model's (config, params)
    with ``draft_model``, a head's with ``eagle3``, neither otherwise; one host only."""
    if speculative_config is not None and jax.process_count() > 1:
        raise ValueError("speculative_config: speculative decoding across hosts is not supported")
    method = None if speculative_config is None else speculative_config.method
    if (method == "draft_model") != (draft is not None):
        raise ValueError(
            "speculative_config: method 'draft_model' and the draft model's (config, params) "
            "come together (from_engine_args loads the draft from its model key)"
        )
    if (method == "eagle3") != (eagle is not None):
        raise ValueError(
            "speculative_config: method 'eagle3' and the head's (config, params) come "
            "together (from_engine_args loads the head from its model key)"
        )


def draft_beside(
    draft: tuple[ModelConfig, Any],
    target: ModelConfig,
    speculative_config: SpeculativeConfig,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    *,
    num_blocks: int,
    bytes_per_block: int,
    attention_backend: str | None,
    mesh: Any,  # noqa: ANN401 - the target's jax Mesh (tensor parallel) or None
    seed: int,
) -> tuple[int, int, DraftModelProposer]:
    """(blocks per pool, bytes a block of both pools holds, the drafter) for a draft model
    beside a target whose pool alone would get ``num_blocks`` of ``bytes_per_block``."""
    tp = 1 if mesh is None else mesh.size
    check_draft(draft[0], target, speculative_config, scheduler_config, tensor_parallel_size=tp)
    draft_model = DraftModel(
        *draft,
        cache_config=cache_config,
        attention_backend=attention_backend,
        params_dtype=str(dtype_of(draft[1])),
        mesh=mesh,
    )
    draft_bytes = draft_model.kv.layout(1).bytes_per_block
    num_blocks = shared_num_blocks(
        num_blocks, bytes_per_block, draft_bytes, cache_config.num_kv_blocks is not None
    )
    drafter = draft_model.proposer(num_blocks, scheduler_config, speculative_config, seed=seed)
    return num_blocks, bytes_per_block + draft_bytes, drafter  # a swapped block holds both


class DraftModel:
    """A loaded draft model and its KV plan, before the pool's size is known."""

    def __init__(
        self,
        model_config: ModelConfig,
        params: Any,  # noqa: ANN401 - the params pytree
        *,
        cache_config: CacheConfig,
        attention_backend: str | None,
        params_dtype: str,
        mesh: Any = None,  # noqa: ANN401 - the target's jax Mesh (tensor parallel) or None
    ) -> None:
        if mesh is not None:  # split like the target (loaded onto its shards: left there)
            model_config, params = shard_params(model_config, params, mesh)
        self.model_config = model_config
        self.params = params
        dtype = params_dtype
        kv_dtype = kv_storage_dtype(cache_config.kv_cache_dtype, dtype)
        self.platform = engine_platform(
            model_config,
            params,
            graphdef=None,
            params_dtype=dtype,
            kv_dtype=kv_dtype,
            block_size=cache_config.block_size,
            attention_backend=attention_backend,
            mesh=mesh,
        )
        self.mesh = mesh
        self.kv = KVPlan(
            model_config=model_config,
            block_size=cache_config.block_size,
            dtype=kv_dtype,
            platform=self.platform,
        )

    def proposer(
        self,
        num_blocks: int,
        scheduler_config: SchedulerConfig,
        speculative_config: SpeculativeConfig,
        *,
        seed: int,
    ) -> DraftModelProposer:
        """The drafter over a pool of ``num_blocks`` blocks (the target's count)."""
        k = speculative_config.num_speculative_tokens
        runner = Runner(
            model_config=self.model_config,
            params=self.params,
            layout=self.kv.layout(num_blocks),
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len,
            platform=self.platform,
            seed=seed,
            mesh=self.mesh,
            sampled_rows=scheduler_config.max_num_seqs * (k + 1),
        )
        return DraftModelProposer(
            runner, num_speculative_tokens=k, num_rows=scheduler_config.max_num_seqs
        )


def check_draft(
    draft: ModelConfig,
    target: ModelConfig,
    speculative_config: SpeculativeConfig,
    scheduler_config: SchedulerConfig,
    *,
    tensor_parallel_size: int,
) -> None:
    """ValueError for a draft model this engine cannot run beside ``target``. LoRA is not
    one: the draft drafts without adapters (its runner has no LoRA slots and is given no
    adapter loads; :mod:`jaxpaged.worker.spec_draft`), the target verifies with them."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) "
            f"is not the target's ({target.vocab_size}): a draft needs the same tokenizer"
        )
    tp = speculative_config.draft_tensor_parallel_size
    if tp is not None and tp != tensor_parallel_size:
        raise ValueError(
            f"speculative_config: draft_tensor_parallel_size ({tp}) must be the engine's "
            f"tensor_parallel_size ({tensor_parallel_size}): the draft model is split over "
            "the target's devices, as the target is"
        )
    limit = speculative_config.max_model_len
    if limit is not None and limit < scheduler_config.max_model_len:
        raise ValueError(
            f"speculative_config: max_model_len ({limit}) is below the engine's "
            f"({scheduler_config.max_model_len}): the draft must see every position"
        )


def shared_num_blocks(num_blocks: int, target_bytes: int, draft_bytes: int, given: bool) -> int:
    """Blocks per pool when the target's pool alone would get ``num_blocks`` of
    ``target_bytes``: the same memory split between both pools (a given count is kept)."""
    if given:
        return num_blocks
    return max(1, num_blocks * target_bytes // (target_bytes + draft_bytes))


def check_eagle(
    head: Eagle3Config,
    target: ModelConfig,
    *,
    tensor_parallel_size: int,
    own_model: bool,
) -> ModelConfig:
    """ValueError for an EAGLE-3 head this engine cannot run on ``target``; else the config
    the KV plan sizes the pool by (the target's layers and the head's one)."""
    if own_model or declared_family(target) is not LLAMA_FAMILY:
        raise ValueError(
            "speculative_config: method 'eagle3' needs a Llama-family target (its aux hidden "
            f"states), got model_type {target.model_type!r}"
        )
    c = head.layer
    n = tensor_parallel_size
    if n > 1 and (c.num_heads % n or c.num_kv_heads % n):
        # its weights are replicated; its attention runs per device on the pool's KV heads
        raise ValueError(
            f"speculative_config: an EAGLE-3 head's attention heads ({c.num_heads} query, "
            f"{c.num_kv_heads} KV) must divide by tensor_parallel_size ({n})"
        )
    if c.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the EAGLE-3 head's vocabulary ({c.vocab_size} tokens) is not "
            f"the target's ({target.vocab_size})"
        )
    if head.target_hidden_size != target.hidden_size:
        raise ValueError(
            f"speculative_config: the EAGLE-3 head reads hidden states of size "
            f"{head.target_hidden_size}, the target's are {target.hidden_size}"
        )
    if not head.own_embeddings and c.hidden_size != target.hidden_size:
        raise ValueError(
            "speculative_config: an EAGLE-3 head without embed_tokens shares the target's "
            f"embeddings, so its hidden size ({c.hidden_size}) must be the target's "
            f"({target.hidden_size})"
        )
    if (c.num_kv_heads, c.head_dim) != (target.num_kv_heads, target.head_dim):
        raise ValueError(
            "speculative_config: the EAGLE-3 head keeps its K/V as a layer of the target's "
            f"pool, so its KV heads x head_dim ({c.num_kv_heads} x {c.head_dim}) must be the "
            f"target's ({target.num_kv_heads} x {target.head_dim})"
        )
    head.aux_layers(target.num_layers)  # refuses ids outside the target
    return dataclasses.replace(target, num_layers=target.num_layers + 1)


def head_params_in(params: dict[str, Any], dtype: str) -> dict[str, Any]:
    """An EAGLE-3 head's float weights in the target's dtype (its K/V goes into the same
    pool, its hidden states meet the target's); ``d2t`` stays int32."""
    import jax.numpy as jnp

    return {
        k: v if not jnp.issubdtype(v.dtype, jnp.floating) else jnp.asarray(v, dtype)
        for k, v in params.items()
    }
