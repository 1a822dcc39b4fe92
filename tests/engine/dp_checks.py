"""Data-parallel checks, run in ONE subprocess with 4 simulated CPU devices by
test_data_parallel.py (the rest of the suite keeps its single device):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/engine/dp_checks.py \
        --workdir /tmp/x --out /tmp/x/results.json

A tiny random Llama (the bundled tokenizer) is written once. The reference is one engine at
tensor_parallel_size 2 in this process. One set of 2 replica processes x 2 devices each
serves everything after it (two engines' start-up in all): first the offline
LLM(data_parallel_size=2), then `jaxpaged serve`'s Server over the same DataParallelClient,
on its event loop, asked through the real `openai` client. The JSON maps each check to "ok"
or its traceback (a check after a failed one may fail for that reason).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_llama import write_tiny_llama  # noqa: E402

PERIOD = 10.0  # the replicas' health-check period (s): 5 s killed a busy replica as hung when the
# suite ran this beside the TP checks' 4-device subprocess
ENGINE = {
    "max_model_len": 512, "num_kv_blocks": 96, "max_num_seqs": 8, "enforce_eager": True,
    "show_progress": False, "tensor_parallel_size": 2,
    "data_parallel_health_check_period": PERIOD,
}  # fmt: skip
PROMPTS = [f"Prompt {i}: " + "the quick brown fox jumps " * (1 + i % 3) for i in range(8)]
MAX_TOKENS = 8
SHARED = "You are a helpful assistant who answers in one word. " * 3  # 3+ text chunks


def reference(model: str) -> tuple[list[str], list[int], int]:
    """One engine's greedy texts of PROMPTS, their prompt token counts, and the KV bytes
    its sleep frees."""
    from jaxpaged import LLM, SamplingParams

    with LLM(model, **ENGINE) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        freed = llm.sleep()
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts)) > 1, f"degenerate reference {texts}"
    assert freed > 0
    return texts, [len(o.prompt_token_ids) for o in outs], freed


def complete(url: str, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS) -> str:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))


def sent(client) -> list[int]:
    return [r.sent_total for r in client.replicas]


def check_offline(ctx: dict) -> None:
    """LLM(data_parallel_size=2) gives one engine's greedy texts, spread over both replicas;
    too few devices is refused by name before any process starts."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.engine.protocol import EngineAsleepError

    try:
        LLM(ctx["model"], data_parallel_size=3, **ENGINE)
    except ValueError as exc:
        assert "needs 6 devices" in str(exc) and "4 cpu device" in str(exc), exc
    else:
        raise AssertionError("data_parallel_size 3 x tp 2 on 4 devices was not refused")
    ctx["llm"] = llm = LLM(ctx["model"], data_parallel_size=2, **ENGINE)
    ctx["client"] = client = llm.engine.client
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate(PROMPTS, greedy)
    assert [o.outputs[0].text for o in outs] == ctx["ref"]
    assert sent(client) == [4, 4], sent(client)  # a burst of 8 alternates
    # sleep mode reaches every replica: both free their KV pools, requests are refused
    # until wake_up, then served as before
    freed = llm.sleep()
    assert freed == 2 * ctx["ref_sleep_bytes"], (freed, ctx["ref_sleep_bytes"])
    try:
        llm.generate(PROMPTS[:1], greedy)
    except EngineAsleepError:
        pass
    else:
        raise AssertionError("a sleeping data-parallel LLM generated")
    llm.wake_up()
    assert [o.outputs[0].text for o in llm.generate(PROMPTS[:2], greedy)] == ctx["ref"][:2]


class _Server:
    """`jaxpaged serve`'s Server over the offline LLM's client, on that client's loop."""

    def __init__(self, llm) -> None:
        from jaxpaged.serving.frontend import ServingConfig
        from jaxpaged.serving.server import Server

        self._llm = llm
        config = ServingConfig(served_model_name="tiny", host="127.0.0.1", port=0, grpc_port=0)
        self.server = Server(config, log_level="warning")

        async def start() -> None:
            await self.server.start()
            self.server.attach(llm.engine.client)

        llm.engine.run_on_loop(start())
        self.http = f"http://127.0.0.1:{self.server.http_port}"

    def stop(self) -> None:
        self._llm.engine.run_on_loop(self.server.shutdown())


