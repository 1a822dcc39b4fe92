"""The fake engine implements ``EngineClient`` member by member (so it cannot drift from the
protocol again) and keeps the output contract of ``jaxpaged.outputs``: DELTA outputs carry
only what is new, FINAL_ONLY gives one complete output, abort is processed asynchronously
and ends the stream with "abort", a dead engine raises the protocol's EngineDeadError.

``assert_implements_engine_client`` is meant for any engine (e.g. the real AsyncEngine)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import AsyncIterator

import pytest
from fakes import FakeAsyncEngine, expected_logprob, expected_text

from jaxpaged.engine.protocol import EngineClient, EngineDeadError, EngineStats
from jaxpaged.outputs import RequestOutput, RequestOutputKind
from jaxpaged.sampling_params import SamplingParams

DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


# ---- the protocol check ---------------------------------------------------------------------
def engine_client_members() -> dict[str, object]:
    """EngineClient's members as the protocol declares them: name -> property or function."""
    return {name: v for name, v in vars(EngineClient).items() if not name.startswith("_")}


def _property_problems(obj: object, cls: type, name: str) -> list[str]:
    got = inspect.getattr_static(cls, name, None)
    if isinstance(got, property):
        return []
    if not isinstance(obj, type) and name in getattr(obj, "__dict__", {}):
        return []  # a plain instance attribute also satisfies a protocol property
    return [f"{name}: must be a property (or, checking an instance, an attribute)"]


def _parameter_problems(name: str, want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """Every protocol parameter exists with the same name, kind, position (if positional)
    and default; any extra parameter of the implementation is optional."""
    problems = []
    want_params = [p for p in want.parameters.values() if p.name != "self"]
    got_params = {p.name: p for p in got.parameters.values() if p.name != "self"}
    got_order = [p.name for p in got.parameters.values() if p.name != "self"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(want_params):
        q = got_params.get(p.name)
        if q is None:
            problems.append(f"{name}: no parameter {p.name!r}")
            continue
        if q.kind != p.kind:
            problems.append(f"{name}: parameter {p.name!r} is {q.kind.description}, "
                            f"the protocol's is {p.kind.description}")  # fmt: skip
        elif p.kind in positional and got_order.index(p.name) != i:
            problems.append(f"{name}: parameter {p.name!r} is not at position {i}")
        if p.default is not inspect.Parameter.empty and q.default != p.default:
            problems.append(f"{name}: parameter {p.name!r} defaults to {q.default!r}, "
                            f"the protocol's to {p.default!r}")  # fmt: skip
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for q in got_params.values():
        extra = q.name not in {p.name for p in want_params}
        if extra and q.kind not in variadic and q.default is inspect.Parameter.empty:
            problems.append(f"{name}: extra parameter {q.name!r} has no default")
    return problems


def _method_problems(cls: type, name: str, want: object) -> list[str]:
    got = inspect.getattr_static(cls, name, None)
    if got is None:
        return [f"{name}: missing"]
    if isinstance(got, (staticmethod, classmethod)) or not inspect.isfunction(got):
        return [f"{name}: must be a plain method, got {type(got).__name__}"]
    if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
        how = "async def" if inspect.iscoroutinefunction(want) else "def (not async)"
        return [f"{name}: must be {how}"]
    return _parameter_problems(name, inspect.signature(want), inspect.signature(got))


def assert_implements_engine_client(obj_or_cls: object) -> None:
    """Fails, naming every problem, unless `obj_or_cls` (a class, or an instance when some
    protocol properties are plain instance attributes) has each ``EngineClient`` member:
    properties as properties, methods async exactly where the protocol's are, with the
    protocol's parameter names, kinds, positions and defaults (``output_kind`` keyword-only,
    defaulting to DELTA)."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    problems = []
    for name, want in engine_client_members().items():
        if isinstance(want, property):
            problems += _property_problems(obj_or_cls, cls, name)
        else:
            problems += _method_problems(cls, name, want)
    assert not problems, f"{cls.__name__} does not implement EngineClient:\n  " + "\n  ".join(
        problems
    )


def test_the_protocol_has_the_members_the_check_covers():
    assert set(engine_client_members()) == {
        "tokenizer", "model_config", "max_model_len", "engine_config", "dead_error", "errored",
        "start", "shutdown", "add_request", "abort", "get_stats",
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
