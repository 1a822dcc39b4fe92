"""End to end on the bundled SmolLM2 over loopback: the project's gRPC client and the real
`openai` client against a server in front of the real AsyncEngine.

- greedy completions and chats (streaming and not) equal offline `LLM.generate` / `LLM.chat`;
- 32 concurrent streams (gRPC and HTTP) finish with the asked token counts and every KV
  block comes back;
- gRPC cancel, a deadline and an HTTP disconnect free the request's blocks within a step or
  two.

One engine for the module (enforce_eager and a 64-token step budget keep compilation short);
the offline reference runs on it first, then the server takes it over.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import openai
import pytest
from fakes import wait_until
from harness import ServerThread
from hf_reference import hf_prompt_logprobs
from tool_cases import (
    HERMES_GET_TIME,
    TOOL_TURNS,
    TOOLS,
    WEATHER,
    WEATHER_ASK,
    WEATHER_TIME_SCHEMAS,
    reflected_generate,
    streamed_calls,
)

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.serving import generation_pb2 as pb
from jaxpaged.serving import generation_pb2_grpc as pb_grpc
from jaxpaged.serving.client import GenerationClient, build_request

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
]
CHATS = [
    [{"role": "user", "content": "What is the largest planet in the solar system?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def real():
    from jaxpaged.engine import LLMEngine
    from jaxpaged.engine.async_engine import AsyncEngine
    from jaxpaged.llm import LLM
    from jaxpaged.models import default_model_path

    engine = LLMEngine.from_args(
        default_model_path(),
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        num_kv_blocks=320,  # the shapes of test_agent_apis_real.py's: compiled programs shared
        enforce_eager=True,
        show_progress=False,
    )
    llm = LLM.from_engine(engine)
    ref = {
        "text": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        "chat": llm.chat(CHATS, GREEDY, use_tqdm=False),
    }
    server = ServerThread(
        AsyncEngine(engine),
        served_model_name="smollm2",
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    server.ref = ref
    server.llm_engine = engine
    yield server
    server.stop()


def _free(server) -> int:
    return server.llm_engine.get_stats().num_free_blocks


def _threads(jobs):
    """Runs the callables concurrently in threads (the sync gRPC client: grpc.aio supports one
    event loop per process, and the server's runs in this process)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def test_grpc_greedy_equals_offline(real):
    ref = real.ref
    with GenerationClient(real.grpc_target) as client:
        greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        streamed, unary, chats = [], [], []
        jobs = [
            lambda p=p: streamed.append((p, list(client.stream(p, **greedy)))) for p in PROMPTS[:2]
        ]
        jobs += [lambda p=p: unary.append((p, client.generate(p, **greedy))) for p in PROMPTS[2:]]
        jobs += [
            lambda i=i: chats.append((i, client.generate(messages=CHATS[i], **greedy)))
            for i in range(2)
        ]
        _threads(jobs)
    want = {p: o for p, o in zip(PROMPTS, ref["text"], strict=True)}
    assert len(streamed) == 2 and len(unary) == 2 and len(chats) == 2
    for p, chunks in streamed:
        assert [t for c in chunks for t in c.token_ids] == list(want[p].outputs[0].token_ids)
        assert "".join(c.text for c in chunks) == want[p].outputs[0].text
        assert chunks[-1].finish_reason == want[p].outputs[0].finish_reason
    for p, got in unary:
        assert got.samples[0].token_ids == tuple(want[p].outputs[0].token_ids)
        assert got.text == want[p].outputs[0].text
        assert got.prompt_token_ids == tuple(want[p].prompt_token_ids)
    for i, got in chats:
        assert got.prompt_token_ids == tuple(ref["chat"][i].prompt_token_ids)
        assert got.samples[0].token_ids == tuple(ref["chat"][i].outputs[0].token_ids)


def test_openai_greedy_equals_offline(real):
    ref = real.ref
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(
        model="smollm2", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref["text"]]
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref["text"])

    text = ""
    for chunk in client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        text += chunk.choices[0].text
    assert text == ref["text"][0].outputs[0].text

    c = client.chat.completions.create(
        model="smollm2", messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert c.choices[0].message.content == ref["chat"][0].outputs[0].text
    assert c.usage.prompt_tokens == len(ref["chat"][0].prompt_token_ids)
    content = ""
    for chunk in client.chat.completions.create(
        model="smollm2", messages=CHATS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
    assert content == ref["chat"][1].outputs[0].text


def test_echo_logprobs_and_prompt_logprobs_equal_transformers(real, bundled_model_path):
    """A prompt longer than the step budget (several prefill chunks): echo + logprobs and
    prompt_logprobs over HTTP and gRPC give transformers' log-probabilities within 1e-3, the
    second time too, when the prompt's blocks are in the prefix cache."""
    text = " ".join(PROMPTS * 6)
    tok = httpx.post(real.http + "/tokenize", json={"prompt": text}, timeout=30).json()
    ids = tok["tokens"]
    assert tok["count"] == len(ids) > 64 and tok["max_model_len"] == 512
    assert httpx.post(real.http + "/detokenize", json={"tokens": ids}, timeout=30).json() == {
        "prompt": text
    }
    want = hf_prompt_logprobs(bundled_model_path, ids)
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    for _ in range(2):
        r = client.completions.create(
            model="smollm2", prompt=text, max_tokens=2, temperature=0, echo=True, logprobs=2,
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip
        c = r.choices[0]
        assert c.text.startswith(text)
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
        assert "".join(lp.tokens) == c.text and lp.text_offset[len(ids)] == len(text)
        np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want, atol=1e-3)
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        plp = c.model_extra["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for i in (1, len(ids) // 2, len(ids) - 1):
            assert plp[i][str(ids[i])]["logprob"] == pytest.approx(want[i - 1], abs=1e-3)
    with grpc.insecure_channel(real.grpc_target) as channel:
        req = build_request(ids, max_tokens=1, temperature=0.0, prompt_logprobs=0)
        msgs = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=120))
    got = [m for m in msgs if m.prompt_logprobs]
    assert len(got) == 1 and [lp.token_id for lp in got[0].prompt_logprobs] == ids[1:]
    np.testing.assert_allclose([lp.logprob for lp in got[0].prompt_logprobs], want, atol=1e-3)


def test_logit_bias_moves_greedy_choices(real):
    """-100 on the greedy first token yields the model's second choice; +100 on a token makes
    every greedy token that one."""
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    ask = {"model": "smollm2", "prompt": PROMPTS[0], "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**ask, max_tokens=1).choices[0].logprobs.top_logprobs[0]
    ids = [
        httpx.post(real.http + "/tokenize", json={"prompt": t}, timeout=30).json()["tokens"]
        for t in plain
    ]
    (best,), (second,) = ids
    r = client.completions.create(**ask, max_tokens=1, logit_bias={str(best): -100})
    assert r.choices[0].logprobs.tokens[0] == list(plain)[1]
    r = client.completions.create(
        **ask, max_tokens=4, logit_bias={str(second): 100}, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].logprobs.tokens == [list(plain)[1]] * 4


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["colour", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
        "minItems": 2,
        "maxItems": 3,
    },
]


def test_structured_output_always_validates(real):
    """JSON schemas (nested objects, enums, arrays, patterns, required fields) at temperature
    0.9 in one batch with an unconstrained request: every output parses and validates; the
    openai client's parse() gets its object; choice and regex hold; a bad schema is a 400."""
    jsonschema = pytest.importorskip("jsonschema")
    pydantic = pytest.importorskip("pydantic")
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "Give me some example data as JSON."}]

    def constrained(i):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i % 3}", "schema": SCHEMAS[i % 3]},
        }
        return client.chat.completions.create(
            model="smollm2", messages=ask, temperature=0.9, seed=i, max_tokens=200,
            response_format=fmt,
        )  # fmt: skip

    def plain():
        return client.completions.create(model="smollm2", prompt=PROMPTS[1], max_tokens=40)

    results = _threads([lambda i=i: constrained(i) for i in range(3)] + [plain])
    for i, r in enumerate(results[:3]):
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[i % 3])
    assert results[3].choices[0].finish_reason == "length"

    class Point(pydantic.BaseModel):
        label: str = pydantic.Field(max_length=12)
        x: int
        y: int

    parsed = client.beta.chat.completions.parse(
        model="smollm2", messages=ask, response_format=Point, temperature=0.7, max_tokens=100
    )
    assert isinstance(parsed.choices[0].message.parsed, Point)
    r = client.completions.create(
        model="smollm2", prompt="Is water wet? Answer:", max_tokens=8, temperature=1.0,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )  # fmt: skip
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="smollm2", prompt="Call me at", max_tokens=20, temperature=1.0,
        extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="structured_output"):
        client.completions.create(
            model="smollm2", prompt="x", extra_body={"guided_json": {"type": "objekt"}}
        )
    with grpc.insecure_channel(real.grpc_target) as channel:
        so = pb.StructuredOutput(json=json.dumps(SCHEMAS[1]))
        req = build_request("Data:", max_tokens=120, temperature=0.8, structured_output=so)
        msgs = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=120))
    text = "".join(d.text for m in msgs for d in m.outputs)
    jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_reasoning_parser_splits_think_blocks(real):
    """With --reasoning-parser qwen3, a reply made (by a regex) to open with a think block
    comes back split into reasoning_content and content, whole and streamed; replies without
    one keep all their text as content (the other chat tests here)."""
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    ask = dict(
        model="smollm2", messages=CHATS[0], max_tokens=60, temperature=0.7, seed=3,
        extra_body={"guided_regex": "<think>[a-z ]{4,30}</think>[A-Z][a-z ]{4,30}"},
    )  # fmt: skip
    m = client.chat.completions.create(**ask).choices[0].message
    reasoning, content = m.model_extra["reasoning_content"], m.content
    assert re.fullmatch("[a-z ]{4,30}", reasoning) and re.fullmatch("[A-Z][a-z ]{4,30}", content)
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": reasoning, "content": content}


