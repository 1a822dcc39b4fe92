"""Tool-call parsers on hand-written model outputs (Hermes and Llama 3 JSON, the forced
formats), the streamed deltas against the whole reply, and the template fallback that writes
tools into the conversation."""

from __future__ import annotations

import json

import pytest

from jaxpaged.serving.chat_reply import ReplyBuilder
from jaxpaged.serving.tool_parsers import CallArgs, CallHead, make_parser
from jaxpaged.serving.tool_prompt import TemplateToolSupport, conversation_for_template
from jaxpaged.serving.tools import ToolPlan


def _calls(segments):
    """(content, [(name, arguments object)]) of parsed segments."""
    content, calls = "", []
    for s in segments:
        if isinstance(s, str):
            content += s
        elif isinstance(s, CallHead):
            calls.append([s.name, ""])
        else:
            assert isinstance(s, CallArgs)
            calls[-1][1] += s.text
    return content, [(n, json.loads(a)) for n, a in calls]


HERMES = [
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "n": [1, 2]}}'
        "\n</tool_call>",
        "Let me check.\n\n",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET", "n": [1, 2]})],
    ),
    ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    # malformed JSON, and a call object without a name, stay content
    (
        '<tool_call>{"name": "f", "arguments": {"a": }</tool_call> ok',
        '<tool_call>{"name": "f", "arguments": {"a": }</tool_call> ok',
        [],
    ),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # arguments written as a JSON string; a reply cut off after a whole call object
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),
    ('<tool_call>\n{"name": "g", "arguments": {}}\n', "", [("g", {})]),
    ('<tool_call>\n{"name": "g", "argum', '<tool_call>\n{"name": "g", "argum', []),
]

LLAMA3 = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    ('<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}', "", [("f", {"q": "a;b"})]),
    ("The answer is {x}.", "The answer is {x}.", []),
    ('{"name": "f", "parameters": {"q": }', '{"name": "f", "parameters": {"q": }', []),
    ('{"name": "f", "parameters": {}} and then text', "and then text", [("f", {})]),
]

FORCED = [
    (
        "required",
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
        [("a", {"x": 1}), ("b", {})],
    ),
    ("named", '{"city": "Oslo", "days": [1, 2]}', [("f", {"city": "Oslo", "days": [1, 2]})]),
]


def _split_feeds(kind: str, text: str, cuts: list[int], name: str | None = None):
    parser = make_parser(kind, name)
    out = []
    prev = 0
    for cut in [*cuts, len(text)]:
        out += parser.feed(text[prev:cut])
        prev = cut
    return out + parser.finish()


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes(text, content, calls):
    assert _calls(make_parser("hermes").parse(text)) == (content, calls)
    # one character at a time, and in uneven pieces: the same calls and content
    assert _calls(_split_feeds("hermes", text, list(range(1, len(text))))) == (content, calls)
    assert _calls(_split_feeds("hermes", text, list(range(3, len(text), 7)))) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3)
def test_llama3_json(text, content, calls):
    assert _calls(make_parser("llama3_json").parse(text)) == (content, calls)
    assert _calls(_split_feeds("llama3_json", text, list(range(1, len(text))))) == (
        content,
        calls,
    )


@pytest.mark.parametrize(("kind", "text", "calls"), FORCED)
def test_forced_formats(kind, text, calls):
    assert _calls(make_parser(kind, "f").parse(text)) == ("", calls)
    assert _calls(_split_feeds(kind, text, list(range(1, len(text))), "f")) == ("", calls)


def test_named_choice_streams_arguments_as_they_come():
    parser = make_parser("named", "f")
    assert parser.feed('{"ci') == [CallHead("f"), CallArgs('{"ci')]
    assert parser.feed('ty": "x"}') == [CallArgs('ty": "x"}')]
    assert parser.finish() == []


def test_streamed_deltas_reassemble_to_the_whole_message():
    text = HERMES[0][0]
    whole = ReplyBuilder(None, ToolPlan(parser="hermes")).message(text)
    streamer = ReplyBuilder(None, ToolPlan(parser="hermes"))
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    deltas = [d for i, p in enumerate(pieces) for d in streamer.delta(p, i == len(pieces) - 1)]
    calls: dict[int, dict] = {}
    content = ""
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            if "id" in c:  # a call's first delta: id, type and name, no arguments yet
                assert c["type"] == "function" and c["function"]["arguments"] == ""
                calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
            else:
                assert set(c) == {"index", "function"}
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in whole["tool_calls"]]
    assert content.strip() == whole["content"].strip() == "Let me check."
    assert streamer.finish_reason("stop") == "tool_calls"
    assert streamer.finish_reason("length") == "length"


def test_parallel_tool_calls_off_keeps_the_first_call():
    msg = ReplyBuilder(None, ToolPlan(parser="hermes", parallel=False)).message(HERMES[0][0])
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]


def test_reasoning_then_tool_calls():
    text = '<think>need weather</think><tool_call>{"name": "w", "arguments": {}}</tool_call>'
    msg = ReplyBuilder("qwen3", ToolPlan(parser="hermes")).message(text)
    assert msg["reasoning_content"] == "need weather"
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "w"


TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
TURNS = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"c": 1}}}
        ],
    },
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "c1"},
]


def test_template_without_tool_support_gets_them_written_into_the_messages():
    none = TemplateToolSupport(tools=False, tool_turns=False)
    msgs, tools = conversation_for_template(TURNS, TOOLS, none, "hermes")
    assert tools is None
    assert msgs[0]["role"] == "system" and '"name": "w"' in msgs[0]["content"]
    assert "<tools>" in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'
    assert "tool_calls" not in msgs[2]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny, 21 C\n</tool_response>"}
    # a template that renders tools and tool turns gets them as they are
    full = TemplateToolSupport(tools=True, tool_turns=True)
    assert conversation_for_template(TURNS, TOOLS, full, "hermes") == (TURNS, TOOLS)


def test_probe_tells_templates_apart():
    def ignores(messages, **kwargs):
        return "".join(m["role"] + m["content"] for m in messages)

    def renders(messages, tools=(), **kwargs):
        calls = [c["function"]["name"] for m in messages for c in m.get("tool_calls", ())]
        return json.dumps(tools) + ignores(messages) + "".join(calls)

    assert TemplateToolSupport.probe(ignores) == TemplateToolSupport(False, False)
    assert TemplateToolSupport.probe(renders) == TemplateToolSupport(True, True)


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_probe_on_the_bundled_tokenizer():
    """SmolLM2's own template renders neither tools nor tool turns; a Qwen-like template
    (tools and tool calls in the template) renders both, so the conversation goes to it
    unchanged."""
    transformers = pytest.importorskip("transformers")
    from jaxpaged.models import default_model_path

    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())

    def render_with(template):
        def render(messages, **kwargs):
            return tok.apply_chat_template(
                messages, tokenize=False, chat_template=template, **kwargs
            )

        return render

    assert TemplateToolSupport.probe(render_with(None)) == TemplateToolSupport(False, False)
    qwen_like = TemplateToolSupport.probe(render_with(QWEN_LIKE))
    assert qwen_like == TemplateToolSupport(True, True)
    msgs, tools = conversation_for_template(TURNS, TOOLS, qwen_like, "hermes")
    text = render_with(QWEN_LIKE)(msgs, tools=tools)
    assert '"name": "w"' in text and "sunny, 21 C" in text and "<tool_call>" in text
