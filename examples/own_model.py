"""Bring your own model: a Flax NNX module of your own served by jaxpaged's paged engine.

The module follows the paged-model protocol (docs/models.md): a ``config`` (a jaxpaged
ModelConfig with model_type "custom": it sizes the KV pool) and a ``__call__(tokens,
positions, attention_fn, cache)`` in which every layer hands its q, k, v to
``attention_fn``; the engine passes its paged attention (KV pool writes plus ragged paged
attention), a dense forward passes ``dense_causal_attention``. The architecture here is not
one jaxpaged ships: parallel attention and MLP blocks (GPT-J style), LayerNorm, a
squared-ReLU MLP and rotary positions from jaxpaged's layers.

    python examples/own_model.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpaged
from jaxpaged import LLM, SamplingParams
from jaxpaged.models import ModelConfig, dense_causal_attention
from jaxpaged.models.layers import apply_rope
from jaxpaged.models.rope import rope_inv_freq


class ParallelBlock(nnx.Module):
    """x + attention(norm(x)) + mlp(norm(x)), one norm shared by both branches."""

    def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs) -> None:
        c = config
        d, hd = c.hidden_size, c.head_dim
        self.layer = layer  # a static int: which of the KV pool's layers this one writes
        self.config = c
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.q = nnx.Linear(d, c.num_heads * hd, rngs=rngs)
        self.kv = nnx.Linear(d, 2 * c.num_kv_heads * hd, rngs=rngs)
        self.out = nnx.Linear(c.num_heads * hd, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, c.intermediate_size, rngs=rngs)
        self.down = nnx.Linear(c.intermediate_size, d, rngs=rngs)

    def __call__(self, x, positions, attention_fn, cache):
        # x: [T, D], positions: int32 [T]
        c = self.config
        t = x.shape[0]
        h = self.norm(x)
        q = self.q(h).reshape(t, c.num_heads, c.head_dim)
        k, v = jnp.split(self.kv(h).reshape(t, 2 * c.num_kv_heads, c.head_dim), 2, axis=1)
        inv_freq = rope_inv_freq(c)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        attn, cache = attention_fn(q, k, v, self.layer, cache)  # [T, Hq, hd]
        mlp = self.down(jnp.square(jax.nn.relu(self.up(h))))
        return x + self.out(attn.reshape(t, -1)) + mlp, cache


class ParallelLM(nnx.Module):
    """A decoder of parallel blocks with tied embeddings: the whole paged-model protocol."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.blocks = nnx.List([ParallelBlock(config, i, rngs) for i in range(config.num_layers)])
        self.final_norm = nnx.LayerNorm(config.hidden_size, rngs=rngs)

    def __call__(self, tokens, positions, attention_fn=dense_causal_attention, cache=None):
        # tokens, positions: int32 [T] -> (hidden [T, D], cache)
        x = self.embed(tokens)
        for block in self.blocks:
            x, cache = block(x, positions, attention_fn, cache)
        return self.final_norm(x), cache

    def compute_logits(self, hidden):  # [S, D] -> float32 [S, V]
        return self.embed.attend(hidden).astype(jnp.float32)


def tiny_config() -> ModelConfig:
    return ModelConfig(
        model_type="custom",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )


def dense_greedy(
    model: ParallelLM, prompt: list[int], max_tokens: int, pad_to: int = 64
) -> list[int]:
    """The model's own greedy decoding: the whole sequence through a dense forward each step
    (padded at the end to one length, which causal attention never reads: one compilation)."""
    ids = list(prompt)
    forward = nnx.jit(lambda m, t, p: m.compute_logits(m(t, p)[0]))
    for _ in range(max_tokens):
        tokens = jnp.zeros(pad_to, jnp.int32).at[: len(ids)].set(jnp.asarray(ids, jnp.int32))
        logits = forward(model, tokens, jnp.arange(pad_to, dtype=jnp.int32))  # [pad_to, V]
        ids.append(int(jnp.argmax(logits[len(ids) - 1])))
    return ids[len(prompt) :]


def main() -> None:
    model = ParallelLM(tiny_config(), nnx.Rngs(0))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM.from_model(model, max_model_len=64, num_kv_blocks=64)
    served = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # the one-call form, for research code
    again = jaxpaged.generate(prompts, greedy, model=model, max_model_len=64, num_kv_blocks=64)
    for prompt, out, out2 in zip(prompts, served, again, strict=True):
        want = dense_greedy(model, prompt, 8)
        print(prompt, "->", list(out), "(dense:", want, ")")
        assert list(out) == want == list(out2.outputs[0].token_ids)
    print("paged engine == the module's own dense forward")


if __name__ == "__main__":
    main()
