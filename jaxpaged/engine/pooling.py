"""PoolingEngine: embeddings, scores and classes from an encoder (vLLM's pooling runner).

No KV cache and no scheduler: a call tokenizes its inputs (checked: not empty, token ids in
the vocabulary, no longer than ``max_model_len`` unless ``truncate_prompt_tokens`` says to
truncate), runs them through the worker's fixed-shape buckets (compiled at warm-up) and
returns one output per input. Which runner a checkpoint gets: engine/runner_choice.py; a
generation call to a pooling engine, and the reverse, are refused by name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxpaged.args import EngineArgs
from jaxpaged.engine.paged_pooling import paged_pooling_worker
from jaxpaged.engine.pooling_inputs import PoolingInputs, pairs, prompt_list
from jaxpaged.engine.protocol import EngineStats, Prompt
from jaxpaged.engine.runner_choice import choose_runner, read_hf_config
from jaxpaged.hf_overrides import apply_hf_overrides, token_classifier
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.pooling import PoolingConfig
from jaxpaged.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxpaged.worker.pooling_runner import (
    PoolingBuckets,
    PoolingModelInfo,
    PoolingRunner,
    hidden_states_fn,
)

__all__ = ["PoolingEngine", "PoolingJob"]

# the token budget of one padded batch when max_num_batched_tokens is unset: all-MiniLM-L6-v2
# on the 2-core CPU took 4.3 ms a sentence in [64, 32] batches, 5.9 ms in [256, 32] ones
# (activations past the caches)
DEFAULT_POOLING_TOKENS = 2048


class PoolingEngine:
    """An encoder with its tokenizer and pooling, compiled for every bucket at start-up."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        params: Any,  # noqa: ANN401 - the family's params tree
        tokenizer: Any,  # noqa: ANN401 - a transformers tokenizer
        pooling: PoolingConfig,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
        model_name: str = "",
        graphdef: Any = None,  # noqa: ANN401 - a decoder's NNX graph (None: an encoder)
        score_head: Any = None,  # noqa: ANN401 - [C, D] a decoder classifier's (seq_cls.py)
        worker: Any = None,  # noqa: ANN401 - a PagedPoolingWorker (None: the dense runner)
    ) -> None:
        limit = model_config.max_position_embeddings
        default = min(pooling.max_seq_length or limit, limit)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's {limit} positions"
            )
        self.model_config, self.tokenizer, self.pooling = model_config, tokenizer, pooling
        self.model_name = model_name
        self.max_model_len = max_model_len or default
        info = None
        if score_head is not None:  # a decoder *ForSequenceClassification
            info = PoolingModelInfo(classifier=True, num_labels=int(score_head.shape[0]))
        if worker is not None:  # the paged engine's steps (warmed up with the engine)
            self.worker = worker
            self.warmup_programs = worker.warmup_compilations
        else:
            buckets = PoolingBuckets.for_limits(
                self.max_model_len, max_num_seqs, max_num_batched_tokens or DEFAULT_POOLING_TOKENS
            )
            self.worker = PoolingRunner(
                model_config,
                params,
                pooling,
                buckets,
                hidden_states_fn(model_config, graphdef),
                score_head=score_head,
                info=info,
            )
            self.warmup_programs = 0 if enforce_eager else self.worker.warm_up()
        self.info = self.worker.info
        self._requests = 0
        self.inputs = PoolingInputs(tokenizer, model_config.vocab_size, self.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> PoolingEngine:
        """Loads ``args.model`` (a folder or hub id of an encoder family) and warms up."""
        from jaxpaged.models.loader import load_model, load_tokenizer
        from jaxpaged.models.pooling import load_pooling_config
        from jaxpaged.models.registry import family_for_hf_config, family_of
        from jaxpaged.models.resolve import resolve_model_folder
        from jaxpaged.models.seq_cls import is_decoder_classifier, load_decoder_classifier

        if choose_runner(args) != "pooling":
            raise ValueError(
                f"model {args.model!r} runs the generate runner by default: ask for "
                "runner='pooling' to embed with it"
            )
        if args.tensor_parallel_size != 1 or args.enable_lora or args.quantization:
            raise ValueError(
                "the pooling runner runs float weights on one device: tensor_parallel_size, "
                "enable_lora and quantization are not supported for it"
            )
        folder = resolve_model_folder(
            args.model, revision=args.revision, download_dir=args.download_dir
        )
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(
                f"the pooling runner loads Hugging Face folders (config.json); {folder!r} has none"
            )
        head = None
        hf = apply_hf_overrides(read_hf_config(folder), args.hf_overrides)
        classifier = is_decoder_classifier(hf)
        if args.hf_overrides and not classifier:
            raise ValueError(
                f"hf_overrides: {hf.get('architectures')} is not a decoder family's "
                "*ForSequenceClassification (the overrides turn decoders into classifiers)"
            )
        decoder = classifier or family_for_hf_config(hf).runner != "pooling"
        pooling = load_pooling_config(folder, default_mode="last" if decoder else "cls")
        if decoder and pooling.mode == "last":  # pooling requests in the paged engine's steps
            return cls._on_paged_engine(args, folder, pooling, classifier)
        if token_classifier(args.hf_overrides) is not None:
            raise ValueError(
                "hf_overrides: a classifier from vocabulary rows scores the last token, but "
                f"the model's sentence-transformers pooling is {pooling.mode!r}"
            )
        if classifier:
            config, params, head, _ = load_decoder_classifier(
                folder, dtype=args.load_dtype, progress=args.show_progress
            )
        else:
            config, params = load_model(folder, dtype=args.load_dtype, progress=args.show_progress)
        family = family_of(config)
        graphdef = None
        if family.runner != "pooling":  # a decoder pooling other than its last token
            graphdef = family.module.graphdef_for(config, params)
        return cls(
            model_config=config,
            params=params,
            tokenizer=load_tokenizer(folder),
            pooling=pooling,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager,
            model_name=os.fspath(args.model if args.model is not None else folder),
            graphdef=graphdef,
            score_head=head,
        )

    @classmethod
    def _on_paged_engine(
        cls, args: EngineArgs, folder: str, pooling: PoolingConfig, classifier: bool
    ) -> PoolingEngine:
        """A decoder pooling its last token: its inputs run as pooling requests in a paged
        engine's steps (engine/paged_pooling.py), a classifier's head on the host."""
        from jaxpaged.models.loader import load_tokenizer
        from jaxpaged.models.seq_cls import load_decoder_classifier, vocab_rows_head

        tokens = token_classifier(args.hf_overrides)
        if tokens is not None:  # a *ForCausalLM checkpoint scoring with vocabulary rows
            tokenizer = load_tokenizer(folder)
            ids = [_token_id(tokenizer, t) for t in tokens.tokens]
            head = vocab_rows_head(folder, ids, two_way=tokens.method == "from_2_way_softmax")
            worker = paged_pooling_worker(args, head=head)
        elif classifier:
            config, params, head, _ = load_decoder_classifier(
                folder, dtype=args.load_dtype, progress=args.show_progress
            )
            worker = paged_pooling_worker(
                args, model_config=config, params=params, tokenizer=load_tokenizer(folder),
                head=head,
            )  # fmt: skip
        else:
            worker = paged_pooling_worker(args)
        engine = worker.engine
        return cls(
            model_config=engine.model_config,
            params=None,
            tokenizer=engine.tokenizer,
            pooling=pooling,
            max_model_len=engine.max_model_len - 1,  # one position for the dropped token
            model_name=os.fspath(args.model),
            worker=worker,
        )

    # ------------------------------------------------------------ calls
    # Each call is a job: its inputs tokenized and checked, and what turns the model's rows
    # into its outputs. Jobs run together (``run_jobs``), so the server batches concurrent
    # requests into the same padded batches.
    @property
    def engine_config(self) -> dict[str, object]:
        """What the server logs of the engine (as LLMEngine.engine_config)."""
        return {
            "runner": "pooling",
            "block_size": 0,  # no KV cache
            "dtype": str(jax.tree.leaves(self.worker.params)[0].dtype),
            "max_model_len": self.max_model_len,
            "pooling": self.pooling.mode,
            "normalize": self.pooling.normalize,
        }

    def _ids(self, prefix: str, n: int) -> list[str]:
        start = self._requests
        self._requests += n
        return [f"{prefix}-{start + i}" for i in range(n)]

    def run_jobs(self, jobs: Sequence[PoolingJob]) -> list[list[Any]]:
        """Every job's outputs; the jobs' inputs run through the buckets together."""
        ids = [t for job in jobs for t in job.token_ids]
        types = [t for job in jobs for t in (job.token_types or [None] * len(job.token_ids))]
        rows = self.worker.run(ids, types) if ids else np.zeros((0, self.worker.output_size))
        out, start = [], 0
        for job in jobs:
            n = len(job.token_ids)
            out.append(job.finish(rows[start : start + n]))
            start += n
        return out

    def encode_job(
        self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None
    ) -> PoolingJob:
        """The model's raw pooled rows (embeddings before normalisation, or a
        cross-encoder's logits), float32 [N, D or C] (vLLM's /pooling)."""
        ids = self.inputs.tokenize(prompt_list(prompts), truncate_prompt_tokens)
        return PoolingJob(ids, None, lambda rows: [ids, rows])

    def embed_job(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
    ) -> PoolingJob:
        if self.info.classifier:
            raise ValueError(
                f"model {self.model_name!r} is a cross-encoder (sequence classification): "
                "it scores text pairs (score, /score, /rerank) and has no embeddings"
            )
        prompts = self.with_prompt(prompt_list(prompts), prompt_name)
        self.check_dimensions(dimensions)
        ids = self.inputs.tokenize(prompts, truncate_prompt_tokens)
        rids = self._ids("embd", len(ids))

        def finish(rows: np.ndarray) -> list[EmbeddingRequestOutput]:
            vectors = self.finish_embeddings(rows, dimensions)
            return [
                EmbeddingRequestOutput(
                    request_id=r, prompt_token_ids=t, outputs=EmbeddingOutput(embedding=v.tolist())
                )
                for r, t, v in zip(rids, ids, vectors, strict=True)
            ]

        return PoolingJob(ids, None, finish)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per input, pooled and normalised as the model's
        sentence-transformers files say; ``dimensions`` truncates a Matryoshka model's;
        ``prompt_name``: one of the model's named prompts put before each text input."""
        job = self.embed_job(
            prompts,
            truncate_prompt_tokens=truncate_prompt_tokens,
            dimensions=dimensions,
            prompt_name=prompt_name,
        )
        return self.run_jobs([job])[0]

    def with_prompt(self, prompts: list[Prompt], prompt_name: str | None) -> list[Prompt]:
        """The inputs with the named prompt's text (or the model's default prompt) before
        each text, as sentence-transformers' ``encode(prompt_name=...)``; ValueError for a
        name the model does not have, or a named prompt with token-id inputs."""
        named = dict(self.pooling.prompts)
        if prompt_name is not None and prompt_name not in named:
            have = ", ".join(map(repr, named)) or "none"
            raise ValueError(
                f"prompt_name {prompt_name!r} is not one of model {self.model_name!r}'s "
                f"prompts ({have}; config_sentence_transformers.json)"
            )
        text = named.get(prompt_name or self.pooling.default_prompt_name or "", "")
        if not text:
            return prompts
        if prompt_name is not None and any(not isinstance(p, str) for p in prompts):
            raise ValueError("prompt_name applies to text inputs, not token ids")
        if not self.pooling.include_prompt and self.pooling.mode in ("mean", "max"):
            raise ValueError(
                f"model {self.model_name!r} pools without its prompt's tokens "
                "(include_prompt false), which jaxpaged does not compute"
            )
        return [text + p if isinstance(p, str) else p for p in prompts]

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless ``dimensions`` is None or a size this model may truncate to."""
        if dimensions is None:
            return
        c = self.info
        if not c.is_matryoshka:
            raise ValueError(
                f"model {self.model_name!r} does not support Matryoshka representation: "
                "dimensions cannot change the size of its embeddings"
            )
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise ValueError(f"dimensions must be an integer, got {dimensions!r}")
        if c.matryoshka_dimensions and dimensions not in c.matryoshka_dimensions:
            raise ValueError(
                f"dimensions {dimensions} is not one of this model's Matryoshka sizes "
                f"{list(c.matryoshka_dimensions)}"
            )
        hidden = self.model_config.hidden_size
        if not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be in [1, {hidden}], got {dimensions}")

    def finish_embeddings(self, pooled: np.ndarray, dimensions: int | None) -> np.ndarray:
        """Truncated to ``dimensions`` (Matryoshka), then normalised if the model's
        pooling says so. pooled float32 [N, D] -> [N, dimensions or D]."""
        if dimensions is not None:
            pooled = pooled[:, :dimensions]
        if self.pooling.normalize:
            norm = np.linalg.norm(pooled, axis=-1, keepdims=True)
            pooled = pooled / np.maximum(norm, 1e-12)
        return pooled

    def classify_job(
        self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None
    ) -> PoolingJob:
        self._need_classifier("classify")
        ids = self.inputs.tokenize(prompt_list(prompts), truncate_prompt_tokens)
        rids = self._ids("classify", len(ids))

        def finish(rows: np.ndarray) -> list[ClassificationRequestOutput]:
            return [
                ClassificationRequestOutput(
                    request_id=r, prompt_token_ids=t, outputs=ClassificationOutput(probs=p.tolist())
                )
                for r, t, p in zip(rids, ids, class_probs(rows), strict=True)
            ]

        return PoolingJob(ids, None, finish)

    def classify(
        self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationRequestOutput]:
        """A cross-encoder's class probabilities per input (softmax; sigmoid for one label)."""
        job = self.classify_job(prompts, truncate_prompt_tokens=truncate_prompt_tokens)
        return self.run_jobs([job])[0]

    def _need_classifier(self, what: str) -> None:
        if not self.info.classifier:
            raise ValueError(
                f"{what} needs a cross-encoder (*ForSequenceClassification); model "
                f"{self.model_name!r} is an embedding model"
            )

    def score_job(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> PoolingJob:
        a, b = pairs(text_1, text_2)
        rids = self._ids("score", len(b))

        def outputs(ids: list[list[int]], scores: np.ndarray) -> list[ScoringRequestOutput]:
            return [
                ScoringRequestOutput(
                    request_id=r, prompt_token_ids=t, outputs=ScoringOutput(score=float(s))
                )
                for r, t, s in zip(rids, ids, scores, strict=True)
            ]

        if self.info.classifier:
            if self.info.num_labels != 1:
                raise ValueError(
                    f"score needs a cross-encoder with one label; model {self.model_name!r} "
                    f"has {self.info.num_labels} (use classify)"
                )
            ids, types = self.inputs.pair_tokens(a, b, truncate_prompt_tokens)
            if getattr(self.model_config, "type_vocab_size", 2) < 2:  # RoBERTa: one segment
                types = None
            activation = self.info.score_activation
            return PoolingJob(
                ids, types, lambda rows: outputs(ids, _activate(rows[:, 0], activation))
            )
        ids_a = self.inputs.tokenize(a, truncate_prompt_tokens)
        ids_b = self.inputs.tokenize(b, truncate_prompt_tokens)

        def cosine(rows: np.ndarray) -> list[ScoringRequestOutput]:
            unit = rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)
            scores = (unit[: len(a)] * unit[len(a) :]).sum(axis=-1)
            return outputs([x + y for x, y in zip(ids_a, ids_b, strict=True)], scores)

        return PoolingJob(ids_a + ids_b, None, cosine)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """The relevance of each (text_1, text_2) pair (one text_1 goes with every text_2):
        a cross-encoder's score of the pair as one input, or the cosine similarity of two
        embeddings from an embedding model."""
        job = self.score_job(text_1, text_2, truncate_prompt_tokens=truncate_prompt_tokens)
        return self.run_jobs([job])[0]

    # ------------------------------------------------------------ what LLM asks of an engine
    def get_stats(self) -> EngineStats:
        w = self.worker
        return EngineStats(
            num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0, kv_cache_waste=0.0,
            num_kv_blocks=0, num_free_blocks=0, num_preemptions=0, prefix_cache_queries=0,
            prefix_cache_hits=0, prompt_tokens_total=self.inputs.prompt_tokens,
            generation_tokens_total=0, num_steps=0,
            num_compilations=w.num_compilations,
            num_compilations_after_warmup=w.compilations_after_warmup,
        )  # fmt: skip

    def close(self) -> None:
        self.worker.close()


@dataclasses.dataclass(frozen=True)
class PoolingJob:
    """One call's tokenized inputs and what turns the model's rows for them into its
    outputs (``finish(rows [N, D or C]) -> outputs``)."""

    token_ids: list[list[int]]
    token_types: list[list[int]] | None
    finish: Callable[[np.ndarray], Any]


def _token_id(tokenizer: Any, token: str) -> int:  # noqa: ANN401 - a transformers tokenizer
    """The id of one vocabulary token (hf_overrides' classifier_from_token), by name."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"hf_overrides: classifier_from_token {token!r} is not in the vocabulary")
    return int(tid)


def _activate(logits: np.ndarray, activation: str) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits)) if activation == "sigmoid" else logits


def class_probs(logits: np.ndarray) -> np.ndarray:  # float32 [N, C] -> [N, C]
    """Softmax over the classes; sigmoid for a single label (vLLM's classify)."""
    if logits.shape[-1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)
