"""What a new request must satisfy before a scheduler queues it: checked once, up front, so a
request that could never run is refused with a ValueError naming the problem instead of
waiting forever (or failing later, after it holds blocks)."""

from __future__ import annotations

from jaxpaged.config import SchedulerConfig
from jaxpaged.sched.request import Request, RequestStatus

__all__ = ["check_new_request"]


def check_new_request(
    request: Request, config: SchedulerConfig, *, block_size: int, num_blocks: int, lora: bool
) -> int:
    """ValueError unless ``request`` is fresh, its prompt fits ``max_model_len`` with room for
    one token, its priority is honoured by the policy, its adapter has LoRA on and it fits a
    pool of ``num_blocks`` even at its longest; returns its effective ``max_tokens``."""
    rid = request.request_id
    if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
        raise ValueError(f"request {rid!r} is not a fresh request")
    if request.lora_name is not None and not lora:
        raise ValueError("a LoRA adapter was asked for, but LoRA is not enabled")
    max_len = config.max_model_len
    n_prompt = request.num_prompt_tokens
    if n_prompt == 0:
        raise ValueError("prompt must not be empty")
    if n_prompt > max_len - 1:
        raise ValueError(
            f"prompt is {n_prompt} tokens long, more than max_model_len - 1 = {max_len - 1}"
        )
    sp = request.sampling_params
    if sp.priority and config.scheduling_policy != "priority":
        raise ValueError(
            f"priority {sp.priority} is only honoured with scheduling_policy 'priority' "
            "(--scheduling-policy priority); this engine serves first come first served"
        )
    if sp.max_tokens is not None and n_prompt + sp.max_tokens > max_len:
        raise ValueError(
            f"max_tokens ({sp.max_tokens}) + prompt length ({n_prompt}) exceeds "
            f"max_model_len ({max_len})"
        )
    max_tokens = sp.effective_max_tokens(n_prompt, max_len)
    # The last output token is never fed back, so its K/V is never stored.
    need = -(-(n_prompt + max_tokens - 1) // block_size)  # blocks, rounded up
    if need > num_blocks:
        raise ValueError(
            f"request {rid!r} needs up to {need} KV blocks (prompt {n_prompt} + "
            f"max_tokens {max_tokens} tokens, block_size {block_size}) but "
            f"the pool has {num_blocks}; lower max_tokens or enlarge the KV "
            "cache (num_kv_blocks / kv_cache_memory / gpu_memory_utilization)"
        )
    return max_tokens
