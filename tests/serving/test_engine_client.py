"""The fake engine implements ``EngineClient`` member by member (so it cannot drift from the
protocol again) and keeps the output contract of ``jaxpaged.outputs``: DELTA outputs carry
only what is new, FINAL_ONLY gives one complete output, abort is processed asynchronously
and ends the stream with "abort", a dead engine raises the protocol's EngineDeadError.

``assert_implements_engine_client`` is meant for any engine (e.g. the real AsyncEngine)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest
from fakes import FakeAsyncEngine, expected_logprob, expected_text

from jaxpaged.engine.protocol import EngineClient, EngineDeadError, EngineStats, PoolingClient
from jaxpaged.engine.protocol_check import assert_implements, protocol_members
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


# ---- the protocol check ---------------------------------------------------------------------
def engine_client_members() -> dict[str, object]:
    """EngineClient's members as the protocol declares them: name -> property or function."""
    return protocol_members(EngineClient)


def assert_implements_engine_client(obj_or_cls: object) -> None:
    """Fails, naming every problem, unless `obj_or_cls` (a class, or an instance when some
    protocol properties are plain instance attributes) has each ``EngineClient`` member:
    properties as properties, methods async exactly where the protocol's are, with the
    protocol's parameter names, kinds, positions and defaults (``output_kind`` keyword-only,
    defaulting to DELTA)."""
    assert_implements(EngineClient, obj_or_cls)


def test_the_protocol_has_the_members_the_check_covers():
    assert set(engine_client_members()) == {
        "tokenizer", "model_config", "max_model_len", "engine_config", "dead_error", "errored",
        "start", "shutdown", "add_request", "abort", "get_stats",
        "list_loras", "add_lora", "remove_lora", "is_sleeping", "sleep", "wake_up",
        "update_weights_from",
    }  # fmt: skip


def test_fake_engine_implements_engine_client():
    assert_implements_engine_client(FakeAsyncEngine)
    engine = FakeAsyncEngine()
    assert_implements_engine_client(engine)
    assert isinstance(engine, EngineClient)


class _NoOutputKind(FakeAsyncEngine):
    async def add_request(self, request_id, prompt, params):
        raise NotImplementedError


class _PositionalOutputKind(FakeAsyncEngine):
    async def add_request(self, request_id, prompt, params, output_kind=DELTA):
        raise NotImplementedError


class _FinalOnlyByDefault(FakeAsyncEngine):
    async def add_request(self, request_id, prompt, params, *, output_kind=FINAL_ONLY):
        raise NotImplementedError


class _SyncAbort(FakeAsyncEngine):
    def abort(self, request_id):
        raise NotImplementedError


class _RenamedParameter(FakeAsyncEngine):
    async def abort(self, rid):
        raise NotImplementedError


class _RequiredExtra(FakeAsyncEngine):
    def get_stats(self, detailed):
        raise NotImplementedError


class _AttributeNotProperty(FakeAsyncEngine):
    errored = False


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_NoOutputKind, "add_request: no parameter 'output_kind'"),
        (_PositionalOutputKind, "'output_kind' is positional or keyword"),
        (_FinalOnlyByDefault, "'output_kind' defaults to"),
        (_SyncAbort, "abort: must be async def"),
        (_RenamedParameter, "abort: no parameter 'request_id'"),
        (_RequiredExtra, "get_stats: extra parameter 'detailed' has no default"),
        (_AttributeNotProperty, "errored: must be a property"),
    ],
)
def test_the_check_catches_drift(cls, message):
    with pytest.raises(AssertionError, match=message):
        assert_implements_engine_client(cls)


