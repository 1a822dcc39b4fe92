"""``FakeLLMEngine``: what the real ``AsyncEngine`` drives, built from the real input
processing, EngineCore, scheduler and output processing over a fake device that emits the
letters of ``fakes.expected_text``, so the serving tests run the real engine thread without a
model."""

from __future__ import annotations

import time

from fakes import EOS, VOCAB, FakeTokenizer, model_config, wait_until

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.protocol import EngineStats
from jaxpaged.engine.testing import FakeDeviceAdmin
from jaxpaged.sched.output import RunnerOutput, SchedulerOutput
from jaxpaged.sched.scheduler import Scheduler


class _LetterRunner(FakeDeviceAdmin):
    """A fake device for the real EngineCore: sample j of a request at output position i
    draws the letter of ``expected_text`` (the rule of the module docstring); ``busy``
    seconds of pure-Python work per dispatch hold the GIL like a real step's host side does.
    ``hold_after(n)``: once n tokens are out, ``collect`` waits until an abort arrives (so a
    request is certainly still running when a test cancels it)."""

    def __init__(self, engine: FakeLLMEngine, busy: float) -> None:
        self.engine = engine
        self.busy = busy
        self.num_tokens = 0
        self.hold_at: int | None = None
        self.stall = 0.0  # seconds every collect waits

    def dispatch(self, plan: SchedulerOutput, allowed: object = None) -> RunnerOutput | None:
        self.check_kv()
        end = time.monotonic() + self.busy
        while time.monotonic() < end:  # hold the GIL
            pass
        sampled = []
        for s in plan.seqs:
            req = self.engine.core.scheduler.requests[s.request_id]
            if not s.do_sample:
                sampled.append(-1)
                continue
            i, j = s.key_counter, req.sample_index
            sampled.append(ord("a") + (sum(req.prompt_token_ids) + i + j) % 26)
        self.num_tokens += sum(s.do_sample for s in plan.seqs)
        return RunnerOutput(sampled_token_ids=sampled) if plan.seqs else None

    def collect(self, pending: RunnerOutput | None) -> RunnerOutput:
        if self.hold_at is not None and self.num_tokens >= self.hold_at:
            wait_until(lambda: bool(self.engine.aborted), timeout=30)
        time.sleep(self.stall)  # a long device step, when a test asks for one
        return pending or RunnerOutput(sampled_token_ids=())

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(plan))


class FakeLLMEngine:
    """What ``AsyncEngine`` drives (``inputs``, ``core``, ``tokenizer``, ...), built from the
    real input processing, EngineCore, scheduler and output processing over a fake device
    (:class:`_LetterRunner`), so the engine thread, the inbox and the asyncio bridge are the
    real ones and only the model is not."""

    def __init__(self, *, max_model_len: int = 256, max_num_seqs: int = 32, num_kv_blocks: int = 256,
                 block_size: int = 4, busy: float = 0.0) -> None:  # fmt: skip
        self.tokenizer = FakeTokenizer()
        self.model_config = model_config()
        self.max_model_len = max_model_len
        self.engine_config = {
            "block_size": block_size,
            "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len,
            "dtype": "float32",
        }
        self.aborted: list[str] = []
        self.inputs = InputProcessor(
            tokenizer=self.tokenizer,
            vocab_size=VOCAB,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            eos_token_ids=(EOS,),
        )
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(512, max_num_seqs),
                max_model_len=max_model_len,
            ),
            CacheConfig(block_size=block_size),
            num_blocks=num_kv_blocks,
        )
        self.runner = _LetterRunner(self, busy)
        self.core = EngineCore(
            scheduler=scheduler,
            runner=self.runner,
            tokenizer=self.tokenizer,
            eos_token_ids=(EOS,),
            num_kv_blocks=num_kv_blocks,
        )
        real_abort = self.core.abort

        def abort(request_id: str) -> None:
            self.aborted.append(request_id)
            real_abort(request_id)

        self.core.abort = abort

    # what AsyncEngine reads of an LLMEngine's admin side: no LoRA, no weights to load
    lora = None
    weights_from = None
    reload_weights = None

    def list_loras(self) -> dict[str, str]:
        return {}

    def hold_after(self, num_tokens: int) -> None:
        self.runner.hold_at = num_tokens

    def get_stats(self) -> EngineStats:
        return self.core.stats
