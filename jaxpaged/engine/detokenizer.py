"""Incremental detokenization of a request's output, with stop strings.

Decoding each new token alone is wrong in two ways: a UTF-8 character can be split over
several byte-level tokens (alone, each decodes to U+FFFD), and sentencepiece-style
tokenizers drop or add the leading space of a piece depending on what precedes it. So, as
in vLLM, we decode a short window of ids twice: ``ids[prefix:read]`` (text already sent)
and ``ids[prefix:]``; the delta is the difference. While the window's text ends in U+FFFD
(an unfinished character) nothing is sent and the window grows.

Stop strings are searched in the text so far. The stop string (and anything after it) is
not returned unless ``include_stop_str_in_output``; and a tail of the text that could be
the start of a stop string is held back until the next tokens either complete the match or
break it, so no partial stop string ever reaches a stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids decoded before the first output token, so its leading space comes out right.
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    """What the detokenizer needs: transformers tokenizers and `tokenizers.Tokenizer` fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's new token ids into text deltas, stopping on stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        stop = list(stop or ())
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: stop strings must be non-empty str, got {s!r}")
        # transformers' fast tokenizers decode through their `tokenizers` backend and then
        # (optionally) clean up spaces; calling the backend directly is ~4x cheaper and
        # gives the same text when that clean-up is off (as for SmolLM2, Llama, Qwen).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decoder = backend
        else:
            self._decoder = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in stop), default=0)
        context = list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context  # only the tail the decode windows need
        self._prefix = 0  # window start: context before the unsent ids
        self._read = len(context)  # ids before this are in `_text` already
        self._text = ""  # decoded output text (stop truncation applied)
        self._sent = 0  # characters of `_text` already returned
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def output_text(self) -> str:
        """Text returned so far (all deltas concatenated)."""
        return self._text[: self._sent]

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_pending(self, final: bool) -> str:
        """New text of the ids past `_read`; "" while it ends in an unfinished character."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if not final and (
            len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        delta = full_text[len(prefix_text) :]
        # Slide the window: keep the just-read ids as context for the next decode.
        self._prefix, self._read = self._read, len(self._ids)
        drop = self._prefix
        if drop:  # keep the id list short
            del self._ids[:drop]
            self._prefix -= drop
            self._read -= drop
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self._include_stop:
            return 0
        text = self._text
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text) - self._sent), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _check_stop(self, new_chars: int) -> None:
        """Look for a stop string overlapping the last `new_chars` characters."""
        if not self._stop or new_chars == 0:
            return
        start = max(0, len(self._text) - new_chars - self._max_stop_len + 1)
        best_at, best = -1, None
        for s in self._stop:
            at = self._text.find(s, start)
            if at != -1 and (best_at == -1 or at < best_at):
                best_at, best = at, s
        if best is not None:
            end = best_at + (len(best) if self._include_stop else 0)
            self._text = self._text[:end]
            self._sent = min(self._sent, end)
            self.stopped = True
            self.stop_reason = best

    def add_tokens(self, new_ids: Iterable[int]) -> tuple[str, bool]:
        """Append sampled ids; return the text that may be sent now and whether a stop
        string matched (then the request is done and later calls return ``("", True)``)."""
        if self.stopped:
            return "", True
        self._ids.extend(int(i) for i in new_ids)
        delta = self._decode_pending(final=False)
        self._text += delta
        self._check_stop(len(delta))
        end = len(self._text) if self.stopped else len(self._text) - self._held_back()
        out = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return out, self.stopped

    def flush(self) -> str:
        """The request ended for another reason (EOS, max_tokens, abort): return what was
        held back, unfinished characters included (as U+FFFD, as a full decode would)."""
        if not self.stopped:
            delta = self._decode_pending(final=True)
            self._text += delta
            self._check_stop(len(delta))
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out


class NullDetokenizer:
    """For engines without a tokenizer (token-id prompts only): no text, no stop strings."""

    stopped = False
    stop_reason: str | None = None

    def add_tokens(self, new_ids: Iterable[int]) -> tuple[str, bool]:
        return "", False

    def flush(self) -> str:
        return ""