def check_server(ctx: dict) -> None:
    """Behind the real server: greedy texts equal one engine's; requests spread."""
    from jaxpaged.engine.protocol import EngineClient
    from jaxpaged.engine.protocol_check import assert_implements

    client = ctx["client"]
    assert_implements(EngineClient, client)
    ctx["server"] = server = _Server(ctx["llm"])
    before = sent(client)
    with ThreadPoolExecutor(8) as pool:
        got = list(
            pool.map(lambda i: complete(server.http, PROMPTS[i], stream=i % 2 == 0), range(8))
        )
    assert got == ctx["ref"], f"data-parallel {got} != one engine {ctx['ref']}"
    delta = [a - b for a, b in zip(sent(client), before, strict=True)]
    assert sum(delta) == 8 and all(n > 0 for n in delta), f"requests per replica: {delta}"


def scrape(url: str) -> dict[str, float]:
    """/metrics as name -> value, a labelled series as name{label=value,...} -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def check_metrics(ctx: dict) -> None:
    """/metrics adds up the replicas: prompt tokens as the reference engine counted them,
    KV blocks of both pools, and nothing running once all finished; per replica (label
    engine): alive, and the requests it was sent."""
    client, server = ctx["client"], ctx["server"]
    values = scrape(server.http)
    # PROMPTS offline, the first two after waking up, then all through the server
    lengths = ctx["ref_prompt_tokens"]
    expected = 2 * sum(lengths) + sum(lengths[:2])
    assert values["jaxpaged:prompt_tokens_total"] == expected, (expected, values)
    per_replica = [r.stats.num_kv_blocks for r in client.replicas]
    assert per_replica == [96, 96] and values["jaxpaged:num_kv_blocks"] == 192, values
    assert values["vllm:num_requests_running"] == 0, values
    assert values["vllm:num_requests_waiting"] == 0, values
    for r in ("0", "1"):
        assert values[f"jaxpaged:replica_alive{{engine={r}}}"] == 1, values
        assert values[f"jaxpaged:replica_num_requests_running{{engine={r}}}"] == 0, values
    # 8 prompts offline, 2 after waking up, 8 through the server
    sent_total = sum(values[f"jaxpaged:replica_requests_total{{engine={r}}}"] for r in "01")
    assert sent_total == 18, values


def check_affinity(ctx: dict) -> None:
    """Requests sharing a prompt prefix follow the replica that served it first (without
    affinity the idle replicas would take turns); the prefix cache there hits."""
    client, server = ctx["client"], ctx["server"]
    before = sent(client)
    hits = [r.stats.prefix_cache_hits for r in client.replicas]
    for i in range(3):
        complete(server.http, SHARED + f"Question {i}?", stream=False)
    delta = [a - b for a, b in zip(sent(client), before, strict=True)]
    assert sorted(delta) == [0, 3], f"shared-prefix requests per replica: {delta}"
    ctx["affinity_rank"] = rank = delta.index(3)
    deadline = time.time() + 5
    while client.replicas[rank].stats.prefix_cache_hits <= hits[rank] and time.time() < deadline:
        time.sleep(0.05)
    assert client.replicas[rank].stats.prefix_cache_hits > hits[rank]
    # short prompts (no full chunk: no prefix) go by load: with both idle, each to the
    # replica sent fewer requests so far (then the lower rank)
    expected = sent(client)
    for i in range(2):
        expected[min((0, 1), key=lambda k: (expected[k], k))] += 1
        complete(server.http, f"{i} unrelated", stream=False)
    assert sent(client) == expected, (sent(client), expected)


def _long_streams(url: str, n: int) -> tuple[list[threading.Thread], list[object]]:
    """``n`` streams of 400 tokens, each on a thread that records its text or its exception;
    returns once every one has streamed its first chunk."""
    first = [threading.Event() for _ in range(n)]
    results: list[object] = [None] * n

    def run(i: int) -> None:
        import openai

        api = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        text = ""
        try:
            for chunk in api.completions.create(
                model="tiny", prompt=f"Story {i}:", max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            ):  # fmt: skip
                text += chunk.choices[0].text
                first[i].set()
            results[i] = text
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            results[i] = exc
        first[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for e in first:
        assert e.wait(60), "a stream never started"
    return threads, results


def _failed(results: list[object], count: int, within: float) -> list[Exception]:
    """The streams' exceptions, once ``count`` have failed (or ``within`` seconds passed)."""
    deadline = time.time() + within
    while sum(isinstance(r, Exception) for r in results) < count and time.time() < deadline:
        time.sleep(0.02)
    return [r for r in results if isinstance(r, Exception)]


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request hung after its replica failed"


