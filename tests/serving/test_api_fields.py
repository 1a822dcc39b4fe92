"""No request field is silently ignored (HTTP and gRPC), the fields accepted without effect
are documented, logit_bias and echo reach the engine, and vLLM's /tokenize, /detokenize and
/version, all against the fake engine."""

from __future__ import annotations

import json
import pathlib

import grpc
import httpx
import openai
import pytest
from fakes import VOCAB, FakeAsyncEngine, FakeTokenizer, expected_text
from harness import ServerThread

from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.client import build_request
from jaxpaged.serving.protocol import NO_EFFECT_FIELDS, UNSUPPORTED_FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def server(request):
    s = ServerThread(FakeAsyncEngine(max_model_len=256))
    request.addfinalizer(s.stop)
    return s


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.http + path, json=body, timeout=30)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0)


REFUSED = [
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}, "frobnicate", "not a field"),
    ("/v1/completions", {"prompt": "a", "Temperature": 0.5}, "Temperature", "not a field"),
    ("/v1/completions", {"prompt": "a", "suffix": "z"}, "suffix", "not supported"),
    (
        "/v1/completions",
        {"prompt": "a", "guided_json": {}, "guided_regex": "a"},
        "guided_regex",
        "one structured output at a time",
    ),
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, "guided_choice", "at least one"),
    ("/v1/completions", {"prompt": "a", "guided_json": "{"}, "guided_json", "not valid JSON"),
    (
        "/v1/completions",
        {"prompt": "a", "structured_outputs": {"regex": "a", "flavour": 1}},
        "structured_outputs.flavour",
        "not a field",
    ),
    (
        "/v1/completions",
        {"prompt": "a", "guided_decoding_backend": "xgrammar"},
        "guided_decoding_backend",
        "llguidance",
    ),
    (
        "/v1/chat/completions",
        {"messages": MSGS, "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
        "streaming",
    ),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    (
        "/v1/completions",
        {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
        "not a field",
    ),
    ("/v1/chat/completions", {"messages": MSGS, "tools": [TOOL]}, "tool_choice", "--enable-auto"),
    ("/v1/chat/completions", {"messages": MSGS, "tool_choice": "auto"}, "tool_choice", "needs t"),
    (
        "/v1/chat/completions",
        {
            "messages": MSGS,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "not among the tools ['f']",
    ),
    (
        "/v1/chat/completions",
        {"messages": MSGS, "tools": [TOOL], "tool_choice": "required", "guided_regex": "a"},
        "tool_choice",
        "one structured output at a time",
    ),
    ("/v1/chat/completions", {"messages": MSGS, "functions": []}, "functions", "tool_choice"),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ]
        },
        "messages.0.tool_calls.0.function.arguments",
        "not valid JSON",
    ),
    ("/v1/chat/completions", {"messages": MSGS, "store": True}, "store", "not supported"),
    (
        "/v1/chat/completions",
        {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format",
        "schema is required",
    ),
    (
        "/v1/chat/completions",
        {"messages": MSGS, "response_format": {"type": "xml"}},
        "response_format.type",
        "",
    ),
    (
        "/v1/chat/completions",
        {"messages": MSGS, "chat_template_kwargs": {"tokenize": False}},
        "chat_template_kwargs",
        "may not set ['tokenize']",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
        "tool_call_id",
        "only a tool message",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "content": "x"}]},
        "tool_call_id",
        "needs tool_call_id",
    ),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1.0}}, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    (
        "/v1/completions",
        {"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(301)}},
        "logit_bias",
        "at most 300",
    ),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": "yes"}, "add_generation_prompt", ""),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus", "not a field"),
    ("/detokenize", {"tokens": [1, VOCAB]}, "tokens", "vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, "tokens", ""),
]


@pytest.mark.parametrize(("path", "body", "field", "why"), REFUSED)
def test_fields_it_would_not_honour_are_refused_with_400_naming_them(
    server, path, body, field, why
):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and why in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unsupported_fields_through_the_openai_client(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(
            model="test-model",
            messages=MSGS,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    with pytest.raises(openai.BadRequestError, match="guided_whitespace_pattern"):
        client.completions.create(
            model="test-model", prompt="a", extra_body={"guided_whitespace_pattern": " "}
        )


def test_no_effect_fields_and_null_unsupported_ones_are_accepted(server):
    """The documented no-effect fields change nothing; an unsupported field sent as null
    (how some clients write "not set") is not a request for it."""
    plain = _post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4}).json()
    extra = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "safety_identifier": "s",
        "prompt_cache_key": "p",
        "tools": None,
        "response_format": {"type": "text"},
    }
    assert set(extra) - {"tools", "response_format"} == set(NO_EFFECT_FIELDS)
    r = _post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]