# ---- the fake's output contract -------------------------------------------------------------
def _run(coro_fn, engine: FakeAsyncEngine):
    """Runs coro_fn(engine) on a fresh loop with the engine started and shut down."""

    async def main():
        engine.start()
        try:
            return await coro_fn(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def _drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


PROMPT = [70, 71, 72]


def test_delta_outputs_carry_only_what_is_new():
    engine = FakeAsyncEngine(interleave=True, tokens_per_step=2)
    params = SamplingParams(n=2, max_tokens=5, logprobs=1, temperature=1.0)

    async def go(engine):
        return await _drain(await engine.add_request("r", PROMPT, params))

    outs = _run(go, engine)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(o.prompt_token_ids == tuple(PROMPT) and o.metrics for o in outs)
    assert any(len(o.outputs) == 1 for o in outs)  # the samples took turns
    for j in (0, 1):
        deltas = [c for o in outs for c in o.outputs if c.index == j]
        assert "".join(c.text for c in deltas) == expected_text(PROMPT, 5, j)
        ids = [t for c in deltas for t in c.token_ids]
        assert ids == [ord(ch) for ch in expected_text(PROMPT, 5, j)]
        lps = [lp.logprob for c in deltas for lp in c.logprobs]
        assert lps == [expected_logprob(i) for i in range(5)]
        assert [c.finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
        assert max(len(c.token_ids) for c in deltas) == 2  # several tokens in one delta
    # sample 0 finished in an output before the request's last one
    assert all(c.index == 1 for c in outs[-1].outputs)


def test_delta_without_logprobs_has_none():
    async def go(engine):
        return await _drain(await engine.add_request("r", PROMPT, SamplingParams(max_tokens=3)))

    outs = _run(go, FakeAsyncEngine())
    assert len(outs) == 3 and all(c.logprobs is None for o in outs for c in o.outputs)


def test_final_only_is_one_complete_output():
    params = SamplingParams(n=2, max_tokens=4, logprobs=0, temperature=1.0)

    async def go(engine):
        return await _drain(await engine.add_request("r", PROMPT, params, output_kind=FINAL_ONLY))

    engine = FakeAsyncEngine(interleave=True)
    (out,) = _run(go, engine)
    assert out.finished and engine.steps > 1
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert c.text == expected_text(PROMPT, 4, c.index)
        assert [lp.logprob for lp in c.logprobs] == [expected_logprob(i) for i in range(4)]
        assert c.finish_reason == "length"


@pytest.mark.parametrize("kind", [DELTA, FINAL_ONLY])
def test_abort_is_processed_by_the_engine_then_ends_the_stream(kind):
    engine = FakeAsyncEngine(step_delay=0.01)
    params = SamplingParams(n=2, max_tokens=200, temperature=1.0)

    async def go(engine):
        free0 = engine.get_stats().num_free_blocks
        stream = await engine.add_request("r", PROMPT, params, output_kind=kind)
        while engine.get_stats().generation_tokens_total < 6:
            await asyncio.sleep(0.005)
        await engine.abort("r")
        assert engine.aborted == []  # fire-and-forget: not processed yet
        outs = await _drain(stream)
        return outs, free0, engine.get_stats().num_free_blocks

    outs, free0, free1 = _run(go, engine)
    assert engine.aborted == ["r"] and free1 == free0
    last = outs[-1]
    assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
    assert [c.index for c in last.outputs] == [0, 1]
    if kind is FINAL_ONLY:
        assert len(outs) == 1 and all(len(c.token_ids) >= 3 for c in last.outputs)


def test_abort_of_an_unknown_request_is_ignored():
    async def go(engine):
        await engine.abort("nope")
        stream = await engine.add_request("r", PROMPT, SamplingParams(max_tokens=2))
        return await _drain(stream)

    engine = FakeAsyncEngine()
    outs = _run(go, engine)
    assert outs[-1].finished and engine.aborted == ["nope"]


def test_dead_engine_raises_the_protocols_error():
    async def go(engine):
        stream = await engine.add_request("r", PROMPT, SamplingParams(max_tokens=200))
        await stream.__anext__()
        engine.kill(RuntimeError("device lost"))
        with pytest.raises(EngineDeadError, match="device lost"):
            await _drain(stream)
        with pytest.raises(EngineDeadError):
            await engine.add_request("s", PROMPT, SamplingParams(max_tokens=2))
        return engine.errored, engine.dead_error

    errored, dead = _run(go, FakeAsyncEngine())
    assert errored and str(dead) == "device lost"


def test_add_request_validates():
    async def go(engine):
        for args, kw, word in [
            (("r", "", SamplingParams()), {}, "prompt"),
            (("r", PROMPT, SamplingParams(max_tokens=300)), {}, "max_tokens"),
            (("r", PROMPT, SamplingParams()), {"output_kind": "delta"}, "output_kind"),
            (("", PROMPT, SamplingParams()), {}, "request_id"),
        ]:
            with pytest.raises(ValueError, match=word):
                await engine.add_request(*args, **kw)

    _run(go, FakeAsyncEngine())


def test_stats_are_the_engines_stats_type_with_every_field_filled():
    async def go(engine):
        await _drain(await engine.add_request("r", PROMPT, SamplingParams(max_tokens=4)))
        return engine.get_stats()

    stats = _run(go, FakeAsyncEngine())
    assert type(stats) is EngineStats
    values = dataclasses.asdict(stats)
    assert all(v is not None for v in values.values())
    assert stats.num_steps == 4 and stats.generation_tokens_total == 4
    assert stats.prompt_tokens_total == 3 and stats.num_free_blocks == stats.num_kv_blocks
    assert 0.0 < stats.kv_cache_waste < 1.0


def test_the_real_async_engine_implements_the_protocol():
    from jaxpaged.engine.async_engine import AsyncEngine

    assert_implements_engine_client(AsyncEngine)


def test_the_pooling_engine_implements_the_pooling_protocol():
    from jaxpaged.engine.async_pooling import AsyncPoolingEngine

    assert_implements(PoolingClient, AsyncPoolingEngine)


def test_the_fake_device_behind_the_real_async_engine_is_a_device_runner():
    from fake_llm_engine import _LetterRunner

    from jaxpaged.engine.core import DeviceRunner

    assert_implements(DeviceRunner, _LetterRunner)


def _engine_uses_in_the_servers() -> tuple[set[str], list[str], list[str]]:
    """(the members the servers' code reads as ``<...>engine.<member>``, those reads of
    members EngineClient lacks, every getattr / hasattr / callable applied to an engine),
    the last two as "file:line: code"."""
    import ast
    import pathlib

    import jaxpaged.serving

    members, probes = [], []
    for path in sorted(pathlib.Path(jaxpaged.serving.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)}"
            if isinstance(node, ast.Attribute):
                owner = ast.unparse(node.value)
                if owner == "engine" or owner.endswith(".engine"):
                    members.append((node.attr, where))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "callable")
                and "engine" in ast.unparse(node.args[0])
            ):
                probes.append(where)
    known = set(engine_client_members()) | set(protocol_members(PoolingClient))
    used = {attr for attr, _ in members}
    return used, [where for attr, where in members if attr not in known], probes


def test_the_servers_use_only_the_protocol_and_probe_nothing():
    """Whatever a server reads of its engine is an EngineClient (or PoolingClient) member (so the fakes, which
    implement the protocol, exercise every feature), and no server looks a member up by
    name or asks whether the engine has one."""
    used, outside, probes = _engine_uses_in_the_servers()
    assert {"add_request", "abort", "tokenizer", "sleep", "list_loras"} <= used  # it looks
    assert outside == [] and probes == []
