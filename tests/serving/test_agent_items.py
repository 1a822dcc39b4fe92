"""The Responses API's output items and Anthropic's content blocks built from a reply with
a think block, text and two Hermes tool calls: the items equal the Chat Completions message
of the same reply, and streaming it in pieces (cut anywhere) gives events that reassemble
to the same items."""

from __future__ import annotations

import json

import pytest

from jaxpaged.serving.anthropic import ContentBlocks
from jaxpaged.serving.chat_reply import ReplyBuilder
from jaxpaged.serving.responses import OutputItems
from jaxpaged.serving.tools import ToolPlan

REPLY = (
    "<think>weather first</think>Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)


def _builder() -> ReplyBuilder:
    return ReplyBuilder("qwen3", ToolPlan(parser="hermes"))


def _feed(sink, pieces: list[str]) -> list[dict]:
    reply, events = _builder(), []
    for i, piece in enumerate(pieces):
        events += sink.feed(reply.delta(piece, finished=i == len(pieces) - 1))
    return events


def _splits():
    yield [REPLY]
    for cut in range(0, len(REPLY), 7):
        yield [REPLY[:cut], REPLY[cut : cut + 5], REPLY[cut + 5 :]]


def test_response_items_match_the_chat_message_and_stream_events():
    msg = _builder().message(REPLY)
    for pieces in _splits():
        items = OutputItems()
        events = _feed(items, pieces) + items.close("completed")
        kinds = [i["type"] for i in items.items]
        assert kinds == ["reasoning", "message", "function_call", "function_call"]
        reasoning, message, *calls = items.items
        assert reasoning["content"][0]["text"] == msg["reasoning_content"]
        assert message["content"][0]["text"].strip() == msg["content"].strip()
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in msg["tool_calls"]
        ]
        assert all(i["status"] == "completed" for i in items.items)
        # the events alone rebuild the items (as the openai stream helper does)
        rebuilt: dict[int, dict] = {}
        for e in events:
            if e["type"] == "response.output_item.added":
                rebuilt[e["output_index"]] = {**e["item"], "text": ""}
            elif e["type"].endswith(".delta"):
                rebuilt[e["output_index"]]["text"] += e["delta"]
            elif e["type"] == "response.output_item.done":
                assert e["item"] is items.items[e["output_index"]]
        texts = [r["text"] for _, r in sorted(rebuilt.items())]
        assert texts == [
            reasoning["content"][0]["text"],
            message["content"][0]["text"],
            *[c["arguments"] for c in calls],
        ]
        assert items.as_message()["tool_calls"][1]["function"]["name"] == "get_time"


@pytest.mark.parametrize("pieces", list(_splits())[:4])
def test_anthropic_blocks_match_the_chat_message_and_stream_events(pieces):
    msg = _builder().message(REPLY)
    blocks = ContentBlocks()
    events = _feed(blocks, pieces) + blocks.close()
    thinking, text, *uses = blocks.blocks
    assert thinking == {"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""}
    assert text["type"] == "text" and text["text"].strip() == msg["content"].strip()
    assert [(u["name"], u["input"]) for u in uses] == [
        (t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]
    ]
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2, 3] and blocks.called_tools
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 2
    )
    assert json.loads(partial) == uses[0]["input"]


def test_whitespace_only_reply_and_no_message_around_calls():
    items = OutputItems()
    items.feed(ReplyBuilder(None, ToolPlan()).delta("  \n", finished=True))
    items.close("completed")
    assert [i["content"][0]["text"] for i in items.items] == ["  \n"]
    calls_only = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
    items = OutputItems()
    items.feed(ReplyBuilder(None, ToolPlan(parser="hermes")).delta(calls_only, finished=True))
    items.close("completed")
    assert [i["type"] for i in items.items] == ["function_call"]
    assert items.as_message()["content"] is None