def _restarted(client, old, timeout: float = 300):
    """The replica that took ``old``'s place, once it is serving."""
    deadline = time.time() + timeout
    while client.replicas[old.rank] is old or not client.replicas[old.rank].alive:
        assert time.time() < deadline, f"replica {old.rank} was not restarted in {timeout} s"
        time.sleep(0.05)
    new = client.replicas[old.rank]
    assert new.pid != old.pid
    return new


def _hold_restarts(client) -> threading.Event:
    """Makes the client's next restarts wait (off its loop) until the returned event is set:
    a restart takes as long as a process start and JAX's import, which a fast start made
    shorter than the checks that run while a replica is down."""
    import asyncio

    gate, restart = threading.Event(), client._restart

    async def held(old) -> None:
        await asyncio.to_thread(gate.wait, 120)
        await restart(old)

    client._restart = held
    return gate


def _served_during_restart(ctx: dict, victim, other) -> None:
    """While ``victim`` restarts: requests are all served by ``other`` (one engine's texts),
    /health is 200 and jaxpaged:replica_alive reads 0 and 1."""
    import httpx

    client, server = ctx["client"], ctx["server"]
    before = sent(client)
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda i: complete(server.http, PROMPTS[i], stream=False), range(4)))
    assert texts == ctx["ref"][:4], texts
    after = sent(client)
    assert after[other.rank] - before[other.rank] == 4 and after[victim.rank] == before[victim.rank]
    assert httpx.get(server.http + "/health", timeout=10).status_code == 200
    values = scrape(server.http)
    alive = [values[f"jaxpaged:replica_alive{{engine={r}}}"] for r in "01"]
    assert alive[victim.rank] == 0 and alive[other.rank] == 1, values
    assert client.replicas[victim.rank] is victim, "restarted before the checks ended"
    assert not client.errored


def check_replica_death(ctx: dict) -> None:
    """The replica that holds SHARED's prefix is frozen (SIGSTOP) while 4 streams run, a
    SHARED request is routed to it, then its process is killed: exactly its open streams
    fail, fast and naming it; the SHARED request, which it had not taken, is served by the
    other replica; while it restarts, every request goes to the other."""
    client, server = ctx["client"], ctx["server"]
    ctx["victim"] = victim = client.replicas[ctx["affinity_rank"]]
    other = client.replicas[1 - victim.rank]
    threads, results = _long_streams(server.http, 4)
    on_victim = len(victim.streams)
    assert on_victim >= 1, f"no stream on replica {victim.rank}"
    os.kill(victim.pid, signal.SIGSTOP)
    sent_before = sent(client)
    shared: list[object] = []

    def ask_shared() -> None:
        try:
            shared.append(complete(server.http, SHARED + "Question 9?", stream=False))
        except Exception as exc:  # noqa: BLE001
            shared.append(exc)

    threads.append(threading.Thread(target=ask_shared))
    threads[-1].start()
    deadline = time.time() + 30
    while victim.sent_total == sent_before[victim.rank] and time.time() < deadline:
        time.sleep(0.02)
    assert victim.sent_total == sent_before[victim.rank] + 1, "SHARED not routed to its holder"
    held = _hold_restarts(client)  # the checks below run while the victim is down
    killed = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    failed = _failed(results, on_victim, 30)
    threads[-1].join(60)
    assert time.time() - killed < 30
    assert len(failed) == on_victim, f"{on_victim} streams on the victim, results: {results}"
    name = f"data-parallel replica {victim.rank}"
    assert all(name in str(r) for r in failed), failed
    assert shared and isinstance(shared[0], str) and shared[0], shared  # served by the other
    assert other.sent_total == sent_before[other.rank] + 1
    assert not victim.alive
    try:
        _served_during_restart(ctx, victim, other)
    finally:
        held.set()
    _join(threads)
    assert len(_failed(results, on_victim, 0)) == on_victim, results  # the others finished


