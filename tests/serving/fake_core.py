"""The fake model and scheduler behind tests/serving/fakes.py's engines (computable by hand:
see that module's docstring): its tokenizer, request validation and FakeCore, which steps
requests and builds their outputs without asyncio or locking."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from collections.abc import Container

from jaxpaged.engine.input_processor import check_request_id
from jaxpaged.engine.protocol import EngineStats, Prompt
from jaxpaged.models.config import ModelConfig
from jaxpaged.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from jaxpaged.sampling_params import SamplingParams, validate_prompt

VOCAB = 128
EOS = 3


def expected_text(prompt_ids: list[int], num_tokens: int, index: int = 0) -> str:
    s = sum(prompt_ids)
    return "".join(chr(ord("a") + (s + i + index) % 26) for i in range(num_tokens))


def expected_logprob(position: int) -> float:
    """The logprob the fakes give the token at `position` of any sample."""
    return -0.5 * (1 + position % 3)


class FakeTokenizer:
    eos_token_id = EOS
    eos_token = "<eos>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        if any(not 0 < i < VOCAB for i in ids):
            raise ValueError("prompt: non-ASCII text")
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i >= 32)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(
        self, messages, add_generation_prompt=True, tokenize=False, chat_template=None, **extra
    ):
        parts = [f"<{k}={v}>" for k, v in sorted(extra.items())]  # template variables
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']}")
            parts.append(f"<{m['role']}>{m['content']}\n")
        if add_generation_prompt:
            parts.append("<assistant>")
        text = "".join(parts)
        return {"input_ids": self.encode(text)} if tokenize else text


def model_config() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        eos_token_ids=(EOS,),
    )


class Stream:
    """One request's outputs as an async iterator; None ends it, an exception is raised."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


@dataclasses.dataclass(kw_only=True, eq=False)
class FakeRequest:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    arrival: float
    generated: list[list[int]]  # per sample: every token id so far
    finish: list[str | None]  # per sample
    sent: list[int]  # per sample: tokens already in an output (DELTA)
    reported: list[bool]  # per sample: its finish_reason is already in an output (DELTA)
    stream: Stream | None = None  # FakeAsyncEngine only
    blocks: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)


def new_request(
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    output_kind: RequestOutputKind,
    *,
    tokenizer: FakeTokenizer,
    max_model_len: int,
    arrival: float | None = None,
    in_use: Container[str] = (),
) -> FakeRequest:
    """Validates like the real engine (ValueError naming the problem; its own checks where
    they need no model) and builds a request."""
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    check_request_id(request_id, in_use)
    if not isinstance(output_kind, RequestOutputKind):
        raise ValueError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
    validate_prompt(ids, max_model_len, VOCAB, params)
    n = params.n
    return FakeRequest(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_ids=ids,
        params=params,
        output_kind=output_kind,
        arrival=time.time() if arrival is None else arrival,
        generated=[[] for _ in range(n)],
        finish=[None] * n,
        sent=[0] * n,
        reported=[False] * n,
    )


