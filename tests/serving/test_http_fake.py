"""The OpenAI-compatible HTTP API against the fake engine: the real `openai` client, raw
SSE, every bad-input case, auth, overload, disconnect -> abort, engine failure, /metrics."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import openai
import pytest
from fakes import (
    VOCAB,
    FakeAsyncEngine,
    FakeTokenizer,
    expected_logprob,
    expected_text,
    wait_until,
)
from harness import ServerThread

from jaxpaged.outputs import RequestOutputKind


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _chat_ids(messages: list[dict]) -> list[int]:
    return FakeTokenizer().apply_chat_template(messages, tokenize=True)["input_ids"]


@pytest.fixture(scope="module")
def fake_server(request):
    server = ServerThread(FakeAsyncEngine(max_model_len=64, max_num_seqs=4))
    request.addfinalizer(server.stop)
    return server


@pytest.fixture(scope="module")
def interleaved(request):
    """Samples take turns (an output holds one sample) and a delta holds up to 2 tokens."""
    server = ServerThread(FakeAsyncEngine(max_model_len=64, interleave=True, tokens_per_step=2))
    request.addfinalizer(server.stop)
    return server


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.http + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw
    )


def test_completion_and_chat_with_openai_client(fake_server):
    client = _client(fake_server)
    r = client.completions.create(model="test-model", prompt="Hello", max_tokens=7)
    assert r.choices[0].text == expected_text(_ids("Hello"), 7)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == 12

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    c = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=5)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == expected_text(_chat_ids(msgs), 5)
    assert c.usage.prompt_tokens == len(_chat_ids(msgs))
    assert [m.id for m in client.models.list().data] == ["test-model"]


def test_streaming_with_openai_client(fake_server):
    client = _client(fake_server)
    stream = client.completions.create(
        model="test-model",
        prompt="abc",
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    assert text == expected_text(_ids("abc"), 9)
    assert finish == "length"
    assert usage.completion_tokens == 9 and usage.prompt_tokens == 3

    msgs = [{"role": "user", "content": "Stream please"}]
    stream = client.chat.completions.create(
        model="test-model", messages=msgs, max_tokens=6, stream=True
    )
    roles, content, finish = [], "", None
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert roles == ["assistant"]
    assert content == expected_text(_chat_ids(msgs), 6)
    assert finish == "length"


def test_sse_wire_format_ends_with_done(fake_server):
    body = {"model": "test-model", "prompt": "xy", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", fake_server.http + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(_ids("xy"), 4)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_n_logprobs_and_several_prompts(fake_server):
    client = _client(fake_server)
    r = client.completions.create(
        model="test-model", prompt=["ab", "cde"], n=2, max_tokens=3, logprobs=1, temperature=0.7
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt, j = (["ab", "cde"][c.index // 2], c.index % 2)
        assert c.text == expected_text(_ids(prompt), 3, j)
        assert c.logprobs.tokens == list(c.text)
        assert c.logprobs.token_logprobs == [-0.5, -1.0, -1.5]
        assert len(c.logprobs.top_logprobs) == 3 and all(
            len(t) == 2 for t in c.logprobs.top_logprobs
        )
        assert c.logprobs.text_offset == [0, 1, 2]
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5

    # token-id prompt and chat logprobs
    r = client.completions.create(model="test-model", prompt=[70, 71], max_tokens=2)
    assert r.choices[0].text == expected_text([70, 71], 2)
    msgs = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(
        model="test-model", messages=msgs, max_tokens=2, logprobs=True, top_logprobs=2
    )
    lp = c.choices[0].logprobs.content
    assert [t.token for t in lp] == list(expected_text(_chat_ids(msgs), 2))
    assert [t.logprob for t in lp] == [-0.5, -1.0]
    assert len(lp[0].top_logprobs) == 2


BAD_COMPLETIONS = [
    (b"{not json", "malformed JSON"),
    (b"", "body is empty"),
    (b"[1, 2]", "body"),
    ({"model": "test-model"}, "prompt"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": 0}, "top_k"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 1000}, "n"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "seed": "x"}, "seed"),
    ({"prompt": "a", "logprobs": 10}, "logprobs"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a" * 64}, "prompt"),
    ({"prompt": "a" * 60, "max_tokens": 10}, "max_tokens"),
    ({"prompt": [1, VOCAB + 5]}, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, "model"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logit_bias": {"5": -101.0}}, "logit_bias"),
    ({"prompt": "a", "ignore_eos": "no"}, "ignore_eos"),
]


@pytest.mark.parametrize(("body", "field"), BAD_COMPLETIONS)
def test_bad_completion_requests_get_400_naming_the_field(fake_server, body, field):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        fake_server.http + "/v1/completions",
        timeout=30,
        headers={"content-type": "application/json"},
        **kw,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == 400


BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
        "logprobs",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 80}]}, "prompt"),
]


@pytest.mark.parametrize(("body", "field"), BAD_CHATS)
def test_bad_chat_requests_get_400_naming_the_field(fake_server, body, field):
    r = httpx.post(fake_server.http + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_openai_client_raises_bad_request(fake_server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _client(fake_server).completions.create(model="test-model", prompt="a", temperature=-2)
    # the server keeps serving
    r = _client(fake_server).completions.create(model="test-model", prompt="a", max_tokens=2)
    assert r.choices[0].text == expected_text(_ids("a"), 2)


def test_api_key(server_factory):
    server = server_factory(FakeAsyncEngine(), api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        _client(server, api_key="wrong").completions.create(
            model="test-model", prompt="a", max_tokens=1
        )
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "a"}, timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.http + "/v1/models", timeout=30).status_code == 401
    ok = _client(server, api_key="s3cret").completions.create(
        model="test-model", prompt="a", max_tokens=1
    )
    assert ok.choices[0].text == expected_text(_ids("a"), 1)
    assert httpx.get(server.http + "/health", timeout=30).status_code == 200  # health is open


def test_queue_full_gives_429(server_factory):
    engine = FakeAsyncEngine(max_num_seqs=1, step_delay=0.02)
    server = server_factory(engine, max_queue_len=2)
    body = {"prompt": "a", "max_tokens": 200, "stream": True}
    # the first request runs (it has produced a token); two more wait; the fourth is refused
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=30) as first:
        lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        threads = [
            threading.Thread(
                target=lambda: httpx.post(
                    server.http + "/v1/completions",
                    json={"prompt": "b", "max_tokens": 2},
                    timeout=60,
                )
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        assert wait_until(lambda: server.frontend.num_queued == 2)
        r = httpx.post(
            server.http + "/v1/completions", json={"prompt": "c", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 429
        assert "max-queue-len" in r.json()["error"]["message"]
    # closing the first stream aborted it; the waiting ones then finish
    for t in threads:
        t.join(30)
    assert wait_until(lambda: server.frontend.num_in_flight == 0)
    assert "rejected" in httpx.get(server.http + "/metrics", timeout=30).text


def test_disconnect_aborts_and_frees_blocks(server_factory):
    engine = FakeAsyncEngine(step_delay=0.01, num_kv_blocks=64)
    server = server_factory(engine)
    free0 = engine.get_stats().num_free_blocks
    engine.hold_after(2)
    body = {"prompt": "abcd", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.http + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        rid = json.loads(next(x for x in lines if x.startswith("data:"))[5:])["id"]
        assert engine.get_stats().num_free_blocks < free0
    assert wait_until(lambda: rid in engine.aborted)
    assert wait_until(lambda: engine.get_stats().num_free_blocks == free0)
    assert server.frontend.num_in_flight == 0

    # non-streaming: the client gives up (timeout) -> abort
    n_aborted = len(engine.aborted)
    engine.hold_after(2)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.http + "/v1/completions", json={"prompt": "q", "max_tokens": 200}, timeout=0.3
        )
    assert wait_until(lambda: len(engine.aborted) > n_aborted)
    assert wait_until(lambda: engine.get_stats().num_free_blocks == free0)


def test_engine_failure_gives_500_then_503(server_factory):
    engine = FakeAsyncEngine(step_delay=0.01)
    server = server_factory(engine)
    assert httpx.get(server.http + "/health", timeout=30).status_code == 200
    # data-parallel replicas down while others serve: still 200, naming them
    from jaxpaged.engine.protocol import ReplicaStats

    def replica(alive: bool, given_up: bool = False) -> ReplicaStats:
        return ReplicaStats(alive=alive, num_running=0, num_waiting=0, kv_cache_usage=0.0,
                            requests_total=0, given_up=given_up)  # fmt: skip

    stats = engine.get_stats
    replicas = (replica(True), replica(False), replica(False, given_up=True))
    engine.get_stats = lambda: dataclasses.replace(stats(), replicas=replicas)
    r = httpx.get(server.http + "/health", timeout=30)
    assert r.status_code == 200
    assert r.json() == {"status": "degraded", "replicas_down": [1, 2], "replicas_given_up": [2]}
    engine.get_stats = stats
    results = {}

    def nonstream() -> None:
        results["r"] = httpx.post(
            server.http + "/v1/completions", json={"prompt": "a", "max_tokens": 200}, timeout=60
        )

    t = threading.Thread(target=nonstream)
    t.start()
    with httpx.stream(
        "POST",
        server.http + "/v1/completions",
        json={"prompt": "b", "max_tokens": 200, "stream": True},
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        next(lines)
        assert wait_until(lambda: server.frontend.num_in_flight == 2)
        server.call(lambda: engine.kill(RuntimeError("boom")))
        rest = [x for x in lines if x]
    t.join(30)
    assert results["r"].status_code == 500
    assert "engine failed" in results["r"].json()["error"]["message"]
    assert rest[-1] == "data: [DONE]"
    assert "error" in json.loads(rest[-2][len("data: ") :])
    assert httpx.get(server.http + "/health", timeout=30).status_code == 503
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "a"}, timeout=30)
    assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
    assert httpx.get(server.http + "/metrics", timeout=30).status_code == 200


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_metrics_move(fake_server):
    m0 = httpx.get(fake_server.http + "/metrics", timeout=30).text
    for name in (
        "jaxpaged:num_requests_running",
        "jaxpaged:num_requests_waiting",
        "jaxpaged:kv_cache_usage_perc",
        "jaxpaged:num_preemptions_total",
        "jaxpaged:prefix_cache_hits_total",
        "jaxpaged:prefix_cache_queries_total",
        "jaxpaged:kv_offload_hits_total",
        "jaxpaged:kv_offload_stored_blocks_total",
        "jaxpaged:kv_offload_loaded_blocks_total",
        "jaxpaged:kv_offload_stored_bytes_total",
        "jaxpaged:kv_offload_loaded_bytes_total",
        "jaxpaged:kv_offload_blocks",
        "jaxpaged:kv_offload_capacity_blocks",
        "jaxpaged:prompt_tokens_total",
        "jaxpaged:generation_tokens_total",
        "jaxpaged:time_to_first_token_seconds_count",
        "jaxpaged:inter_token_latency_seconds_count",
        "jaxpaged:e2e_request_latency_seconds_count",
        "jaxpaged:request_queue_time_seconds_count",
    ):
        _metric(m0, name)
    _client(fake_server).completions.create(model="test-model", prompt="abc", max_tokens=5)
    m1 = httpx.get(fake_server.http + "/metrics", timeout=30).text
    assert (
        _metric(m1, "jaxpaged:generation_tokens_total")
        - _metric(m0, "jaxpaged:generation_tokens_total")
        == 5
    )
    assert (
        _metric(m1, "jaxpaged:prompt_tokens_total") - _metric(m0, "jaxpaged:prompt_tokens_total")
        == 3
    )
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert (
            _metric(m1, f"jaxpaged:{h}_seconds_count")
            == _metric(m0, f"jaxpaged:{h}_seconds_count") + 1
        )
    assert (
        _metric(m1, "jaxpaged:inter_token_latency_seconds_count")
        >= _metric(m0, "jaxpaged:inter_token_latency_seconds_count") + 4
    )


def _sse_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON objects of a streamed response (which must end with [DONE])."""
    with httpx.stream("POST", server.http + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def _outputs_of(engine: FakeAsyncEngine, request_id_prefix: str) -> dict[str, list]:
    """The outputs the engine sent, by request id, for ids starting with the prefix."""
    by_id: dict[str, list] = {}
    for out in engine.outputs:
        if out.request_id.startswith(request_id_prefix):
            by_id.setdefault(out.request_id, []).append(out)
    return by_id


def test_interleaved_n2_completion_stream_reassembles_with_offsets_and_usage(interleaved):
    """Two prompts x n=2, samples taking turns, several tokens per delta: each choice's
    chunks concatenate to its text, its logprobs' text offsets continue across chunks, each
    ends with one finish_reason, and usage counts every token."""
    m0 = httpx.get(interleaved.http + "/metrics", timeout=30).text
    body = {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 5, "logprobs": 1, "temperature": 0.7,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = _sse_chunks(interleaved, "/v1/completions", body)
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    assert usage["usage"]["prompt_tokens"] == 5 and usage["usage"]["total_tokens"] == 25
    assert all(len(c["choices"]) == 1 for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert {c["index"] for c in choices} == {0, 1, 2, 3}
    for index in range(4):
        mine = [c for c in choices if c["index"] == index]
        prompt, j = ["ab", "cde"][index // 2], index % 2
        text = "".join(c["text"] for c in mine)
        assert text == expected_text(_ids(prompt), 5, j)
        sent = 0
        for c in mine:
            assert c["logprobs"]["text_offset"] == list(range(sent, sent + len(c["text"])))
            sent += len(c["text"])
        lps = [lp for c in mine for lp in c["logprobs"]["token_logprobs"]]
        assert lps == [expected_logprob(i) for i in range(5)]
        assert "".join(t for c in mine for t in c["logprobs"]["tokens"]) == text
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert any(len(c["text"]) == 2 for c in choices)  # a delta of two tokens
    sent = _outputs_of(interleaved.engine, usage["id"])
    assert len(sent) == 2 and all(len(o.outputs) == 1 for outs in sent.values() for o in outs)
    assert len(chunks) == sum(len(outs) for outs in sent.values())  # one chunk per delta
    m1 = httpx.get(interleaved.http + "/metrics", timeout=30).text
    success = 'jaxpaged:request_success_total{finished_reason="length"}'
    before = _metric(m0, success) if success in m0 else 0.0
    assert _metric(m1, success) - before == 4  # one per sample
    e2e = "jaxpaged:e2e_request_latency_seconds_count"
    assert _metric(m1, e2e) - _metric(m0, e2e) == 2


def test_interleaved_n2_chat_stream_reassembles(interleaved):
    msgs = [{"role": "user", "content": "two"}]
    body = {"messages": msgs, "n": 2, "max_tokens": 5, "temperature": 0.7, "logprobs": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    *chunks, usage = _sse_chunks(interleaved, "/v1/chat/completions", body)
    assert usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["prompt_tokens"] == len(_chat_ids(msgs))
    choices = [c["choices"][0] for c in chunks]
    for j in (0, 1):
        mine = [c for c in choices if c["index"] == j]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum("role" in c["delta"] for c in mine) == 1
        content = "".join(c["delta"].get("content") or "" for c in mine)
        assert content == expected_text(_chat_ids(msgs), 5, j)
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert "".join(t["token"] for t in tokens) == content
        assert [t["logprob"] for t in tokens] == [expected_logprob(i) for i in range(5)]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in mine) == 1


def test_non_streaming_requests_get_one_final_output(interleaved):
    """A non-streaming response asks for FINAL_ONLY: the engine sends one complete output
    per request, from which text, logprobs (offsets from 0) and usage are built."""
    engine = interleaved.engine
    client = _client(interleaved)
    r = client.completions.create(
        model="test-model", prompt=["ab", "cde"], n=2, max_tokens=5, logprobs=1, temperature=0.7
    )
    sent = _outputs_of(engine, r.id)
    assert sorted(len(outs) for outs in sent.values()) == [1, 1]
    assert all(outs[0].finished and len(outs[0].outputs) == 2 for outs in sent.values())
    kinds = {rid: kind for rid, _, _, kind in engine.added if rid.startswith(r.id)}
    assert set(kinds.values()) == {RequestOutputKind.FINAL_ONLY} and len(kinds) == 2
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt, j = ["ab", "cde"][c.index // 2], c.index % 2
        assert c.text == expected_text(_ids(prompt), 5, j)
        assert c.logprobs.text_offset == [0, 1, 2, 3, 4]
        assert c.logprobs.token_logprobs == [expected_logprob(i) for i in range(5)]
        assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 5

    msgs = [{"role": "user", "content": "hello"}]
    c = client.chat.completions.create(
        model="test-model", messages=msgs, n=2, max_tokens=3, temperature=0.7
    )
    (outs,) = _outputs_of(engine, c.id).values()
    assert len(outs) == 1 and outs[0].finished
    assert [ch.message.content for ch in c.choices] == [
        expected_text(_chat_ids(msgs), 3, j) for j in (0, 1)
    ]
    assert c.usage.completion_tokens == 6 and c.usage.prompt_tokens == len(_chat_ids(msgs))

    stream = client.completions.create(model="test-model", prompt="a", max_tokens=2, stream=True)
    rid = next(iter(stream)).id
    list(stream)
    assert [k for i, _, _, k in engine.added if i == rid] == [RequestOutputKind.DELTA]


def test_running_non_streaming_requests_are_not_queued(server_factory):
    """A FINAL_ONLY request shows no first token; the queue limit still counts only the
    ones the engine has not scheduled."""
    engine = FakeAsyncEngine(max_num_seqs=2, step_delay=0.01)
    server = server_factory(engine, max_queue_len=1)
    results: list[int] = []

    def post(prompt: str) -> None:
        r = httpx.post(
            server.http + "/v1/completions", json={"prompt": prompt, "max_tokens": 150}, timeout=60
        )
        results.append(r.status_code)

    running = [threading.Thread(target=post, args=(p,)) for p in ("a", "b")]
    for i, t in enumerate(running):  # one at a time: a request not yet scheduled is queued
        t.start()
        assert wait_until(lambda i=i: engine.get_stats().num_running == i + 1)
    assert server.frontend.num_queued == 0
    waiting = threading.Thread(target=post, args=("c",))
    waiting.start()
    assert wait_until(lambda: server.frontend.num_queued == 1)
    r = httpx.post(server.http + "/v1/completions", json={"prompt": "d"}, timeout=30)
    assert r.status_code == 429
    for t in [*running, waiting]:
        t.join(60)
    assert results == [200, 200, 200]
