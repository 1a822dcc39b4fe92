"""The Responses API and Anthropic's Messages API end to end on the bundled SmolLM2, with the
real `openai` and `anthropic` clients: at temperature 0 each returns the text Chat
Completions returns for the same conversation (also across turns and tool round trips),
streamed and whole; usage counts match; cancelling frees the request's KV blocks.

One engine for the module (enforce_eager and a 64-token step budget keep compilation short).
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from fakes import wait_until
from harness import ServerThread
from tool_cases import TOOLS, WEATHER, WEATHER_ASK

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
SYSTEM = "You answer in one short sentence."
ASK = "What is the largest planet in the solar system?"
# the tools in the Responses API's (flat) shape
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def real():
    from jaxpaged.engine import LLMEngine
    from jaxpaged.engine.async_engine import AsyncEngine
    from jaxpaged.models import default_model_path

    engine = LLMEngine.from_args(
        default_model_path(),
        max_model_len=512,
        max_num_seqs=32,  # the shapes of test_real_model.py's: compiled programs shared
        max_num_batched_tokens=64,
        num_kv_blocks=320,
        enforce_eager=True,
        show_progress=False,
    )
    server = ServerThread(
        AsyncEngine(engine),
        served_model_name="smollm2",
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    server.llm_engine = engine
    server.free0 = engine.get_stats().num_free_blocks
    yield server
    server.stop()


@pytest.fixture
def oai(real):
    yield openai.OpenAI(base_url=real.http + "/v1", api_key="none", max_retries=0, timeout=300)
    # no test leaves a request running or a KV block taken
    assert wait_until(lambda: real.llm_engine.get_stats().num_free_blocks == real.free0, 30)
    assert real.frontend.num_in_flight == 0


def _chat(oai, messages, **kw):
    return oai.chat.completions.create(model="smollm2", messages=messages, **kw)


def test_responses_equal_chat_across_turns_and_streams(oai):
    """Turn 1 (instructions + text) whole and streamed, then turn 2 by previous_response_id
    (instructions sent again, as OpenAI does not carry them over): each text and usage equals
    Chat Completions' for the same messages."""
    r1 = oai.responses.create(
        model="smollm2", instructions=SYSTEM, input=ASK, max_output_tokens=16, **GREEDY
    )
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    c1 = _chat(oai, msgs, max_tokens=16, **GREEDY)
    assert r1.output_text == c1.choices[0].message.content and r1.output_text
    assert r1.usage.input_tokens == c1.usage.prompt_tokens
    assert r1.usage.output_tokens == c1.usage.completion_tokens
    assert r1.usage.total_tokens == c1.usage.total_tokens
    want_status = "completed" if c1.choices[0].finish_reason == "stop" else "incomplete"
    assert r1.status == want_status and [o.type for o in r1.output] == ["message"]

    events = []
    with oai.responses.stream(
        model="smollm2", instructions=SYSTEM, input=ASK, max_output_tokens=16, **GREEDY
    ) as stream:
        for event in stream:
            events.append(event)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{want_status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r1.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r1.usage.output_tokens

    follow = "And the smallest?"
    r2 = oai.responses.create(
        model="smollm2", instructions=SYSTEM, input=follow, previous_response_id=r1.id,
        max_output_tokens=12, **GREEDY,
    )  # fmt: skip
    msgs += [{"role": "assistant", "content": r1.output_text}, {"role": "user", "content": follow}]
    c2 = _chat(oai, msgs, max_tokens=12, **GREEDY)
    assert r2.output_text == c2.choices[0].message.content
    assert r2.usage.input_tokens == c2.usage.prompt_tokens
    assert r2.previous_response_id == r1.id
    got = oai.responses.retrieve(r2.id)
    assert got.output_text == r2.output_text and got.status == r2.status


def test_responses_function_call_round_trip(oai):
    """A forced function call (whole, and assembled by the stream helper), its output sent
    back by previous_response_id: the call and the answer equal Chat Completions'."""
    jsonschema = pytest.importorskip("jsonschema")
    ask = WEATHER_ASK[0]["content"]
    forced = {"type": "function", "name": "get_weather"}
    r1 = oai.responses.create(
        model="smollm2", input=ask, tools=RESPONSES_TOOLS, tool_choice=forced,
        max_output_tokens=60, **GREEDY,
    )  # fmt: skip
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    chat_call = _chat(
        oai, WEATHER_ASK, tools=TOOLS, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY,
    ).choices[0].message.tool_calls[0]  # fmt: skip
    assert chat_call.function.arguments == call.arguments
    with oai.responses.stream(
        model="smollm2", input=ask, tools=RESPONSES_TOOLS, tool_choice=forced,
        max_output_tokens=60, **GREEDY,
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [
        ("function_call", "get_weather", call.arguments)
    ]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    r2 = oai.responses.create(
        model="smollm2", input=[result], previous_response_id=r1.id, tools=RESPONSES_TOOLS,
        tool_choice="none", max_output_tokens=12, **GREEDY,
    )  # fmt: skip
    turns = [
        *WEATHER_ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    c2 = _chat(oai, turns, tools=TOOLS, tool_choice="none", max_tokens=12, **GREEDY)
    assert r2.output_text == c2.choices[0].message.content and r2.output_text
    assert r2.usage.input_tokens == c2.usage.prompt_tokens
    # the same conversation sent whole (the output items as input) gives the same answer
    r3 = oai.responses.create(
        model="smollm2", input=[{"role": "user", "content": ask}, *r1.output, result],
        tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=12, store=False, **GREEDY,
    )  # fmt: skip
    assert r3.output_text == r2.output_text
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r3.id)


def test_responses_json_schema_and_cancel(oai, real):
    """text.format json_schema goes through structured output; cancelling a streaming
    response ends it as cancelled and frees its blocks."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER}
    r = oai.responses.create(
        model="smollm2", input="Weather data as JSON:", text={"format": fmt},
        max_output_tokens=60, **GREEDY,
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), WEATHER)

    stream = oai.responses.create(
        model="smollm2", input="Tell me a very long story about a dragon.", stream=True,
        max_output_tokens=400, temperature=0.8, extra_body={},
    )  # fmt: skip
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created"
    next(e for e in events if e.type == "response.output_text.delta")
    cancelled = oai.responses.cancel(created.response.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 400
    last = list(events)[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="in progress"):
        oai.responses.cancel(created.response.id)


@pytest.fixture
def claude(real, oai):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=real.http, api_key="none", max_retries=0, timeout=300)


def test_anthropic_messages_equal_chat_whole_streamed_and_stopped(claude, oai):
    """system + user at temperature 0 (sent through extra_body, as current clients do):
    text, usage and count_tokens equal Chat Completions'; the stream helper assembles the
    same message; a stop sequence ends the text before it with stop_reason stop_sequence."""
    msgs = [{"role": "user", "content": ASK}]
    ask = dict(model="smollm2", system=SYSTEM, messages=msgs, extra_body=GREEDY)
    m = claude.messages.create(max_tokens=16, **ask)
    c = _chat(oai, [{"role": "system", "content": SYSTEM}, *msgs], max_tokens=16, **GREEDY)
    (block,) = m.content
    assert block.type == "text" and block.text == c.choices[0].message.content
    stop = {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]
    assert m.stop_reason == stop and m.role == "assistant" and m.model == "smollm2"
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == c.usage.prompt_tokens
    assert u.output_tokens == c.usage.completion_tokens
    count = claude.messages.count_tokens(model="smollm2", system=SYSTEM, messages=msgs)
    assert count.input_tokens == c.usage.prompt_tokens

    with claude.messages.stream(max_tokens=16, **ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == block.text and final.stop_reason == stop
    assert final.usage.output_tokens == u.output_tokens

    word = block.text.split()[2]
    cut = claude.messages.create(max_tokens=16, stop_sequences=[word], **ask)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == block.text[: block.text.index(word)]


def test_anthropic_tool_use_and_tool_result(claude, oai):
    """tool_choice "tool" gives a tool_use block (whole and streamed as input_json_delta)
    whose input validates and equals Chat Completions' call; the tool_result sent back
    yields the text Chat Completions gives for the same turns."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    ask = dict(model="smollm2", messages=WEATHER_ASK, tools=tools, max_tokens=60,
               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)  # fmt: skip
    m = claude.messages.create(**ask)
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    chat_call = _chat(
        oai, WEATHER_ASK, tools=TOOLS, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY,
    ).choices[0].message.tool_calls[0]  # fmt: skip
    assert json.loads(chat_call.function.arguments) == use.input
    with claude.messages.stream(**ask) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert json.loads("".join(deltas)) == use.input == final.content[0].input

    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}
    turns = [*WEATHER_ASK, {"role": "assistant", "content": m.content},
             {"role": "user", "content": [result]}]  # fmt: skip
    reply = claude.messages.create(
        model="smollm2", messages=turns, tools=tools, tool_choice={"type": "none"},
        max_tokens=12, extra_body=GREEDY,
    )  # fmt: skip
    chat_turns = [
        *WEATHER_ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    c = _chat(oai, chat_turns, tools=TOOLS, tool_choice="none", max_tokens=12, **GREEDY)
    assert reply.content[0].text == c.choices[0].message.content


SCHEMA_CASES = json.loads(
    (Path(__file__).parents[2] / "bench" / "data" / "json_schemas.json").read_text()
)
FULL = os.environ.get("JAXPAGED_TEST_FULL") == "1"


def _only_declared_keys(value, schema) -> bool:
    """No object holds a property its schema does not declare (the strict reading)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return set(value) <= set(props) and all(
            _only_declared_keys(v, props[k]) for k, v in value.items()
        )
    if isinstance(value, list):
        return all(_only_declared_keys(v, schema.get("items", {})) for v in value)
    return True


@pytest.mark.parametrize(
    "temperature",
    [0.0, pytest.param(0.9, marks=pytest.mark.skipif(not FULL, reason="JAXPAGED_TEST_FULL=1"))],
)
def test_strict_json_schemas_close_within_200_tokens(oai, temperature, capsys):
    """The schemas of bench/data/json_schemas.json as response_format (strict, the
    default): every output that finishes within 200 tokens is compact JSON that validates
    and holds only declared properties, and at temperature 0 every schema whose strings are
    bounded finishes (at 0.9, all but two). The default suite runs the 15 bounded schemas at
    temperature 0; JAXPAGED_TEST_FULL=1 all 21 at 0 and 0.9 (an unbounded string may run
    to the limit: counted, printed; bench/structured_json.py reports both readings in
    RESULTS.md)."""
    jsonschema = pytest.importorskip("jsonschema")

    def ask(case, seed):
        fmt = {"type": "json_schema", "json_schema": {"name": "data", "schema": case["schema"]}}
        msgs = [
            {"role": "system", "content": "You reply with JSON only."},
            {"role": "user", "content": f"Give me an example of {case['subject']} as JSON."},
        ]
        return _chat(oai, msgs, max_tokens=200, temperature=temperature, seed=seed,
                     response_format=fmt).choices[0]  # fmt: skip

    cases = SCHEMA_CASES if FULL else [c for c in SCHEMA_CASES if c["bounded"]]
    with ThreadPoolExecutor(len(cases)) as pool:
        choices = list(pool.map(ask, cases, range(len(cases))))
    closed = {True: 0, False: 0}
    for case, c in zip(cases, choices, strict=True):
        text = c.message.content
        if c.finish_reason != "stop":
            assert not (case["bounded"] and temperature == 0), text
            continue
        value = json.loads(text)
        jsonschema.validate(value, case["schema"])
        assert _only_declared_keys(value, case["schema"]), text
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
        assert not re.search(r"\s", outside_strings), text  # compact
        closed[case["bounded"]] += 1
    bounded = sum(c["bounded"] for c in cases)
    assert closed[True] >= bounded - (2 if temperature else 0)
    with capsys.disabled():
        print(
            f"\nT={temperature}: bounded {closed[True]}/{bounded}, "
            f"unbounded {closed[False]}/{len(cases) - bounded} close"
        )


def test_priority_is_refused_by_a_fcfs_engine(oai):
    """The engine validates priority up front: a first-come-first-served engine answers a
    400 naming it (tests/engine/test_priority.py schedules by priority)."""
    with pytest.raises(openai.BadRequestError, match="priority 3 is only honoured"):
        oai.completions.create(model="smollm2", prompt="x", max_tokens=1,
                               extra_body={"priority": 3})  # fmt: skip
    r = oai.completions.create(
        model="smollm2", prompt="x", max_tokens=1, extra_body={"priority": 0}
    )
    assert r.usage.completion_tokens == 1
