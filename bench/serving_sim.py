"""The `vllm bench serve` workload replayed through jaxpaged's own scheduler with a step-cost
model instead of a model: where a policy's TTFT and inter-token latency come from, in seconds
of CPU instead of the minutes a served run takes on this shared machine.

    python bench/serving_sim.py [--num-prompts 48 --concurrency 16 --input-len 256
        --output-len 128] [--cost "decode=1 16=1.1 32=1.56 64=3.2 128=4.01 ..."]
        [--variant NAME="--max-prefill-tokens-with-decodes 64 ..."] ...

Closed-loop clients as `vllm bench serve --max-concurrency C` runs them: C requests in flight,
the next sent when one ends; distinct random prompts (no prefix-cache hits); every request
decodes exactly ``--output-len`` tokens. Steps run in turn; a step's time is the cost of the
bucket the runner would pad it to (``--cost``: milliseconds, or any unit, per decode-only
step of S sequences ``dS=`` and per mixed step of T real tokens ``T=``; other sizes are
interpolated linearly). The tokens a step samples reach the client at its end.
Printed per variant: output tokens per unit time, TTFT p50 / p99 split into the wait before
the first chunk and the prefill steps after it, ITL p50 / p99 and their ratio, the share of
steps carrying a prefill chunk. Real runs (bench/prefill_ab.py) decide; this explains them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable, Sequence

import numpy as np

from jaxpaged.args import EngineArgs
from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sched.output import RunnerOutput
from jaxpaged.sched.request import Request
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.worker.buckets import Bucket, BucketSet

# Step times relative to 15 decodes alone (bucket 16): the mixed rows measured with 15 decodes
# by bench/mixed_steps.py (2026-12-02, load 9-10); decode-only steps of fewer sequences are
# guesses (only a run's first and last steps have them). Served on a quiet machine the same
# shape took 3.5x the decode step's median (306 / 87 ms, bench/prefill_ab.py --step-log,
# 2026-12-02, load 2), 5.4x under others' load (load 10); pass --cost with a step log's figures
# to replay a served run.
DEFAULT_COST = "d1=0.35 d2=0.4 d4=0.5 d8=0.7 d16=1 32=1.6 48=2.5 64=3.15 79=3.9"


def parse_cost(text: str) -> Callable[[Bucket, int], float]:
    """``d16=1 64=3.2 ...`` -> the cost of a step: a decode-only step by its bucket's
    sequences, a mixed step by its real rows (the native CPU kernels skip padding rows: 15
    decodes + 64 tokens took 3.99x the decode step padded to 128 rows, 3.85x padded to 80),
    linear between listed sizes and beyond them."""
    decode: dict[int, float] = {}
    mixed: dict[int, float] = {}
    for word in text.split():
        key, _, value = word.partition("=")
        table = decode if key.startswith("d") else mixed
        table[int(key.lstrip("d"))] = float(value)
    if len(decode) < 2 or len(mixed) < 2:
        raise ValueError(f"--cost needs two decode (dS=) and two mixed (T=) sizes: {text!r}")

    def interp(table: dict[int, float], x: int) -> float:
        xs = sorted(table)
        i = min(max(np.searchsorted(xs, x) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        return table[x0] + (table[x1] - table[x0]) * (x - x0) / (x1 - x0)

    def cost(bucket: Bucket, rows: int) -> float:
        if bucket.decode_only:
            return interp(decode, bucket.num_seqs)
        return interp(mixed, rows)

    return cost


@dataclasses.dataclass
class Trace:
    """One request's times: sent, first chunk scheduled, tokens received."""

    sent: float
    first_chunk: float | None = None
    tokens: list[float] = dataclasses.field(default_factory=list)


