"""Generation without a server: `jaxpaged.generate(...)` for JAX research code (the command
line, `python -m jaxpaged.generate`, is :mod:`jaxpaged.cli.generate`). This module is itself
callable, so `jaxpaged.generate(...)` works even after `import jaxpaged.generate` has bound the
name to the module.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine, Prompt
from jaxpaged.llm import LLM
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import Params
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

log = logging.getLogger("jaxpaged.generate")


def generate(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    model: str | os.PathLike | Any = None,
    params: Params | None = None,
    config: ModelConfig | None = None,
    tokenizer: Any = None,
    eos_token_ids: Sequence[int] | None = None,
    use_tqdm: bool = False,
    **engine_args: Any,
) -> list[RequestOutput]:
    """One call from JAX research code: a model by name or folder (None = the bundled one),
    params + config of a jaxpaged family already in memory, or ``model`` a Flax NNX module of
    your own (docs/models.md; ``params`` then optionally a state of its graph to serve instead
    of its own). A tokenizer is needed for text prompts, ``eos_token_ids`` if the config lacks
    the model's end tokens. Engine arguments are
    :class:`~jaxpaged.args.EngineArgs` fields (max_model_len, num_kv_blocks, enforce_eager,
    ...); ``show_progress`` defaults to ``use_tqdm``."""
    engine_args.setdefault("show_progress", use_tqdm)
    if model is not None and not isinstance(model, str | os.PathLike):
        if config is not None:
            raise ValueError("config: a module of your own brings its own (module.config)")
        llm = LLM.from_model(
            model, tokenizer, params=params, eos_token_ids=eos_token_ids, **engine_args
        )
    elif params is None and config is None:
        if eos_token_ids is not None:
            raise ValueError("eos_token_ids: only for params + config (a model brings its own)")
        llm = LLM(model, **engine_args)
    else:
        if params is None or config is None:
            raise ValueError("params and config must be given together")
        if model is not None:
            raise ValueError("give either model or params + config, not both")
        engine_args.setdefault("max_model_len", min(config.max_position_embeddings, 4096))
        engine = LLMEngine.from_engine_args(
            EngineArgs.from_kwargs(**engine_args),
            model_config=config,
            params=params,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
        )
        llm = LLM.from_engine(engine)
    try:
        return llm.generate(prompts, sampling_params, use_tqdm=use_tqdm)
    finally:
        llm.engine.close()


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from jaxpaged.cli.generate import main

    sys.exit(main())
