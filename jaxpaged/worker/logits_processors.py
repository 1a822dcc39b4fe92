"""Custom logits processors: research decoding rules that run inside the jitted step.

A :class:`LogitsProcessor` is a name and a jittable function
``fn(logits [B, V] float32, history: TokenHistory, args [B, A] float32) -> logits [B, V]``
over the whole batch. The engine is given its processors when it starts
(``EngineArgs.logits_processors``); a request picks one by name
(``SamplingParams.logits_processor``) with its own numbers (``logits_processor_args``, A =
``MAX_PROCESSOR_ARGS``, zero padded). Each processor is traced once into the step program; at
run time it runs only when some row of the batch chose it (``lax.cond``) and only those rows
take its output, so any mix of requests runs in the same compiled program.

Processors see the raw model logits of every row and return new ones; penalties, ``min_tokens``
bans, temperature and the top-k/top-p/min-p filters then apply as usual, and logprobs stay
those of the raw logits. ``history`` holds each row's tokens so far (prompt, then output).
The function sees every row of the batch, so a rule may mix rows (see
:func:`guidance_mix`); the rows that did not choose it have NaN ``args`` (and their output is
discarded).

Two processors ship as examples: :func:`no_repeat_ngram` and :func:`guidance_mix`.
This module imports nothing of jaxpaged's (the sampler passes its state in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "LogitsProcessor",
    "TokenHistory",
    "apply_logits_processors",
    "guidance_mix",
    "no_repeat_ngram",
]


class TokenHistory(NamedTuple):
    """Each batch row's tokens so far, gathered from the sampler's per-request state."""

    tokens: jax.Array  # int32 [B, H]: prompt then output tokens, -1 from num_tokens on
    num_tokens: jax.Array  # int32 [B]


ProcessorFn = Callable[[jax.Array, TokenHistory, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class LogitsProcessor:
    """A named, jittable batch rule over the logits (see the module docstring). Hashable: it
    is part of the step's static arguments, so it must be created once and reused."""

    name: str
    fn: ProcessorFn

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LogitsProcessor name must be a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise ValueError(f"LogitsProcessor {self.name!r}: fn must be callable")


def apply_logits_processors(
    logits: jax.Array,  # float32 [B, V]
    t: Any,  # noqa: ANN401 - sampler.SamplingTensors: processor [B], processor_args [B, A], state_rows [B]
    state: Any,  # noqa: ANN401 - sampler.SeqState: tokens [R, H], num_tokens [R]
    processors: tuple[LogitsProcessor, ...],
) -> jax.Array:  # float32 [B, V]
    """Each processor's output on the rows that chose it (inside the jitted step)."""
    r = state.num_tokens.shape[0]
    rows = jnp.clip(t.state_rows, 0, r - 1)
    has_row = t.state_rows >= 0
    for index, proc in enumerate(processors):
        chose = t.processor == index  # [B]

        def run(lg, proc=proc, chose=chose):
            history = TokenHistory(
                tokens=jnp.where(has_row[:, None], state.tokens[rows], -1),
                num_tokens=jnp.where(has_row, state.num_tokens[rows], 0),
            )
            args = jnp.where(chose[:, None], t.processor_args, jnp.nan)
            out = proc.fn(lg, history, args).astype(jnp.float32)
            return jnp.where(chose[:, None], out, lg)

        logits = lax.cond(jnp.any(chose), run, lambda lg: lg, logits)
    return logits


# ------------------------------------------------------------------------ examples
def no_repeat_ngram(max_n: int = 8, name: str = "no_repeat_ngram") -> LogitsProcessor:
    """Bans every token that would complete an n-gram already in the row's history (prompt
    and output), as transformers' ``no_repeat_ngram_size``. Args: ``(n,)`` with
    2 <= n <= ``max_n`` (static: the window compared per position); other n leave the row as
    it is."""

    def fn(logits: jax.Array, history: TokenHistory, args: jax.Array) -> jax.Array:
        tokens, length = history.tokens, history.num_tokens  # [B, H], [B]
        b, h = tokens.shape
        n = args[:, 0].astype(jnp.int32)  # [B]
        active = (n >= 2) & (n <= max_n)
        k = jnp.maximum(n - 1, 1)  # the prefix length to match
        pos = jnp.arange(h)[None, :]  # [1, H]: where an earlier n-gram starts
        # the row's last k tokens, compared with the k tokens at every start position
        match = pos + k[:, None] < length[:, None]  # the n-gram ends before the history does
        for i in range(max_n - 1):
            tail = jnp.take_along_axis(tokens, jnp.clip(length - k + i, 0, h - 1)[:, None], 1)
            here = jnp.take_along_axis(tokens, jnp.clip(pos + i, 0, h - 1), 1)
            match &= (i >= k[:, None]) | (here == tail)
        banned = jnp.take_along_axis(tokens, jnp.clip(pos + k[:, None], 0, h - 1), 1)  # [B, H]
        match &= active[:, None] & (length[:, None] >= k[:, None])
        cols = jnp.where(match, banned, logits.shape[1])  # out of range: dropped
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], cols.shape)
        return logits.at[rows, cols].set(-jnp.inf, mode="drop")

    return LogitsProcessor(name, fn)


def guidance_mix(name: str = "guidance") -> LogitsProcessor:
    """Classifier-free-guidance-style mixing of two requests decoded side by side. Args:
    ``(group, role, scale)``: requests of one ``group`` (any number) are a pair, ``role`` 1
    the conditional prompt and 0 the unconditional one. While both are in the batch, both rows
    get ``uncond + scale * (cond - uncond)`` over log-softmaxed logits, so with greedy (or the
    same seed) they pick the same token and their histories stay equal after the prompts. A
    row whose partner is not in this step keeps its own logits."""

    def fn(logits: jax.Array, history: TokenHistory, args: jax.Array) -> jax.Array:
        del history
        group, role, scale = args[:, 0], args[:, 1], args[:, 2]  # [B] each
        logp = jax.nn.log_softmax(logits, axis=-1)
        same = group[:, None] == group[None, :]  # [B, B]
        cond_of = same & (role[None, :] == 1)  # row i's conditional partner is column j
        uncond_of = same & (role[None, :] == 0)
        has_pair = jnp.any(cond_of, axis=1) & jnp.any(uncond_of, axis=1)
        cond = jnp.argmax(cond_of, axis=1)  # [B] first such row
        uncond = jnp.argmax(uncond_of, axis=1)
        s = scale[cond][:, None]  # the conditional request's scale
        mixed = logp[uncond] + s * (logp[cond] - logp[uncond])
        return jnp.where(has_pair[:, None], mixed, logits)

    return LogitsProcessor(name, fn)