class FakeCore:
    """The fakes' scheduler and generator (no asyncio, no locking): steps requests and
    builds their outputs in each request's output kind."""

    def __init__(
        self,
        *,
        max_model_len: int,
        max_num_seqs: int,
        num_kv_blocks: int,
        block_size: int,
        tokens_per_step: int = 1,
        interleave: bool = False,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.tokens_per_step = tokens_per_step
        self.interleave = interleave
        self.tokenizer = FakeTokenizer()
        self.model_config = model_config()
        self.engine_config: dict[str, object] = {
            "block_size": block_size,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "dtype": "float32",
        }
        self.aborted: list[str] = []  # ids whose abort the engine has processed
        self.steps = 0
        self.waiting: deque[FakeRequest] = deque()
        self.running: list[FakeRequest] = []
        self.free = num_kv_blocks
        self.prompt_total = 0
        self.gen_total = 0
        self._hold_at: int | None = None  # see hold_after
        self._waste_sum = 0.0
        self._waste_steps = 0

    # ---- requests ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> FakeRequest | None:
        return next((r for r in (*self.waiting, *self.running) if r.request_id == request_id), None)

    def hold_after(self, num_tokens: int) -> None:
        """Stops generating once `num_tokens` more tokens exist, until the next abort: a
        cancel test then looks at a request that is certainly still running, however slow
        the machine."""
        self._hold_at = self.gen_total + num_tokens

    def held(self) -> bool:
        return self._hold_at is not None and self.gen_total >= self._hold_at

    def abort(self, request_id: str) -> tuple[FakeRequest, RequestOutput] | None:
        """Records the abort, ends any hold, and, if the request is still there, frees it;
        returns it with its final output (its unfinished samples end with "abort")."""
        self.aborted.append(request_id)
        self._hold_at = None
        r = self.find(request_id)
        if r is None:
            return None
        (self.waiting if r in self.waiting else self.running).remove(r)
        r.finish = [f or "abort" for f in r.finish]
        self._release(r)
        return r, self._output(r)

    def drop_all(self) -> list[FakeRequest]:
        """Forgets every request (the engine died); returns them."""
        dropped = [*self.waiting, *self.running]
        self.waiting.clear()
        self.running.clear()
        return dropped

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[tuple[FakeRequest, RequestOutput]]:
        """Schedules, generates, and returns each touched request with its output (none for
        a FINAL_ONLY request that has not finished); finished requests are freed."""
        if self.held():
            return []
        self.steps += 1
        self._schedule()
        now = time.time()
        outs = []
        for r in list(self.running):
            self._grow(r)
            self._generate(r)
            if r.first_token is None:
                r.first_token = now
            out = self._output(r)
            if out is not None:
                outs.append((r, out))
            if r.done:
                self.running.remove(r)
                self._release(r)
        self._account_waste()
        return outs

    def _schedule(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if self._blocks_needed(r) > self.free:
                break
            self.waiting.popleft()
            r.first_scheduled = time.time()
            self.prompt_total += len(r.prompt_ids)
            self.running.append(r)

    def _grow(self, r: FakeRequest) -> None:
        need = self._blocks_needed(r)
        if need > r.blocks:
            take = min(need - r.blocks, self.free)
            self.free -= take
            r.blocks += take

    def _generate(self, r: FakeRequest) -> None:
        s = sum(r.prompt_ids)
        limit = r.params.effective_max_tokens(len(r.prompt_ids), self.max_model_len)
        live = [j for j, f in enumerate(r.finish) if f is None]
        if self.interleave and live:
            live = [min(live, key=lambda j: len(r.generated[j]))]
        for j in live:
            toks = r.generated[j]
            for _ in range(self.tokens_per_step):
                toks.append(ord("a") + (s + len(toks) + j) % 26)
                self.gen_total += 1
                if len(toks) >= limit:
                    r.finish[j] = "length"
                    break

    def _account_waste(self) -> None:
        slots = sum(r.blocks for r in self.running) * self.block_size
        if not slots:
            return
        stored = sum(len(r.prompt_ids) + len(g) for r in self.running for g in r.generated)
        self._waste_sum += max(0.0, 1 - stored / slots)
        self._waste_steps += 1

    def _blocks_needed(self, r: FakeRequest) -> int:
        longest = max(len(g) for g in r.generated)
        return r.params.n * math.ceil((len(r.prompt_ids) + longest + 1) / self.block_size)

    def _release(self, r: FakeRequest) -> None:
        self.free += r.blocks
        r.blocks = 0

    # ---- outputs ----------------------------------------------------------------------------
    def _output(self, r: FakeRequest) -> RequestOutput | None:
        if r.output_kind is RequestOutputKind.FINAL_ONLY:
            return self._request_output(r, self._whole(r)) if r.done else None
        samples = self._news(r)
        return self._request_output(r, samples) if samples else None

    def _whole(self, r: FakeRequest) -> list[CompletionOutput]:
        return [self._sample(r, j, 0) for j in range(len(r.generated))]

    def _news(self, r: FakeRequest) -> list[CompletionOutput]:
        """The samples that changed since the last output, each with only what is new."""
        samples = []
        for j, toks in enumerate(r.generated):
            newly_finished = r.finish[j] is not None and not r.reported[j]
            if len(toks) == r.sent[j] and not newly_finished:
                continue
            samples.append(self._sample(r, j, r.sent[j]))
            r.sent[j] = len(toks)
            r.reported[j] = r.finish[j] is not None
        return samples

    def _sample(self, r: FakeRequest, j: int, start: int) -> CompletionOutput:
        """Sample j from token position `start` on."""
        toks = r.generated[j][start:]
        lps = None
        if r.params.logprobs is not None:
            lps = tuple(
                Logprob(
                    token_id=t,
                    logprob=expected_logprob(start + i),
                    top={t: expected_logprob(start + i), (t + 1) % VOCAB: -2.0}
                    if r.params.logprobs
                    else {},
                )
                for i, t in enumerate(toks)
            )
        return CompletionOutput(
            index=j,
            text=self.tokenizer.decode(toks),
            token_ids=tuple(toks),
            logprobs=lps,
            finish_reason=r.finish[j],
        )

    def _request_output(self, r: FakeRequest, samples: list[CompletionOutput]) -> RequestOutput:
        done = r.done
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=tuple(r.prompt_ids),
            outputs=tuple(samples),
            finished=done,
            metrics=RequestMetrics(
                arrival_time=r.arrival,
                first_scheduled_time=r.first_scheduled,
                first_token_time=r.first_token,
                finished_time=time.time() if done else None,
            ),
        )

    # ---- stats ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        used = self.num_kv_blocks - self.free
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=0,
            kv_cache_usage=used / self.num_kv_blocks,
            kv_cache_waste=self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            num_kv_blocks=self.num_kv_blocks,
            num_free_blocks=self.free,
            num_preemptions=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prompt_tokens_total=self.prompt_total,
            generation_tokens_total=self.gen_total,
            num_steps=self.steps,
            num_compilations=0,
            num_compilations_after_warmup=0,
        )