def check_replica_restart(ctx: dict) -> None:
    """The killed replica is restarted on its devices (a new process) and rejoins: 8
    concurrent requests give one engine's texts and reach it again, both read alive, and
    the counters went on from where they were (the dead process's counts are kept)."""
    client, server, victim = ctx["client"], ctx["server"], ctx["victim"]
    tokens = scrape(server.http)["jaxpaged:prompt_tokens_total"]
    _restarted(client, victim)
    assert victim.process.returncode == -signal.SIGKILL
    before = sent(client)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: complete(server.http, PROMPTS[i], stream=False), range(8)))
    assert texts == ctx["ref"], texts
    delta = [a - b for a, b in zip(sent(client), before, strict=True)]
    assert sum(delta) == 8 and delta[victim.rank] > 0, f"requests per replica: {delta}"
    values = scrape(server.http)
    assert [values[f"jaxpaged:replica_alive{{engine={r}}}"] for r in "01"] == [1, 1], values
    expected = tokens + sum(ctx["ref_prompt_tokens"])
    assert values["jaxpaged:prompt_tokens_total"] == expected, (expected, values)


def check_replica_hang(ctx: dict) -> None:
    """The other replica is frozen (SIGSTOP: hung, not dead) while 4 streams run: within
    the health-check period the client stops routing to it and its open streams fail,
    naming it and the health check (none hangs); it is killed, requests meanwhile go to the
    first, and its restart begins."""
    client, server = ctx["client"], ctx["server"]
    victim = client.replicas[1 - ctx["affinity_rank"]]
    other = client.replicas[ctx["affinity_rank"]]
    threads, results = _long_streams(server.http, 4)
    on_victim = len(victim.streams)
    assert on_victim >= 1, f"no stream on replica {victim.rank}"
    held = _hold_restarts(client)
    stopped = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    while victim.alive and time.time() < stopped + PERIOD + 30:
        time.sleep(0.02)
    detected = time.time() - stopped
    assert not victim.alive, "a frozen replica was not detected"
    assert detected < PERIOD + 1.5, f"detected after {detected:.1f} s (period {PERIOD} s)"
    failed = _failed(results, on_victim, 10)
    assert len(failed) == on_victim, f"{on_victim} streams on the victim, results: {results}"
    name = f"data-parallel replica {victim.rank}"
    assert all(name in str(r) and "health check" in str(r) for r in failed), failed
    assert victim.process.wait(10) == -signal.SIGKILL  # a stopped process ends too
    try:
        _served_during_restart(ctx, victim, other)
    finally:
        held.set()
    _join(threads)
    # its restart begins; that one rejoins and serves was shown by check_replica_restart
    # (the same path), so the run ends without waiting for it
    deadline = time.time() + 10
    while victim.rank not in client._restarting and client.replicas[victim.rank] is victim:
        assert time.time() < deadline, "the hung replica's restart did not begin"
        time.sleep(0.02)


CHECKS = {
    "offline": check_offline,
    "server": check_server,
    "metrics": check_metrics,
    "affinity": check_affinity,
    "replica_death": check_replica_death,
    "replica_restart": check_replica_restart,
    "replica_hang": check_replica_hang,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ctx: dict = {"model": os.path.join(args.workdir, "tiny")}
    results: dict[str, str] = {}
    try:
        write_tiny_llama(ctx["model"])
        ctx["ref"], ctx["ref_prompt_tokens"], ctx["ref_sleep_bytes"] = reference(ctx["model"])
    except Exception:  # noqa: BLE001
        results = {name: "setup failed:\n" + traceback.format_exc() for name in CHECKS}
    else:
        for name, check in CHECKS.items():
            start = time.time()
            try:
                check(ctx)
                results[name] = "ok"
            except Exception:  # noqa: BLE001
                results[name] = traceback.format_exc()
            print(f"{name}: {results[name][:200]} ({time.time() - start:.1f} s)", flush=True)
    if "server" in ctx:
        ctx["server"].stop()
    if "llm" in ctx:
        ctx["llm"].close()
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
