"""How an embedding model turns its hidden states into one vector per input: the pooling
(mean, CLS, last token, max) and L2 normalisation, decided as sentence-transformers decides
them, from the checkpoint's own files: ``modules.json`` lists the pipeline (Transformer,
Pooling, Normalize), the Pooling module's ``config.json`` its mode, and
``sentence_bert_config.json`` the longest input (``max_seq_length``). A folder without
``modules.json`` pools as vLLM does: an encoder's first ([CLS]) token, a decoder's last
token, normalised.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

POOLING_MODES = ("mean", "cls", "last", "max")
# sentence-transformers' Pooling config keys -> jaxpaged's modes (the ones it computes)
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
}
_ST_REFUSED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = "sentence_transformers.models."


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingConfig:
    """One embedding per input: ``mode`` over its real tokens, then L2-normalised if
    ``normalize``; ``max_seq_length``: the longest input the model was trained for (None:
    the position table's)."""

    mode: str = "cls"
    normalize: bool = True
    max_seq_length: int | None = None
    # sentence-transformers' named instruction prompts (config_sentence_transformers.json):
    # (name, text put before an input), and the one used when a call names none
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    include_prompt: bool = True  # the Pooling module's: whether a prompt's tokens are pooled

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(
                f"unsupported pooling mode {self.mode!r}; supported: {', '.join(POOLING_MODES)}"
            )


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _pooling_mode(config: Mapping[str, Any], where: str) -> str:
    """The one mode of a sentence-transformers Pooling config (old boolean keys, or the
    newer ``pooling_mode`` string)."""
    if isinstance(config.get("pooling_mode"), str):
        named = {"mean": "mean", "cls": "cls", "lasttoken": "last", "max": "max"}
        mode = config["pooling_mode"]
        if mode not in named:
            raise ValueError(f"{where}: unsupported pooling_mode {mode!r}")
        return named[mode]
    refused = [k for k in _ST_REFUSED if config.get(k)]
    if refused:
        raise ValueError(f"{where}: unsupported pooling {', '.join(refused)}")
    modes = [m for k, m in _ST_MODES.items() if config.get(k)]
    if len(modes) != 1:
        raise ValueError(
            f"{where}: jaxpaged pools with exactly one mode, the config sets "
            f"{modes or 'none'} (sentence-transformers would concatenate them)"
        )
    return modes[0]


def load_pooling_config(folder: str | os.PathLike, *, default_mode: str = "cls") -> PoolingConfig:
    """The pooling of a model folder, from its sentence-transformers files (see the module
    docstring; without them ``default_mode``, normalised: vLLM's CLS for an encoder, last
    token for a decoder); ValueError naming a module or mode jaxpaged does not run."""
    folder = os.fspath(folder)
    modules_path = os.path.join(folder, "modules.json")
    max_len = None
    st_config = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(st_config):
        max_len = _read_json(st_config).get("max_seq_length")
    prompts, default_prompt = _prompts(folder)
    if not os.path.isfile(modules_path):
        return PoolingConfig(mode=default_mode, normalize=True, max_seq_length=max_len,
                             prompts=prompts, default_prompt_name=default_prompt)  # fmt: skip
    mode, normalize, include_prompt = None, False, True
    for module in _read_json(modules_path):
        kind = str(module.get("type", ""))
        name = kind.removeprefix(_ST_MODULES)
        if name == "Transformer":
            continue
        if name == "Pooling":
            path = os.path.join(folder, module.get("path", ""), "config.json")
            mode = _pooling_mode(_read_json(path), path)
            include_prompt = bool(_read_json(path).get("include_prompt", True))
        elif name == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{modules_path}: unsupported sentence-transformers module {kind!r} "
                "(jaxpaged runs Transformer, Pooling and Normalize)"
            )
    if mode is None:
        raise ValueError(f"{modules_path} has no Pooling module")
    return PoolingConfig(mode=mode, normalize=normalize, max_seq_length=max_len,
                         prompts=prompts, default_prompt_name=default_prompt,
                         include_prompt=include_prompt)  # fmt: skip


def _prompts(folder: str) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """The named prompts and the default one of config_sentence_transformers.json (none
    without it); ValueError for a malformed entry or a default that is not a name."""
    path = os.path.join(folder, "config_sentence_transformers.json")
    if not os.path.isfile(path):
        return (), None
    d = _read_json(path)
    prompts = d.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise ValueError(f"{path}: prompts must map names to texts, got {prompts!r}")
    default = d.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(f"{path}: default_prompt_name {default!r} is not one of its prompts")
    return tuple(prompts.items()), default


def pool(
    hidden: jax.Array,  # [B, S, D]
    mask: jax.Array,  # bool [B, S], True for real tokens (padding on the right)
    mode: str,
) -> jax.Array:  # float32 [B, D]
    """One vector per row, over its real tokens, as sentence-transformers' Pooling."""
    h = hidden.astype(jnp.float32)
    m = mask.astype(jnp.float32)[..., None]  # [B, S, 1]
    if mode == "mean":
        return (h * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)
    if mode == "cls":
        return h[:, 0]
    if mode == "last":
        last = jnp.maximum(mask.sum(axis=1) - 1, 0)  # [B]
        return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return jnp.where(m > 0, h, -1e9).max(axis=1)
    raise ValueError(f"unsupported pooling mode {mode!r}; supported: {', '.join(POOLING_MODES)}")


def normalize(x: jax.Array) -> jax.Array:  # float32 [..., D] -> [..., D]
    """L2 normalisation as torch's F.normalize (the norm floored at 1e-12)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
