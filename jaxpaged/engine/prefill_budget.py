"""The prefill caps of steps with decodes, measured on the machine that serves.

A prompt's chunk rides in a step beside the running decodes, and every one of those requests
waits for that step: its time over a decode-only step's is the tail of the inter-token
latency. What a chunk token costs against a decode step differs by orders of magnitude between
platforms. On the 2-core CPU of bench/RESULTS.md a step's time follows its rows (15 decodes
~88 ms, + 64 prompt tokens ~300 ms); on an accelerator a step is nearly flat in its rows until
the matmuls saturate. So no one constant fits: after warm-up the engine times, at a few decode
counts (1, a quarter of the most, the most: ``max_num_seqs - 1``), a decode-only step and the
same step beside a prompt chunk, on its own weights and KV pool. Between those counts the
decode step's time and a chunk token's cost are interpolated linearly, and each count of
decodes gets the largest cap whose step is predicted within ``prefill_stall_ratio`` decode
steps. One cap measured at the most decodes would stall a lighter load far more: with 16 of
64 sequences decoding, their step is much shorter than 63 decodes', and the same chunk a
larger multiple of it. The steps write K/V into blocks no request holds yet (nothing has
arrived), and run shapes warm-up compiled.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence

from jaxpaged.config import SchedulerConfig
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import NewRequestData, RunnerOutput, ScheduledSeq, SchedulerOutput

__all__ = [
    "StepCosts",
    "caps_by_decodes",
    "calibration_cleanup",
    "calibration_plans",
    "choose_prefill_cap",
    "measure_step_costs",
]

logger = logging.getLogger(__name__)

# The cap where nothing was measured (enforce_eager: no warm-up): the CPU's measured figure
# (under `vllm bench serve`, 16 in flight, 256-token prompts: bench/RESULTS.md).
UNMEASURED_PREFILL_CAP = 64
# A cap never goes below one block of a typical size: a lower one would stretch a prompt
# over so many steps that its time to first token, not the decodes' latency, dominates.
MIN_PREFILL_CAP = 16
CHUNK_TOKENS = 64  # prompt tokens of the measured mixed step (the cap's order on the CPU)
CONTEXT_TOKENS = 256  # KV length of each measured decode (a short chat turn)
RUNG_FRACTION = 4  # the middle decode count measured: the most / 4 (16 clients of 64)
REPEATS = 3  # timed pairs, after one untimed pair; the median of each kind is taken
CALIBRATION_PROMPT = "calibration-prompt"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCosts:
    """Two step times measured on this machine: ``decodes`` one-token sequences, each over
    ``context`` tokens of K/V, alone (``decode_s``) and beside a ``chunk``-token prompt
    chunk (``mixed_s``)."""

    decodes: int
    context: int
    chunk: int
    decode_s: float
    mixed_s: float

    @property
    def chunk_token_s(self) -> float:
        """What one more prompt token adds to a step (the line's slope; >= 0)."""
        return max(0.0, self.mixed_s - self.decode_s) / self.chunk

    def prefill_cap(self, stall_ratio: float, budget: int) -> int:
        """The most prompt tokens a step with these decodes may carry so that it is predicted
        to take at most ``stall_ratio`` decode steps: ``(ratio - 1) x decode_s / slope``,
        within [MIN_PREFILL_CAP, budget]."""
        return _cap(self.decode_s, self.chunk_token_s, stall_ratio, budget)


def _cap(decode_s: float, token_s: float, stall_ratio: float, budget: int) -> int:
    """Prompt tokens at ``token_s`` each that add at most ``(stall_ratio - 1) x decode_s``
    to a step, within [MIN_PREFILL_CAP, budget]."""
    allowed_s = (stall_ratio - 1.0) * decode_s
    if token_s * budget <= allowed_s:
        return budget
    tokens = int(allowed_s / token_s + 1e-9)  # a whole quotient is not rounded down
    return max(min(MIN_PREFILL_CAP, budget), min(budget, tokens))


def caps_by_decodes(
    rungs: Sequence[StepCosts], stall_ratio: float, budget: int, max_decodes: int
) -> tuple[int, ...]:
    """The cap of a step with ``d`` decodes, for d = 0 .. ``max_decodes``: the decode step's
    time and a chunk token's cost interpolated linearly between the measured ``rungs``
    (ascending decode counts), held at the first / last rung's outside them. ``caps[0]`` (no
    decode, so no stall) is the budget."""
    if not rungs:
        raise ValueError("caps_by_decodes needs at least one measured step")
    caps = [budget]
    for d in range(1, max_decodes + 1):
        hi = next((i for i, r in enumerate(rungs) if r.decodes >= d), len(rungs) - 1)
        lo = max(0, hi - 1)
        a, b = rungs[lo], rungs[hi]
        t = (
            0.0
            if b.decodes == a.decodes
            else min(1.0, max(0.0, (d - a.decodes) / (b.decodes - a.decodes)))
        )
        decode_s = a.decode_s + t * (b.decode_s - a.decode_s)
        token_s = a.chunk_token_s + t * (b.chunk_token_s - a.chunk_token_s)
        caps.append(_cap(decode_s, token_s, stall_ratio, budget))
    return tuple(caps)


def calibration_plans(
    *,
    decodes: int,
    context: int,
    chunk: int,
    block_size: int,
) -> tuple[SchedulerOutput, SchedulerOutput]:
    """A decode-only plan (``decodes`` sequences fed their token at position ``context - 1``)
    and the same beside a ``chunk``-token prompt chunk from position 0, on disjoint blocks
    0, 1, ... Greedy sampling; the chunk is not the prompt's last (it samples nothing). Each
    plan brings its requests into the runner's batch afresh (their data and whole tables), so
    either can run any number of times, in any order; :func:`calibration_cleanup` then
    drops them."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    blocks_per_decode = -(-context // block_size)
    seqs, new = [], []
    for i in range(decodes):
        first = i * blocks_per_decode
        rid = f"calibration-{i}"
        new.append(NewRequestData(request_id=rid, seq_id=-1 - i, params=greedy, key_stream=i))
        seqs.append(
            ScheduledSeq(
                request_id=rid,
                seq_id=-1 - i,
                token_ids=(0,),
                prev_row=-1,
                start_pos=context - 1,
                new_block_ids=tuple(range(first, first + blocks_per_decode)),
                key_counter=0,
            )
        )
    first = decodes * blocks_per_decode
    prompt_data = NewRequestData(
        request_id=CALIBRATION_PROMPT, seq_id=-1 - decodes, params=greedy, key_stream=decodes
    )
    prompt = ScheduledSeq(
        request_id=CALIBRATION_PROMPT,
        seq_id=-1 - decodes,
        token_ids=(0,) * chunk,
        prev_row=-1,
        start_pos=0,
        new_block_ids=tuple(range(first, first + -(-chunk // block_size))),
    )
    return (
        SchedulerOutput(seqs=tuple(seqs), new_requests=tuple(new)),
        SchedulerOutput(seqs=(*seqs, prompt), new_requests=(*new, prompt_data)),
    )


def calibration_cleanup(plans: tuple[SchedulerOutput, ...]) -> SchedulerOutput:
    """The plan that drops the calibration requests from the runner's batch."""
    ids = dict.fromkeys(d.request_id for p in plans for d in p.new_requests)
    return SchedulerOutput(finished_request_ids=tuple(ids))


def rung_decodes(most: int) -> tuple[int, ...]:
    """The decode counts measured: 1, ``most // RUNG_FRACTION`` and ``most`` (distinct)."""
    return tuple(sorted({1, max(1, most // RUNG_FRACTION), most}))


def measure_step_costs(
    execute: Callable[[SchedulerOutput], RunnerOutput],
    config: SchedulerConfig,
    *,
    num_blocks: int,
    block_size: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[StepCosts, ...] | None:
    """Times :func:`calibration_plans` through ``execute`` (the runner's dispatch + collect)
    at each of :func:`rung_decodes` up to the largest step with decodes the config allows:
    ``max_num_seqs - 1`` decodes (a prompt arriving while the rest decode). Every rung has
    the same context and chunk. None where no step carries both (one sequence at a time, or
    a pool too small for the shapes)."""
    budget = config.max_num_batched_tokens
    decodes = min(config.max_num_seqs - 1, budget // 2)
    # a prompt chunk no longer than a sequence may be (its block table's width)
    chunk = min(CHUNK_TOKENS, budget - decodes, config.max_model_len)
    context = min(CONTEXT_TOKENS, config.max_model_len - 1)
    spare = num_blocks - -(-chunk // block_size)  # blocks left for the decodes
    if decodes < 1 or spare < decodes:
        return None
    context = min(context, spare // decodes * block_size)
    rungs = []
    for n in rung_decodes(decodes):
        decode_plan, mixed_plan = calibration_plans(
            decodes=n, context=context, chunk=chunk, block_size=block_size
        )
        times: dict[int, list[float]] = {0: [], 1: []}
        for repeat in range(REPEATS + 1):
            for kind, plan in enumerate((decode_plan, mixed_plan)):
                start = clock()
                execute(plan)
                if repeat:  # the first pair is untimed (first touches of the shapes' buffers)
                    times[kind].append(clock() - start)
        execute(calibration_cleanup((decode_plan, mixed_plan)))
        rungs.append(
            StepCosts(
                decodes=n,
                context=context,
                chunk=chunk,
                decode_s=statistics.median(times[0]),
                mixed_s=statistics.median(times[1]),
            )
        )
    return tuple(rungs)


def choose_prefill_cap(
    execute: Callable[[SchedulerOutput], RunnerOutput],
    config: SchedulerConfig,
    *,
    num_blocks: int,
    block_size: int,
    measure: bool = True,
) -> tuple[tuple[int, ...], tuple[StepCosts, ...] | None]:
    """The cap for ``config.prefill_stall_ratio`` of a step with d decodes, for d = 0 ..
    ``max_num_seqs`` (:func:`caps_by_decodes`), from step times measured now (with
    ``measure``), and those times; UNMEASURED_PREFILL_CAP at every d where nothing was
    measured."""
    budget = config.max_num_batched_tokens
    costs = None
    if measure:
        costs = measure_step_costs(execute, config, num_blocks=num_blocks, block_size=block_size)
    if costs is None:
        return (min(UNMEASURED_PREFILL_CAP, budget),) * (config.max_num_seqs + 1), None
    caps = caps_by_decodes(costs, config.prefill_stall_ratio, budget, config.max_num_seqs)
    logger.info(
        "prefill caps (stall ratio %.3g): %s",
        config.prefill_stall_ratio,
        "; ".join(
            f"{caps[r.decodes]} tokens beside {r.decodes} decodes ({r.decode_s * 1e3:.1f} ms, "
            f"+ {r.chunk} tokens {r.mixed_s * 1e3:.1f} ms)"
            for r in costs
        ),
    )
    return caps, costs
