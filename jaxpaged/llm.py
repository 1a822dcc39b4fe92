"""LLM: offline batch generation, the way vLLM users call it."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine, Prompt
from jaxpaged.engine.images import chat_images
from jaxpaged.engine.pooling import PoolingEngine
from jaxpaged.lora_request import LoRARequest
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ScoringRequestOutput,
)
from jaxpaged.sampling_params import SamplingParams

Message = Mapping[str, str]
Conversation = Sequence[Message]


def _is_token_ids(x: object) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, str)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)) or (_is_token_ids(prompts) and len(prompts) > 0):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, token ids, or a list of them, got {prompts!r}")
    return list(prompts)


class LLM:
    """An engine for offline generation: ``LLM().generate(prompts, SamplingParams(...))``;
    for an encoder (``runner="pooling"``, chosen from the checkpoint by default),
    ``embed``, ``score`` and ``classify``.

    ``model=None`` serves the bundled SmolLM2-135M-Instruct; otherwise a local Hugging Face
    folder, a hub id, or a .gguf file. The keywords are :class:`~jaxpaged.args.EngineArgs`
    fields; an unknown one is a ValueError naming its close matches. With
    ``data_parallel_size=N`` the prompts are spread over N engine processes
    (jaxpaged.engine.dp_offline; call :meth:`close` when done, or use ``with``).
    """

    def __init__(self, model: str | os.PathLike | None = None, **engine_args: Any) -> None:
        from jaxpaged.engine.runner_choice import choose_runner

        args = EngineArgs.from_kwargs(model=model, **engine_args)
        if args.data_parallel_size > 1:  # replica processes, driven like one engine
            from jaxpaged.engine.dp_offline import DataParallelEngine

            self.engine: Any = DataParallelEngine(args)
        elif choose_runner(args) == "pooling":
            self.engine = PoolingEngine.from_engine_args(args)
        else:
            self.engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()

    @classmethod
    def from_model(
        cls,
        model: Any,
        tokenizer: Any = None,
        *,
        params: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        **engine_args: Any,
    ) -> LLM:
        """An engine over a Flax NNX module of your own (the paged-model protocol,
        docs/models.md): its ``config`` (a ModelConfig) sizes the KV pool, its state (or
        ``params``, a state of the same graph) is served as it is. A tokenizer is needed for
        text prompts; ``engine_args`` are :class:`~jaxpaged.args.EngineArgs` fields
        (``max_model_len`` defaults to the config's max_position_embeddings, at most 4096)."""
        from flax import nnx

        from jaxpaged.models.protocol import check_paged_model

        config = check_paged_model(model)
        graphdef, state = nnx.split(model)
        if params is not None:
            state = params
        if isinstance(state, nnx.State):
            state = nnx.to_pure_dict(state)
        engine_args.setdefault("max_model_len", min(config.max_position_embeddings, 4096))
        engine = LLMEngine.from_engine_args(
            EngineArgs.from_kwargs(**engine_args),
            model_config=config,
            params=state,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            graphdef=graphdef,
        )
        return cls.from_engine(engine)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs in prompt order.
        A bad prompt or parameter raises ValueError before anything runs. ``lora_request``:
        the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        self._need_runner("generate", "generate")
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(prompt_list)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(
                    f"lora_request: {len(lora_list)} given for {len(prompt_list)} prompts"
                )
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        engine = self.engine
        added: list[str] = []
        try:
            for rid, prompt, params, lora in zip(
                ids, prompt_list, params_list, lora_list, strict=True
            ):
                engine.add_request(
                    rid, prompt, params, output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora
                )
                added.append(rid)
        except Exception:
            for rid in added:
                engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req")
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update()
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates. A
        message's content may list parts: text, and images of a vision-language model
        (``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` or
        ``{"type": "image", "image": PIL.Image}``)."""
        self._need_runner("generate", "chat")
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts: list[Prompt] = []
        for c in conversations:
            template_messages, images = chat_images(c)
            if not images:
                prompts.append(
                    self.apply_chat_template(
                        c, chat_template=chat_template, add_generation_prompt=add_generation_prompt
                    )
                )
                continue
            text = self.tokenizer.apply_chat_template(
                template_messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            prompts.append(
                {"prompt": text, "add_special_tokens": False, "multi_modal_data": {"image": images}}
            )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        conversation: Conversation,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        for i, m in enumerate(conversation):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content'")
        ids = self.tokenizer.apply_chat_template(
            list(conversation),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ------------------------------------------------------------ the pooling runner
    def _need_runner(self, runner: str, call: str) -> None:
        have = "pooling" if isinstance(self.engine, PoolingEngine) else "generate"
        if have != runner:
            hint = (
                "embed(), score() and classify()" if have == "pooling" else "generate() and chat()"
            )
            raise ValueError(
                f"{call}() needs runner={runner!r}, but this LLM runs its model with "
                f"runner={have!r}, which offers {hint}"
            )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), pooled and normalised as the
        model's sentence-transformers files say (``LLM(model, runner="pooling")``).
        ``truncate_prompt_tokens``: -1 or k truncates inputs to the model's limit or to k
        tokens (None: a longer input is a ValueError); ``dimensions``: a Matryoshka model's
        embedding size; ``prompt_name``: one of the model's sentence-transformers prompts
        (config_sentence_transformers.json, e.g. Qwen3-Embedding's "query") put before each
        text (None: its default prompt, if it names one)."""
        del use_tqdm
        self._need_runner("pooling", "embed")
        return self.engine.embed(
            prompts,
            truncate_prompt_tokens=truncate_prompt_tokens,
            dimensions=dimensions,
            prompt_name=prompt_name,
        )

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoringRequestOutput]:
        """The score of each (text_1, text_2) pair (one text_1 goes with every text_2): a
        cross-encoder's relevance, or the cosine similarity of an embedding model's
        vectors."""
        del use_tqdm
        self._need_runner("pooling", "score")
        return self.engine.score(text_1, text_2, truncate_prompt_tokens=truncate_prompt_tokens)

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        """A sequence-classification model's class probabilities per prompt."""
        del use_tqdm
        self._need_runner("pooling", "classify")
        return self.engine.classify(prompts, truncate_prompt_tokens=truncate_prompt_tokens)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt prefix (as vLLM's ``LLM.reset_prefix_cache``)."""
        self._need_runner("generate", "reset_prefix_cache")
        self.engine.reset_prefix_cache()

    def update_weights(self, params: Any) -> None:  # noqa: ANN401 - the model's params pytree
        """Swaps in new weights of the same tree, shapes and dtypes (ValueError otherwise),
        without recompiling or reallocating the KV pool; the prefix cache is reset. Params
        already on the device (or sharded on the engine's mesh) are used in place, so do not
        donate or delete them while this engine may still generate from them."""
        self._need_runner("generate", "update_weights")
        self.engine.update_weights(params)

    def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 1) and also drops the weights (level 2), so a trainer
        can use the memory; ``generate`` raises EngineAsleepError until :meth:`wake_up`.
        Returns the KV bytes freed."""
        self._need_runner("generate", "sleep")
        return self.engine.sleep(level)

    def wake_up(self, params: Any = None) -> None:  # noqa: ANN401
        """Restores the KV cache after :meth:`sleep`. After level 2 pass the new ``params``
        (an engine that loaded its model reloads it when none are given)."""
        self._need_runner("generate", "wake_up")
        self.engine.wake_up(params)

    def close(self) -> None:
        """Releases the engine's compiled programs, KV pool and weights (see
        :meth:`LLMEngine.close`); also on leaving ``with LLM(...) as llm:``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_metrics(self) -> dict[str, float | int]:
        """Engine counters: preemptions, prefix cache (and its host tier's ``kv_offload_*``:
        tokens hit there, blocks and bytes stored and loaded, blocks held and at most), KV
        usage and waste, compilations, a vision model's encoder cache (``mm_cache_queries``
        / ``mm_cache_hits`` as vLLM's, ``mm_cache_evictions``, ``mm_encoder_seconds``), and
        speculative decoding's (vLLM's spec_decode names; the acceptance rate is accepted /
        drafted tokens, the mean acceptance length 1 + accepted / verifications, and
        ``spec_decode_num_accepted_tokens_per_pos_j`` counts drafts accepted at position j)."""
        s = self.engine.get_stats()
        drafted, accepted = s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens
        per_pos = {
            f"spec_decode_num_accepted_tokens_per_pos_{j}": n
            for j, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos)
        }
        return {
            "spec_decode_num_drafts": s.spec_decode_num_drafts,
            "spec_decode_num_draft_tokens": drafted,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_decode_mean_acceptance_length": (
                1 + accepted / s.spec_decode_num_drafts if s.spec_decode_num_drafts else 0.0
            ),
            **per_pos,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "kv_offload_hits": s.kv_offload_hits,
            "kv_offload_blocks_stored": s.kv_offload_blocks_stored,
            "kv_offload_blocks_loaded": s.kv_offload_blocks_loaded,
            "kv_offload_bytes_stored": s.kv_offload_bytes_stored,
            "kv_offload_bytes_loaded": s.kv_offload_bytes_loaded,
            "kv_offload_num_blocks": s.kv_offload_num_blocks,
            "kv_offload_capacity_blocks": s.kv_offload_capacity_blocks,
            "kv_offload_disk_blocks_stored": s.kv_offload_disk_blocks_stored,
            "kv_offload_disk_blocks_loaded": s.kv_offload_disk_blocks_loaded,
            "mm_cache_queries": s.mm_cache_queries,
            "mm_cache_hits": s.mm_cache_hits,
            "mm_cache_evictions": s.mm_cache_evictions,
            "mm_encoder_seconds": s.mm_encoder_seconds,
            "kv_cache_usage": s.kv_cache_usage,
            "kv_cache_waste": s.kv_cache_waste,
            "num_compilations": s.num_compilations,
            "num_compilations_after_warmup": s.num_compilations_after_warmup,
            "num_free_blocks": s.num_free_blocks,
            "num_kv_blocks": s.num_kv_blocks,
            "prompt_tokens_total": s.prompt_tokens_total,
            "generation_tokens_total": s.generation_tokens_total,
        }
