"""Generation without a server: `jaxpaged.generate(...)` for JAX research code (the command
line, `python -m jaxpaged.generate`, is :mod:`jaxpaged.cli.generate`). This module is itself
callable, so `jaxpaged.generate(...)` works even after `import jaxpaged.generate` has bound the
name to the module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax

from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine, Prompt
from jaxpaged.llm import LLM
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.types import Params
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.weights import ParamsSpec

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
    generator: Generator | None = None,
    **engine_args: Any,
) -> list[RequestOutput]:
    """One call from JAX research code: a model by name or folder (None = the bundled one),
    params + config of a jaxpaged family already in memory, or ``model`` a Flax NNX module of
    your own (docs/models.md; ``params`` then optionally a state of its graph to serve instead
    of its own). A tokenizer is needed for text prompts, ``eos_token_ids`` if the config lacks
    the model's end tokens. Engine arguments are
    :class:`~jaxpaged.args.EngineArgs` fields (max_model_len, num_kv_blocks, enforce_eager,
    ...); ``show_progress`` defaults to ``use_tqdm``.

    Without ``generator`` each call builds an engine (KV pool, warm-up) and closes it. In a
    loop, pass a :class:`Generator` you own: calls with the same config, params shapes and
    settings reuse its engine, swapping in the new ``params`` without recompiling."""
    owned = generator is None
    gen = Generator() if owned else generator
    try:
        return gen.generate(
            prompts,
            sampling_params,
            model=model,
            params=params,
            config=config,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            use_tqdm=use_tqdm,
            **engine_args,
        )
    finally:
        if owned:
            gen.close()


class Generator:
    """Engines kept alive across generation calls, owned by the caller (no global cache)::

        with jaxpaged.Generator() as gen:
            for _ in range(rounds):
                outs = jaxpaged.generate(prompts, sp, params=params, config=config,
                                         tokenizer=tok, generator=gen)
                params = train_step(params, outs)

    A call whose model (or config and params tree, shapes, dtypes and placement), tokenizer,
    end tokens and engine arguments match an open engine reuses it: new params are swapped in
    (``LLM.update_weights``: no recompilation, prefix cache reset) unless they are the very
    arrays it already holds. At most ``max_engines`` stay open (the least recently used one is
    closed first: each holds a KV pool). ``close()`` (or leaving the ``with`` block) closes
    them all. The engines keep references to the params they were given: do not donate or
    delete those arrays in a later jitted call while the generator is open.
    """

    def __init__(self, max_engines: int = 1) -> None:
        if max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {max_engines}")
        self.max_engines = max_engines
        self._llms: OrderedDict[tuple, tuple[LLM, list[Any]]] = OrderedDict()
        self.engines_built = 0

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes every engine (their KV pools and compiled programs can be freed)."""
        while self._llms:
            _, (llm, _) = self._llms.popitem(last=False)
            llm.engine.close()

    def llm(
        self,
        *,
        model: str | os.PathLike | Any = None,
        params: Params | None = None,
        config: ModelConfig | None = None,
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        **engine_args: Any,
    ) -> LLM:
        """The open engine for these arguments (its weights replaced by ``params``), or a new
        one. Arguments as :func:`generate`'s."""
        own_module = model is not None and not isinstance(model, str | os.PathLike)
        eos = None if eos_token_ids is None else tuple(eos_token_ids)
        if own_module:
            if config is not None:
                raise ValueError("config: a module of your own brings its own (module.config)")
            args = EngineArgs.from_kwargs(**engine_args)
            # the module is held by its engine, so its id stays its own while the engine lives
            key = ("module", id(model), _settings_key(args), id(tokenizer), eos)
        elif params is None and config is None:
            if eos_token_ids is not None:
                raise ValueError("eos_token_ids: only for params + config (a model brings its own)")
            args = EngineArgs.from_kwargs(model=model, **engine_args)
            key: tuple = ("model", _settings_key(args))
        else:
            if params is None or config is None:
                raise ValueError("params and config must be given together")
            if model is not None:
                raise ValueError("give either model or params + config, not both")
            engine_args.setdefault("max_model_len", min(config.max_position_embeddings, 4096))
            args = EngineArgs.from_kwargs(**engine_args)
            spec = ParamsSpec.of(params)
            key = (
                "params",
                _settings_key(args),
                config,
                spec.treedef,
                spec.leaves,
                spec.shardings,
                id(tokenizer),
                eos,
            )
        hit = self._llms.get(key)
        if hit is not None:
            self._llms.move_to_end(key)
            llm, held = hit
            if params is not None:
                leaves = jax.tree.leaves(params)
                if len(leaves) != len(held) or any(
                    a is not b for a, b in zip(leaves, held, strict=True)
                ):
                    llm.update_weights(params)
                    held[:] = leaves
            return llm
        while len(self._llms) >= self.max_engines:
            _, (old, _) = self._llms.popitem(last=False)
            old.engine.close()
        if own_module:
            llm = LLM.from_model(
                model, tokenizer, params=params, eos_token_ids=eos_token_ids, **engine_args
            )
        elif params is None:
            llm = LLM(model, **engine_args)
        else:
            engine = LLMEngine.from_engine_args(
                args,
                model_config=config,
                params=params,
                tokenizer=tokenizer,
                eos_token_ids=eos_token_ids,
            )
            llm = LLM.from_engine(engine)
        self.engines_built += 1
        self._llms[key] = (llm, [] if params is None else jax.tree.leaves(params))
        return llm

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """:func:`generate` on this generator's engines."""
        kwargs.setdefault("show_progress", use_tqdm)
        return self.llm(**kwargs).generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _settings_key(args: EngineArgs) -> EngineArgs:
    """The settings that decide whether an engine can be reused (progress bars do not)."""
    return dataclasses.replace(args, show_progress=False)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from jaxpaged.cli.generate import main

    sys.exit(main())
