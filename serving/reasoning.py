"""Reasoning parsers (``--reasoning-parser``): split a chat reply's ``<think>...</think>`` part
into ``reasoning_content``, whole or as it streams.

``qwen3``: the reply is reasoning only when it opens with ``<think>``. ``deepseek_r1``: the
chat template opens the think block itself, so the reply starts as reasoning (a ``<think>``
the model writes anyway is dropped). Either way reasoning ends at ``</think>`` and the rest is
content; a reply cut off before ``</think>`` is all reasoning. A tag split across stream
deltas is held back until it is whole, so no delta ever shows part of one.
"""

from __future__ import annotations

__all__ = ["REASONING_PARSERS", "ThinkSplitter"]

REASONING_PARSERS = ("qwen3", "deepseek_r1")
_OPEN, _CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """One reply's splitter: ``feed(text)`` per delta, then ``flush()``; each returns the
    (reasoning, content) text it can release."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning parser must be one of {list(REASONING_PARSERS)}, got {parser!r}"
            )
        self._starts_thinking = parser == "deepseek_r1"
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._held = ""
        self.reasoned = False  # the reply had a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(_OPEN):
                buf, self._state = stripped[len(_OPEN) :], "reasoning"
            elif _OPEN.startswith(stripped):  # maybe the opening tag, not whole yet
                self._held = buf
                return "", ""
            else:
                self._state = "reasoning" if self._starts_thinking else "content"
            self.reasoned = self._state == "reasoning"
        if self._state == "reasoning":
            end = buf.find(_CLOSE)
            if end < 0:
                keep = _partial_suffix(buf, _CLOSE)
                self._held = buf[len(buf) - keep :] if keep else ""
                return buf[: len(buf) - keep], ""
            reasoning, buf, self._state = buf[:end], buf[end + len(_CLOSE) :], "content"
        content = buf
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held back when the reply ends."""
        held, self._held = self._held, ""
        if self._state == "start":  # the reply ended inside what may have been "<think>"
            self._state = "reasoning" if self._starts_thinking else "content"
            self.reasoned = self._state == "reasoning"
        return (held, "") if self._state == "reasoning" else ("", held)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply: (reasoning, or None when it had no reasoning part; content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.flush()
        return (r1 + r2 if self.reasoned else None), c1 + c2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a tag cut by a delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
