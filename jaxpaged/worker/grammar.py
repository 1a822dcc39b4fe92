"""Structured output on the host: grammars compiled with llguidance, one matcher per sampling
sequence, and the packed allowed-token bitmask of each sequence's next token.

Why llguidance (measured on the bundled SmolLM2 tokenizer, 49152 tokens; docs/install.md has the
figures): it needs nothing but numpy (xgrammar needs torch, triton and transformers), a
nested JSON schema compiles in ~14 ms (xgrammar ~50 ms), and a mask costs ~10-70 us a token
(xgrammar ~5 us), well under the step's own time.

The mask is the sampler's format: int32 ``[ceil(V / 32)]`` per sequence, bit ``j`` of word
``i`` set when token ``32 * i + j`` is allowed. A matcher needs every token before the next
mask, so the scheduler never plans a grammar request while its last token is in flight.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxpaged.sampling_params import StructuredOutput
from jaxpaged.worker.json_strict import close_schema

__all__ = ["GrammarCompiler", "GrammarMatchers", "mask_width"]

# strict JSON (the default) is compact: no whitespace between tokens, as vLLM's
# disable_any_whitespace; without it a small model fills nested objects with whitespace runs
_COMPACT = {"whitespace_flexible": False}
_CACHE_SIZE = 256  # compiled grammars kept (distinct schemas / regexes / grammars)


def mask_width(vocab_size: int) -> int:
    """int32 words of one sequence's packed mask."""
    return -(-vocab_size // 32)


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec (not yet checked against the tokenizer)."""
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_output.json is not valid JSON: {e}") from None
        if not spec.strict:
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            close_schema(schema), defaults=_COMPACT
        )
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_COMPACT if spec.strict else None
        )
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # Lark string literals take JSON's escapes
        return "start: " + " | ".join(json.dumps(c) for c in spec.choice)
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def _llg_tokenizer(tokenizer: Any, n_vocab: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ``tokenizer``. transformers' fast tokenizers go through
    ``llguidance.hf``, imported here (it imports transformers) so an engine that never uses
    a grammar does not pay for it; a tokenizer of the ``tokenizers`` library alone (the
    terminal commands', jaxpaged.models.light_tokenizer) hands over its backend directly."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not type(tokenizer).__module__.startswith("transformers"):
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
    from llguidance import hf

    return hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)


class GrammarCompiler:
    """Checks and caches grammars for one tokenizer (thread-safe: admission runs in the
    callers' threads). The llguidance tokenizer is built on first use (~1.5 s here)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: collections.OrderedDict[StructuredOutput, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars checked (cache misses)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = _llg_tokenizer(self._hf, self.vocab_size, self._eos)
            except Exception as e:  # not a fast Hugging Face tokenizer
                raise ValueError(
                    "structured_output: this model's tokenizer cannot drive a grammar "
                    f"({type(e).__name__}: {e})"
                ) from e
        return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The checked grammar of ``spec``; ValueError naming ``structured_output`` if it is
        invalid (a bad schema, regex or grammar)."""
        with self._lock:
            text = self._cache.get(spec)
            if text is not None:
                self._cache.move_to_end(spec)
                return text
            tokenizer = self._llg_tokenizer()
            try:
                text = _grammar_text(spec)
            except ValueError as e:
                raise ValueError(f"structured_output: invalid grammar: {e}") from None
            error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
            if error:
                raise ValueError(f"structured_output: invalid grammar: {error.strip()}")
            self.num_compiled += 1
            self._cache[spec] = text
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return text

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        text = self.grammar(spec)
        with self._lock:
            return llguidance.LLMatcher(self._llg_tokenizer(), text)


class GrammarMatchers:
    """The matchers of the running grammar requests, by scheduler request id (engine thread
    only)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # fills several masks on llguidance's own threads (no GIL): 32 rows of a JSON schema
        # took 0.09 ms against 0.3 ms one by one here
        self._executor = llguidance.LLExecutor()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, spec: StructuredOutput) -> None:
        self._matchers[request_id] = self.compiler.matcher(spec)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher; False when the token breaks the grammar or the
        grammar has ended (the request must stop)."""
        m = self._matchers[request_id]
        return m.consume_token(token_id) and not m.is_stopped() and not m.is_error()

    def masks(self, request_ids: Sequence[str]) -> np.ndarray:  # int32 [len, W]
        """The packed allowed-token masks of the requests' next tokens."""
        out = llnp.allocate_token_bitmask(len(request_ids), self.compiler.vocab_size)
        if len(request_ids) == 1:
            llnp.fill_next_token_bitmask(self._matchers[request_ids[0]], out, 0)
        else:
            rows = [(self._matchers[rid], i) for i, rid in enumerate(request_ids)]
            llnp.fill_next_token_bitmask_par(self._executor, rows, out)
        return out[:, : mask_width(self.compiler.vocab_size)]

    def masks_through(
        self, request_id: str, drafts: Sequence[int]
    ) -> np.ndarray:  # int32 [len(drafts) + 1, W]
        """Speculative decoding: the masks of the request's next token and of the token after
        each draft, as if the drafts before it were accepted (a copy of the matcher follows
        them; the request's own is untouched). Rows after the first draft the grammar
        rejects allow every token: verification stops at that draft (the target's sample
        there is masked, so it never equals it), so nothing sampled after it is emitted."""
        m = self._matchers[request_id].deep_copy()
        out = llnp.allocate_token_bitmask(len(drafts) + 1, self.compiler.vocab_size)  # all -1
        llnp.fill_next_token_bitmask(m, out, 0)
        for j, t in enumerate(drafts):
            if not (int(out[j, t >> 5]) >> (t & 31)) & 1 or not m.consume_token(t):
                break
            llnp.fill_next_token_bitmask(m, out, j + 1)
        return out[:, : mask_width(self.compiler.vocab_size)]

    def retain(self, alive: Iterable[str]) -> None:
        """Drops the matchers of requests that ended."""
        keep = set(alive)
        for rid in [r for r in self._matchers if r not in keep]:
            del self._matchers[rid]
