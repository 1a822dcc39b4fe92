"""Offline generation: `python -m jaxpaged.generate [--model M] [--max-tokens N] [--temperature T]
[--chat] PROMPT` prints only the generated text on stdout (logs go to stderr).

For now one sequence at a time with a dense per-sequence KV cache written through the model's
`attention_fn`; the paged engine replaces this loop later.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxpaged.models import ModelConfig, compute_logits, forward, load_model
from jaxpaged.models.layers import grouped_attention
from jaxpaged.models.resolve import resolve_model_folder

log = logging.getLogger("jaxpaged.generate")


def _bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n, so prompt lengths share a few compiled shapes."""
    size = minimum
    while size < n:
        size *= 2
    return size


def init_dense_cache(config: ModelConfig, max_len: int, dtype: Any) -> dict[str, jax.Array]:
    """Zeroed K/V for one sequence: {"k", "v"}: [L, max_len, Hkv, hd]."""
    shape = (config.num_layers, max_len, config.num_kv_heads, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def dense_cache_attention(positions: jax.Array):  # positions: int32 [T]
    """An `attention_fn` that writes K/V at `positions` of a dense cache, then attends causally
    over it. Slots past a query's position are masked, so stale entries (e.g. from the padding
    of a prefill) are never read and get overwritten by later tokens."""

    def attend(q, k, v, layer, cache):  # q [T, Hq, hd], k/v [T, Hkv, hd]
        ck = cache["k"].at[layer, positions].set(k.astype(cache["k"].dtype))
        cv = cache["v"].at[layer, positions].set(v.astype(cache["v"].dtype))
        slots = jnp.arange(ck.shape[1], dtype=jnp.int32)
        mask = slots[None, :] <= positions[:, None]  # [T, S]
        out = grouped_attention(q, ck[layer], cv[layer], mask)
        return out, {"k": ck, "v": cv}

    return attend


@partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _step(params, tokens, positions, cache, last, key, temperature, *, config: ModelConfig):
    """Run T tokens (int32 [T] at positions [T]) and sample the token after row `last`."""
    hidden, cache = forward(
        params,
        tokens,
        positions,
        config=config,
        attention_fn=dense_cache_attention(positions),
        cache=cache,
    )
    logits = compute_logits(params, hidden[last][None], config=config)[0]  # [V]
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
    token = jnp.where(temperature > 0, sampled, jnp.argmax(logits))
    return token.astype(jnp.int32), cache


def generate_dense(
    params: Any,
    config: ModelConfig,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Generate up to `max_tokens` ids after `prompt_ids` (greedy when temperature == 0); stops
    after the first EOS id, which is included (as Hugging Face `generate` does)."""
    if not prompt_ids:
        raise ValueError("prompt_ids: empty prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    n = len(prompt_ids)
    padded = _bucket(n)
    cache = init_dense_cache(config, _bucket(max(padded, n + max_tokens)), params["embed"].dtype)
    tokens = jnp.asarray(list(prompt_ids) + [0] * (padded - n), dtype=jnp.int32)
    key = jax.random.key(seed)
    temp = jnp.float32(temperature)
    eos = set(eos_token_ids)

    key, sub = jax.random.split(key)
    token, cache = _step(
        params, tokens, jnp.arange(padded, dtype=jnp.int32), cache, n - 1, sub, temp, config=config
    )
    out = [int(token)]
    while len(out) < max_tokens and out[-1] not in eos:
        key, sub = jax.random.split(key)
        pos = jnp.full((1,), n + len(out) - 1, dtype=jnp.int32)
        token, cache = _step(params, token[None], pos, cache, 0, sub, temp, config=config)
        out.append(int(token))
    return out


def eos_ids_of(folder: str, config: ModelConfig) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (HF generate stops at either)."""
    ids = list(config.eos_token_ids)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(dict.fromkeys(ids))


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of `prompt`; with `chat`, wrapped as one user turn by the chat template."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxpaged.generate", description=__doc__)
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument(
        "--model",
        default=None,
        help="local folder, HF hub id or .gguf file (default: the bundled SmolLM2)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from transformers import AutoTokenizer

    folder = resolve_model_folder(args.model)
    log.info("loading %s", folder)
    config, params = load_model(folder, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    ids = generate_dense(
        params,
        config,
        prompt_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        eos_token_ids=eos_ids_of(folder, config),
    )
    sys.stdout.write(tokenizer.decode(ids, skip_special_tokens=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
