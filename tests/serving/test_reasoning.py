"""The reasoning parsers against their definition, whole and fed in every possible split."""

from __future__ import annotations

import pytest

from jaxpaged.serving.reasoning import ThinkSplitter

CASES = [
    (
        "qwen3",
        "<think>step one\nstep two</think>\n\nThe answer.",
        "step one\nstep two",
        "\n\nThe answer.",
    ),
    ("qwen3", "\n<think>a<b</think>c", "a<b", "c"),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>cut off", "cut off", ""),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "plan</think>done", "plan", "done"),
    ("deepseek_r1", "<think>plan</think>done", "plan", "done"),
    ("deepseek_r1", "still thinking </thi", "still thinking </thi", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_split_whole_and_streamed(parser, text, reasoning, content):
    assert ThinkSplitter(parser).split(text) == (reasoning, content)
    for cut in range(len(text) + 1):  # two deltas, cut anywhere (inside a tag too)
        for cut2 in range(cut, len(text) + 1):
            s = ThinkSplitter(parser)
            parts = [s.feed(text[:cut]), s.feed(text[cut:cut2]), s.feed(text[cut2:]), s.flush()]
            for r, c in parts:  # no delta shows a whole tag
                assert "<think>" not in r + c and "</think>" not in r + c
            assert "".join(r for r, _ in parts) == (reasoning or "")
            assert "".join(c for _, c in parts) == content


def test_unknown_parser():
    with pytest.raises(ValueError, match="qwen3"):
        ThinkSplitter("gpt")


def test_serving_config_names_a_bad_parser():
    from jaxpaged.serving.frontend import ServingConfig

    assert ServingConfig(served_model_name="m", reasoning_parser="qwen3").reasoning_parser
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServingConfig(served_model_name="m", reasoning_parser="gpt")
