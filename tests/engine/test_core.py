"""EngineCore end to end without a model: the real scheduler, input and output processing over
a simulated device (jaxpaged.engine.testing.TimedDeviceRunner, whose tokens are a rule checkable
by hand: (prompt sum + position) % vocab). Stop strings, aborts from another thread, a request
the runner cannot batch and DELTA / FINAL_ONLY outputs, all under the overlapped loop."""

from __future__ import annotations

import threading

import pytest

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.engine.core import EngineCore
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.testing import TimedDeviceRunner, expected_tokens
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import RunnerOutput
from jaxpaged.sched.scheduler import Scheduler

VOCAB = 128
FINAL = RequestOutputKind.FINAL_ONLY


class CharTokenizer:
    """id = character code; ids below 32 decode to nothing."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i >= 32)


class FailingRunner(TimedDeviceRunner):
    """Reports the sequences of ``fail_ids`` as impossible to batch (as the real runner does
    for a row whose sampling settings cannot be filled)."""

    fail_ids: frozenset[str] = frozenset()

    def dispatch(self, plan, allowed=None):
        pending = super().dispatch(plan, allowed)
        if pending is None:
            return None
        done_at, out = pending
        failed = {s.request_id: "ValueError: bad row" for s in plan.seqs}
        failed = {rid: why for rid, why in failed.items() if rid in self.fail_ids}
        return done_at, RunnerOutput(sampled_token_ids=out.sampled_token_ids, failed=failed)


def make_core(runner_cls=TimedDeviceRunner, device: float = 0.0):
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128),
        CacheConfig(block_size=4),
        num_blocks=128,
    )
    runner = runner_cls(scheduler, device_seconds=device, host_seconds=0.0, vocab=VOCAB)
    tokenizer = CharTokenizer()
    core = EngineCore(
        scheduler=scheduler,
        runner=runner,
        tokenizer=tokenizer,
        eos_token_ids=(),
        num_kv_blocks=128,
    )
    inputs = InputProcessor(
        tokenizer=tokenizer,
        vocab_size=VOCAB,
        max_model_len=128,
        block_size=4,
        num_kv_blocks=128,
        eos_token_ids=(),
    )
    return core, inputs, runner


def drive(core, limit: int = 500):
    outputs = []
    for _ in range(limit):
        if not core.has_work():
            return outputs
        outputs += core.step()
    raise AssertionError("the engine did not finish")


def text_of(prompt: str, n: int) -> str:
    return "".join(chr(t) for t in expected_tokens([ord(c) for c in prompt], n, VOCAB) if t >= 32)


def test_deltas_reassemble_and_final_only_is_one_output():
    core, inputs, _ = make_core()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    core.add_request(inputs.process("d", "ab", params))
    core.add_request(inputs.process("f", "ab", params, output_kind=FINAL))
    outs = drive(core)
    deltas = [o for o in outs if o.request_id == "d"]
    finals = [o for o in outs if o.request_id == "f"]
    assert len(deltas) == 12 and [o.finished for o in deltas] == [False] * 11 + [True]
    ids = [t for o in deltas for c in o.outputs for t in c.token_ids]
    assert ids == expected_tokens([97, 98], 12, VOCAB)
    assert "".join(c.text for o in deltas for c in o.outputs) == text_of("ab", 12)
    assert len(finals) == 1 and finals[0].finished
    assert list(finals[0].outputs[0].token_ids) == ids
    assert finals[0].outputs[0].finish_reason == "length"
    assert core.stats.num_free_blocks == 128


def test_a_stop_string_ends_the_request_exactly_and_frees_it():
    core, inputs, _ = make_core()
    full = text_of("ab", 20)
    stop = full[5:7]  # met after 7 tokens; the step after was already dispatched
    params = SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True)
    core.add_request(inputs.process("s", "ab", params, output_kind=FINAL))
    (out,) = drive(core)
    c = out.outputs[0]
    assert c.text == full[:5] and c.finish_reason == "stop" and c.stop_reason == stop
    assert list(c.token_ids) == expected_tokens([97, 98], 7, VOCAB)  # the dropped one is not
    assert core.stats.generation_tokens_total == 7
    assert core.stats.num_free_blocks == 128 and not core.scheduler.requests


def test_a_request_the_runner_cannot_batch_fails_alone():
    class Runner(FailingRunner):
        fail_ids = frozenset({"bad"})

    core, inputs, _ = make_core(Runner)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request(inputs.process("bad", "zz", params, output_kind=FINAL))
    core.add_request(inputs.process("good", "ab", params, output_kind=FINAL))
    outs = {o.request_id: o for o in drive(core)}
    assert outs["bad"].outputs[0].finish_reason == "error" and "bad row" in outs["bad"].error
    assert outs["good"].error is None
    assert list(outs["good"].outputs[0].token_ids) == expected_tokens([97, 98], 6, VOCAB)
    # and the engine goes on serving
    core.add_request(inputs.process("next", "cd", params, output_kind=FINAL))
    (nxt,) = drive(core)
    assert list(nxt.outputs[0].token_ids) == expected_tokens([99, 100], 6, VOCAB)
    assert core.stats.num_free_blocks == 128


def test_an_abort_from_another_thread_ends_the_request_and_frees_its_blocks():
    core, inputs, _ = make_core(device=0.002)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    core.add_request(inputs.process("long", "ab", long))
    core.add_request(inputs.process("short", "cd", SamplingParams(max_tokens=5, ignore_eos=True)))
    outs = []
    for _ in range(10):
        outs += core.step()
    assert core.stats.num_free_blocks < 128
    t = threading.Thread(target=core.abort, args=("long",))
    t.start()
    t.join()
    outs += drive(core)
    long_outs = [o for o in outs if o.request_id == "long"]
    assert long_outs[-1].finished
    assert long_outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(c.token_ids) for o in long_outs for c in o.outputs) < 100
    assert core.stats.num_free_blocks == 128 and not core.scheduler.requests


class BosTokenizer(CharTokenizer):
    """Adds a BOS token (id 1) to every text, as many models' tokenizers do."""

    def encode(self, text: str) -> list[int]:
        return [1, *super().encode(text)]


def test_admission_checks_ids_prompts_and_adapters_in_one_place():
    """InputProcessor.process is where a request is checked: an id the caller has in use, an
    empty text prompt (even where the tokenizer would turn it into a BOS token) and an
    adapter that is not registered are each a ValueError naming the problem."""
    _, inputs, _ = make_core()
    inputs.tokenizer = BosTokenizer()
    params = SamplingParams(max_tokens=2)
    assert inputs.process("a", "x", params).prompt_token_ids == (1, ord("x"))
    with pytest.raises(ValueError, match="^prompt must not be empty"):
        inputs.process("a", "", params)
    with pytest.raises(ValueError, match="^request_id 'a' is already in use"):
        inputs.process("a", "x", params, in_use={"a"})
    with pytest.raises(ValueError, match="^request_id must be a non-empty string"):
        inputs.process("", "x", params)
    with pytest.raises(ValueError, match="^lora: adapter 'ad' is not loaded"):
        inputs.process("a", "x", params, lora_name="ad")
