"""The Responses API and Anthropic's Messages API against the fake engine: hostile inputs get
each API's own error shape and status (and the server keeps serving), the response store
evicts the least recently used."""

from __future__ import annotations

import httpx
import openai
import pytest
from fakes import FakeAsyncEngine
from harness import ServerThread

from jaxpaged.serving.response_store import ResponseStore, StoredResponse


@pytest.fixture(scope="module")
def fake(request):
    server = ServerThread(
        FakeAsyncEngine(max_model_len=256, max_num_seqs=4), responses_store_size=2
    )
    request.addfinalizer(server.stop)
    return server


def _post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(server.http + path, json=body, headers=headers, timeout=30)


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                     "arguments": "{oops"}]}, "input.0.arguments"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
        ({"input": "x", "tools": [{**TOOL, "parameters": "an object"}]}, "tools.0"),
        ({"input": "x", "tools": [TOOL, TOOL], "tool_choice": "required"}, "tools"),
        ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}},
         "tool_choice"),
        ({"input": "x", "colour": "red"}, "colour"),
        ({"input": "x", "max_output_tokens": "10"}, "max_output_tokens"),
        ({"input": "x" * 400}, None),  # longer than max_model_len
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
         "text.format"),
    ],
)  # fmt: skip
def test_responses_hostile_inputs_get_400(fake, body, param):
    r = _post(fake, "/v1/responses", {"model": "test-model", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert param in err["param"]
    ok = _post(fake, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "store": False})
    assert ok.status_code == 200 and ok.json()["status"] == "incomplete"


def test_responses_store_is_bounded_and_lru(fake):
    client = openai.OpenAI(base_url=fake.http + "/v1", api_key="x", max_retries=0)
    ids = [
        client.responses.create(model="test-model", input=f"q{i}", max_output_tokens=2).id
        for i in range(2)
    ]
    client.responses.retrieve(ids[0])  # ids[1] is now the least recently used
    ids.append(client.responses.create(model="test-model", input="q2", max_output_tokens=2).id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    assert client.responses.retrieve(ids[0]).id == ids[0]
    client.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(ids[0])
    with pytest.raises(openai.BadRequestError, match="completed|incomplete"):
        client.responses.cancel(ids[2])


def test_store_keeps_running_responses_beyond_capacity():
    store = ResponseStore(1)
    for rid in ("a", "b"):
        store.start(rid, StoredResponse({"id": rid}, [], rid))
    assert len(store) == 2 and store.running("a")
    store.finish("a", {"id": "a", "status": "completed"}, [])
    store.finish("b", {"id": "b", "status": "completed"}, [])
    assert store.get("a") is None and store.get("b").body["status"] == "completed"


def test_readme_names_every_refused_field():
    from pathlib import Path

    from jaxpaged.serving import anthropic_protocol, responses_protocol

    text = (Path(__file__).parents[2] / "serving" / "README.md").read_text()
    for module in (anthropic_protocol, responses_protocol):
        assert all(f"`{name}`" in text for name in module.REFUSED_FIELDS)


USER = [{"role": "user", "content": "hi"}]
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                     "input": {}}]}]},
        {"messages": [*USER, {"role": "assistant", "content": "Sure"}]},  # prefill
        {"messages": []},
        {"messages": USER, "colour": "red"},
        {"messages": USER, "mcp_servers": [{"url": "x"}]},
        {"messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"messages": USER, "tools": [{"name": "f"}]},  # no input_schema
        {"messages": USER, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool"}},
        {"messages": USER, "thinking": {"type": "enabled", "budget_tokens": 2048}},
        {"messages": [{"role": "user", "content": "x" * 400}]},  # longer than max_model_len
        {"messages": USER, "max_tokens": "5"},
        {"messages": USER, "output_config": {"format": {"type": "regex"}}},
    ],
)  # fmt: skip
def test_anthropic_hostile_inputs_get_400_in_anthropics_shape(fake, body):
    r = _post(fake, "/v1/messages", {"model": "test-model", "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"]
    ok = _post(fake, "/v1/messages", {"model": "test-model", "max_tokens": 3, "messages": USER})
    assert ok.status_code == 200 and ok.json()["stop_reason"] == "max_tokens"


def test_anthropic_api_key_and_unknown_model(server_factory):
    anthropic = pytest.importorskip("anthropic")
    server = server_factory(FakeAsyncEngine(max_model_len=256), api_key="sekrit")

    def client(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=server.http, api_key=key, max_retries=0)

    m = client("sekrit").messages.create(model="test-model", max_tokens=2, messages=USER)
    assert m.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as e:
        client("wrong").messages.create(model="test-model", max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="does not exist"):
        client("sekrit").messages.count_tokens(model="claude-9", messages=USER)


def test_responses_text_format_reaches_the_engine_strict_or_not(fake):
    from jaxpaged.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for strict in (None, False):
        fmt = {"type": "json_schema", "name": "s", "schema": schema, "strict": strict}
        r = _post(fake, "/v1/responses", {"input": "q", "max_output_tokens": 2, "store": False,
                                          "text": {"format": fmt}})  # fmt: skip
        assert r.status_code == 200, r.text
        got = fake.engine.added[-1][2].structured_output
        assert got == StructuredOutput(json=schema, strict=strict is None)