def simulate(
    args: EngineArgs,
    cost: Callable[[Bucket, int], float],
    *,
    num_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
) -> dict[str, float]:
    """Runs the closed-loop workload through the scheduler; returns the summary figures."""
    sched_config: SchedulerConfig = args.scheduler_config(_ModelLen(args.max_model_len))
    buckets = BucketSet(
        max_num_seqs=sched_config.max_num_seqs,
        max_num_batched_tokens=sched_config.max_num_batched_tokens,
        max_model_len=sched_config.max_model_len,
        block_size=args.block_size,
    )
    blocks = concurrency * -(-(input_len + output_len) // args.block_size) + 64
    sched = Scheduler(
        sched_config,
        CacheConfig(block_size=args.block_size, enable_prefix_caching=False),
        num_blocks=blocks,
        step_sizes=buckets.mixed_tokens,
    )
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    traces: dict[str, Trace] = {}
    now = 0.0
    sent = 0

    def send() -> None:
        nonlocal sent
        rid = f"r{sent}"
        prompt = rng.integers(1, 30000, input_len).tolist()
        sched.add_request(Request(request_id=rid, prompt_token_ids=prompt,
                                  sampling_params=params, arrival_time=now))  # fmt: skip
        traces[rid] = Trace(sent=now)
        sent += 1

    for _ in range(min(concurrency, num_prompts)):
        send()
    step_kinds: list[bool] = []  # whether each step carried a prefill chunk
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if not plan.seqs:
            raise RuntimeError("the scheduler planned an empty step with requests waiting")
        for s in plan.seqs:
            t = traces[s.request_id]
            if t.first_chunk is None:
                t.first_chunk = now
        step_kinds.append(any(s.num_tokens > 1 for s in plan.seqs))
        now += cost(buckets.pick(plan.seqs), plan.num_batched_tokens)
        sampled = [7 if s.do_sample else -1 for s in plan.seqs]
        for u in sched.update(plan, RunnerOutput(sampled_token_ids=sampled)):
            traces[u.request_id].tokens.extend([now] * len(u.new_token_ids))
            if u.finish_reason is not None and sent < num_prompts:
                send()
    ttft = [t.tokens[0] - t.sent for t in traces.values()]
    wait = [t.first_chunk - t.sent for t in traces.values()]
    itl = [b - a for t in traces.values() for a, b in zip(t.tokens, t.tokens[1:], strict=False)]
    p = lambda xs, q: float(np.percentile(xs, q))  # noqa: E731
    return {
        "tok/unit": num_prompts * output_len / now,
        "TTFT p50": p(ttft, 50),
        "TTFT p99": p(ttft, 99),
        "wait p50": p(wait, 50),
        "prefill p50": p([a - b for a, b in zip(ttft, wait, strict=True)], 50),
        "ITL p50": p(itl, 50),
        "ITL p99": p(itl, 99),
        "p99/p50": p(itl, 99) / p(itl, 50),
        "mixed share": statistics.mean(step_kinds),
        "steps": len(step_kinds),
    }


@dataclasses.dataclass(frozen=True)
class _ModelLen:
    """The one field of ModelConfig that EngineArgs.scheduler_config reads."""

    max_position_embeddings: int


def _variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=FLAGS, got {text!r}")
    return name, flags.split()


def engine_args(flags: Sequence[str], base: dict[str, object]) -> EngineArgs:
    """EngineArgs from the server's CLI flags, ``base`` replacing the fields' defaults."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, defaults=base)
    return EngineArgs.from_cli_args(parser.parse_args(["sim", *flags]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--cost", default=DEFAULT_COST)
    p.add_argument("--variant", type=_variant, action="append", default=None,
                   help="NAME=FLAGS of jaxpaged.serve (default: today's default only)")  # fmt: skip
    a = p.parse_args(argv)
    cost = parse_cost(a.cost)
    base = {"max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len}
    for name, flags in a.variant or [("default", [])]:
        r = simulate(engine_args(flags, base), cost, num_prompts=a.num_prompts,
                     concurrency=a.concurrency, input_len=a.input_len,
                     output_len=a.output_len)  # fmt: skip
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