def test_docs_list_the_no_effect_and_unsupported_fields():
    text = (ROOT / "serving" / "README.md").read_text()
    for name in (*NO_EFFECT_FIELDS, *UNSUPPORTED_FIELDS):
        assert f"`{name}`" in text, name


def test_logit_bias_reaches_the_engine_as_sampling_params(server):
    engine = server.engine
    r = _post(server, "/v1/completions", {"prompt": "q", "max_tokens": 2, "logit_bias": {"7": -3}})
    assert r.status_code == 200, r.text
    assert engine.added[-1][2].logit_bias == ((7, -3.0),)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        list(stub.Generate(build_request("q", max_tokens=2, logit_bias={9: 2.5}), timeout=30))
        assert engine.added[-1][2].logit_bias == ((9, 2.5),)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("q", logit_bias={9: 500.0}), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "logit_bias" in e.value.details()


def test_priority_and_speculative_reach_the_engine_over_http_and_grpc(server):
    engine = server.engine
    for path, body in [("/v1/completions", {"prompt": "q"}), ("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "q"}]})]:  # fmt: skip
        r = _post(server, path, {**body, "max_tokens": 2, "priority": -4})
        assert r.status_code == 200, r.text
        assert engine.added[-1][2].priority == -4 and engine.added[-1][2].speculative
        r = _post(server, path, {**body, "max_tokens": 2, "speculative": False})
        assert r.status_code == 200, r.text
        assert not engine.added[-1][2].speculative
    r = _post(server, "/v1/completions", {"prompt": "q", "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        list(stub.Generate(build_request("q", max_tokens=2, priority=7), timeout=30))
        assert engine.added[-1][2].priority == 7


def test_echo_puts_the_prompt_before_each_choice(server):
    client = _client(server)
    r = client.completions.create(model="test-model", prompt=["ab", "cd"], max_tokens=3, echo=True)
    assert [c.text for c in r.choices] == [
        "ab" + expected_text(_ids("ab"), 3),
        "cd" + expected_text(_ids("cd"), 3),
    ]
    r = client.completions.create(model="test-model", prompt=_ids("xy"), max_tokens=2, echo=True)
    assert r.choices[0].text == "xy" + expected_text(_ids("xy"), 2)
    stream = client.completions.create(
        model="test-model", prompt="ef", max_tokens=4, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == "ef" + expected_text(
        _ids("ef"), 4
    )


def test_tokenize_detokenize_version(server):
    r = _post(server, "/tokenize", {"prompt": "hey", "return_token_strs": True}).json()
    assert r == {"count": 3, "max_model_len": 256, "tokens": _ids("hey"), "token_strs": list("hey")}
    r = _post(server, "/tokenize", {"messages": MSGS}).json()
    want = FakeTokenizer().apply_chat_template(MSGS, tokenize=True)["input_ids"]
    assert r["tokens"] == want and r["count"] == len(want) and r["token_strs"] is None
    r = _post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert r["tokens"] == want[: -len("<assistant>")]
    assert _post(server, "/detokenize", {"tokens": _ids("hey")}).json() == {"prompt": "hey"}
    version = httpx.get(server.http + "/version", timeout=30).json()["version"]
    assert version and version[0].isdigit()
    r = _post(server, "/tokenize", {"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]


def test_grpc_refuses_fields_it_does_not_know(server):
    """A client built from a newer .proto sets a field this server lacks: protobuf keeps it as
    an unknown field, and the server refuses it rather than ignore it."""
    known = build_request("q", max_tokens=2).SerializeToString()
    # field 99 (varint 1) at the top level; field 77 inside sampling_params (field 5)
    top = pb.GenerateRequest.FromString(known + bytes([0x98, 0x06, 0x01]))
    inner = pb.GenerateRequest.FromString(known + bytes([0x2A, 0x03, 0xE8, 0x04, 0x01]))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for req, where, number in ((top, "GenerateRequest", 99), (inner, "sampling_params", 77)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert where in e.value.details() and str(number) in e.value.details()
        ok = list(stub.Generate(pb.GenerateRequest.FromString(known), timeout=30))
        assert ok[-1].finished


def test_forced_tool_choices_reach_the_engine_as_grammars(server):
    """A named function asks the engine for its parameters' schema, "required" for an array
    of calls; over gRPC the same, and the same refusals as INVALID_ARGUMENT."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    named = {"type": "function", "function": {"name": "f"}}
    body = {"messages": MSGS, "max_tokens": 2, "tools": [tool], "tool_choice": named}
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    assert json.loads(server.engine.added[-1][2].structured_output.json) == params
    body["tool_choice"], body["parallel_tool_calls"] = "required", False
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    array = json.loads(server.engine.added[-1][2].structured_output.json)
    assert (
        array["maxItems"] == 1 and array["items"]["anyOf"][0]["properties"]["parameters"] == params
    )
    chat = pb.Chat(
        messages=[pb.ChatMessage(role="user", content="hi")],
        tools=[pb.Tool(name="f", parameters=json.dumps(params))],
        tool_choice=pb.ToolChoice(function="f"),
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(chat=chat, sampling_params=pb.SamplingParams(max_tokens=2))
        assert list(stub.Generate(req, timeout=30))[-1].finished
        assert json.loads(server.engine.added[-1][2].structured_output.json) == params
        bad = [
            (pb.ToolChoice(mode="auto"), None, "--enable-auto-tool-choice"),
            (pb.ToolChoice(function="g"), None, "not among the tools"),
            (pb.ToolChoice(mode="required"), pb.StructuredOutput(regex="a"), "structured_output"),
        ]
        for choice, so, why in bad:
            req.chat.tool_choice.CopyFrom(choice)
            if so is not None:
                req.sampling_params.structured_output.CopyFrom(so)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert why in e.value.details()
        req.chat.tools[0].parameters = "{"
        with pytest.raises(grpc.RpcError, match="parameters is not valid JSON"):
            list(stub.Generate(req, timeout=30))


def test_structured_output_fields_reach_the_engine(server):
    """Every way of asking (OpenAI's response_format, vLLM's guided_* and structured_outputs,
    gRPC's structured_output) arrives as the same SamplingParams.structured_output."""
    from jaxpaged.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    cases = [
        ("/v1/chat/completions", {"response_format": fmt}, StructuredOutput(json=schema)),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, None),
        (
            "/v1/chat/completions",
            {"response_format": {**fmt, "json_schema": {**fmt["json_schema"], "strict": False}}},
            StructuredOutput(json=schema, strict=False),
        ),
        ("/v1/completions", {"guided_json": schema}, StructuredOutput(json=schema)),
        ("/v1/completions", {"guided_regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
        ("/v1/completions", {"guided_choice": ["a", "b"]}, StructuredOutput(choice=("a", "b"))),
        (
            "/v1/completions",
            {"guided_grammar": 'start: "x"'},
            StructuredOutput(grammar='start: "x"'),
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"json": schema}},
            StructuredOutput(json=schema),
        ),
    ]
    for path, extra, want in cases:
        body = {"messages": MSGS} if "chat" in path else {"prompt": "q"}
        r = _post(server, path, {**body, "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        got = server.engine.added[-1][2].structured_output
        assert got == (want or StructuredOutput(json_object=True)), extra
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        so = pb.StructuredOutput(choice=pb.Choices(choices=["p", "q"]))
        list(stub.Generate(build_request("q", max_tokens=2, structured_output=so), timeout=30))
        assert server.engine.added[-1][2].structured_output == StructuredOutput(choice=("p", "q"))
        with pytest.raises(grpc.RpcError) as e:
            empty = pb.StructuredOutput()
            list(stub.Generate(build_request("q", structured_output=empty), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_output" in e.value.details()


def test_chat_template_kwargs_reach_the_template(server):
    kwargs = {"enable_thinking": False, "mode": "terse"}
    want = FakeTokenizer().apply_chat_template(MSGS, tokenize=True, **kwargs)["input_ids"]
    assert want != FakeTokenizer().apply_chat_template(MSGS, tokenize=True)["input_ids"]
    r = _post(server, "/tokenize", {"messages": MSGS, "chat_template_kwargs": kwargs}).json()
    assert r["tokens"] == want
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 3, "chat_template_kwargs": kwargs},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert server.engine.added[-1][1] == want