def test_forced_tool_calls_parse_validate_and_stream(real):
    """A named function (greedy) and "required" (temperature 0.8) return tool_calls whose
    arguments parse and validate against the tool's schema; streamed deltas reassemble to
    the same call as the whole reply; a reply in Hermes' format (made so by a regex, tool
    choice "auto") is parsed into tool_calls, whole and streamed."""
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = dict(model="smollm2", messages=WEATHER_ASK, tools=TOOLS, max_tokens=80)
    by_regex = dict(ask, temperature=0.9, seed=2, extra_body={"guided_regex": HERMES_GET_TIME})
    jobs = [
        lambda: client.chat.completions.create(**ask, tool_choice=named, temperature=0),
        lambda: streamed_calls(
            client.chat.completions.create(**ask, tool_choice=named, temperature=0, stream=True)
        ),
        lambda: client.chat.completions.create(
            **ask, tool_choice="required", temperature=0.8, seed=5, parallel_tool_calls=False
        ),
        lambda: client.chat.completions.create(**by_regex),
        lambda: streamed_calls(client.chat.completions.create(**by_regex, stream=True)),
    ]
    whole, (calls, finish), required, parsed, (parsed_calls, parsed_finish) = _threads(jobs)
    c = whole.choices[0]
    (call,) = c.message.tool_calls
    assert c.finish_reason == "stop" == finish and call.id and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]
    c = required.choices[0]
    (call,) = c.message.tool_calls
    assert c.finish_reason == "tool_calls"
    schema = WEATHER_TIME_SCHEMAS[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    m = parsed.choices[0].message
    assert m.content is None and m.tool_calls[0].function.name == "get_time"
    assert json.loads(m.tool_calls[0].function.arguments)["tz"] in ("UTC", "CET")
    assert parsed_finish == "tool_calls" and [c["name"] for c in parsed_calls] == ["get_time"]


def test_tool_results_flow_into_the_next_turn(real, bundled_model_path):
    """An assistant turn with tool_calls (as the openai client sends one back, nulls
    included) and a tool result are rendered into the prompt (SmolLM2's template ignores
    tools: they are written into the messages) and the chat answers; a chat's
    prompt_logprobs equal transformers' within 1e-3."""
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    turns = TOOL_TURNS
    body = {"messages": turns, "tools": TOOLS}
    tok = httpx.post(real.http + "/tokenize", json=body, timeout=30).json()
    rendered = httpx.post(real.http + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30)
    prompt = rendered.json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in prompt
    assert '"get_time"' in prompt  # the tools' system block
    create = client.chat.completions.create
    r, with_plp = _threads([
        lambda: create(model="smollm2", messages=turns, tools=TOOLS, tool_choice="none",
                       temperature=0, max_tokens=8),
        lambda: create(model="smollm2", messages=CHATS[1], max_tokens=1,
                       extra_body={"prompt_logprobs": 0}),
    ])  # fmt: skip
    assert r.usage.prompt_tokens == tok["count"] and r.choices[0].message.content
    plp = with_plp.model_extra["prompt_logprobs"]
    ids = list(real.ref["chat"][1].prompt_token_ids)
    assert plp[0] is None and len(plp) == len(ids)
    got = [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    np.testing.assert_allclose(got, hf_prompt_logprobs(bundled_model_path, ids), atol=1e-3)


def test_grpc_tool_call_and_structured_output_through_reflection(real):
    """A client built from reflection alone: a named tool choice (streamed) ends with the
    call HTTP returns for the same greedy request; a JSON schema's output validates."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = [
        {"name": t["function"]["name"], "parameters": json.dumps(t["function"]["parameters"])}
        for t in TOOLS
    ]
    chat = {"messages": WEATHER_ASK, "tools": tools, "tool_choice": {"function": "get_weather"}}
    greedy = {"temperature": 0, "max_tokens": 80}
    msgs = reflected_generate(
        real.grpc_target, {"chat": chat, "sampling_params": greedy, "stream": True}
    )
    last = msgs[-1]["outputs"][0]
    assert last["finishReason"] == "stop" and len(msgs) > 2
    client = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    http = client.chat.completions.create(
        model="smollm2", messages=WEATHER_ASK, tools=TOOLS, tool_choice=named, **greedy
    ).choices[0].message.tool_calls[0].function  # fmt: skip
    assert [(c["name"], c["arguments"]) for c in last["toolCalls"]] == [(http.name, http.arguments)]
    params = {
        "max_tokens": 80,
        "temperature": 0.8,
        "structured_output": {"json": json.dumps(WEATHER)},
    }
    msgs = reflected_generate(real.grpc_target, {"text": "Data:", "sampling_params": params})
    jsonschema.validate(json.loads(msgs[-1]["outputs"][0]["text"]), WEATHER)


def test_32_concurrent_streams_complete_and_free_their_blocks(real):
    free0 = _free(real)
    lengths = [3 + i % 6 for i in range(32)]  # 3..8 tokens each
    prompts = [f"Item {i}: the number {i * 7} is" for i in range(32)]
    m0 = httpx.get(real.http + "/metrics", timeout=30).text

    def grpc_stream(client, prompt, n):
        chunks = list(client.stream(prompt, max_tokens=n, temperature=0.8, seed=n, ignore_eos=True))
        return sum(len(c.token_ids) for c in chunks), chunks[-1].finish_reason

    def http_stream(client, prompt, n):
        count, finish = 0, None
        stream = client.completions.create(
            model="smollm2",
            prompt=prompt,
            max_tokens=n,
            temperature=0.8,
            seed=n,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
        return count, finish

    oai = openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0, timeout=600)
    with GenerationClient(real.grpc_target) as g:
        results = _threads(
            [
                (lambda p=p, n=n: grpc_stream(g, p, n))
                if i % 2 == 0
                else (lambda p=p, n=n: http_stream(oai, p, n))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
        )
    assert results == [(n, "length") for n in lengths]
    assert wait_until(lambda: _free(real) == free0, 10)
    assert real.frontend.num_in_flight == 0
    m1 = httpx.get(real.http + "/metrics", timeout=30).text

    def value(text, name):
        return float(
            next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1]
        )

    assert value(m1, "jaxpaged:generation_tokens_total") - value(
        m0, "jaxpaged:generation_tokens_total"
    ) == sum(lengths)
    assert (
        value(m1, "jaxpaged:e2e_request_latency_seconds_count")
        - value(m0, "jaxpaged:e2e_request_latency_seconds_count")
        == 32
    )


def _steps(real) -> int:
    return real.llm_engine.get_stats().num_steps


def test_cancel_deadline_and_disconnect_free_blocks_quickly(real):
    free0 = _free(real)
    long = {"max_tokens": 200, "temperature": 0.0, "ignore_eos": True}

    # gRPC cancel
    with GenerationClient(real.grpc_target) as client:
        stream = client.stream("Tell me a long story about a dragon.", **long)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert _free(real) < free0
        stream.close()  # cancels the call
        steps = _steps(real)
        assert wait_until(lambda: _free(real) == free0, 30)
        assert _steps(real) - steps <= 2

    # deadline
    with GenerationClient(real.grpc_target) as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            # 480 tokens outlast a 1 s deadline at batch 1 (200 tokens once finished inside 3 s)
            fill = {**long, "max_tokens": 480}
            list(client.stream("Count from one to one hundred:", timeout=1.0, **fill))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        steps = _steps(real)
        assert wait_until(lambda: _free(real) == free0, 30)
        assert _steps(real) - steps <= 2
        assert time.monotonic() - t0 < 30

    # HTTP disconnect mid-stream
    body = {"model": "smollm2", "prompt": "List all the colors you know:", "stream": True, **long}
    with httpx.stream("POST", real.http + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data:")
            if got == 2:
                break
        assert _free(real) < free0
    steps = _steps(real)
    assert wait_until(lambda: _free(real) == free0, 30)
    assert _steps(real) - steps <= 2
    assert wait_until(lambda: real.frontend.num_in_flight == 0, 10)


def test_engine_step_failure_ends_streams_and_health(real):
    """Last in the module (it kills the engine): a step that raises ends every in-flight
    request with INTERNAL / an error event, health turns NOT_SERVING, new requests get
    UNAVAILABLE / 503."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    engine = real.llm_engine.core  # the EngineCore the engine thread drives
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected device failure")
        return real_step()

    errors = []
    with GenerationClient(real.grpc_target) as client:

        def consume():
            try:
                list(
                    client.stream("Tell me everything about cats.", max_tokens=100, ignore_eos=True)
                )
            except grpc.RpcError as e:
                errors.append(e)

        engine.step = failing_step
        _threads([consume, consume])
    assert [e.code() for e in errors] == [grpc.StatusCode.INTERNAL] * 2
    assert all("injected device failure" in e.details() for e in errors)
    with grpc.insecure_channel(real.grpc_target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert httpx.get(real.http + "/health", timeout=10).status_code == 503
    r = httpx.post(real.http + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 503
