"""What the terminal commands (`generate`, `chat`) share: an engine sized for the one sequence a
person waits on, its tokens streamed as they come, and Ctrl-C ending the reply, not the process.

The engine of such a command serves one request at a time, so it is built for exactly that:
one sequence (``max_num_seqs=1``: no prefill-cap calibration, nothing runs beside it), a KV
pool of one ``max_model_len`` sequence instead of the server's 1 GiB, and only the step shapes
the request reaches, compiled when first needed (``enforce_eager``), or loaded whole from
the program cache (jaxpaged.worker.program_store: no tracing, no lowering) when an earlier
run compiled them. The pool's size depends on ``max_model_len`` alone, not on the
prompt: its shape is part of every compiled program, so a fixed size lets the next run load
them all from the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from jaxpaged.args import EngineArgs
from jaxpaged.engine import LLMEngine, Prompt, process_owner_args
from jaxpaged.llm import LLM
from jaxpaged.outputs import RequestOutputKind
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.program_store import default_program_cache_dir

__all__ = [
    "Reply",
    "add_engine_flags",
    "add_sampling_flags",
    "configure_logging",
    "interrupt_sets",
    "one_sequence_llm",
    "sampling_params",
    "stream_reply",
]

BLOCK_SIZE = EngineArgs.block_size  # the engine's default block size


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --max-model-len, --seed, --verbose."""
    p.add_argument(
        "--model",
        default=None,
        help="local folder, HF hub id or .gguf file (default: the bundled SmolLM2)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log the engine's set-up and per-reply figures (prompt tokens, prefix-cache "
        "hits, speed) on stderr",
    )


def add_sampling_flags(p: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """--max-tokens, --temperature, --top-p."""
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``p.error`` (status 2) on a flag out of range."""
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_model_len < 2:
        p.error(f"--max-model-len must be >= 2, got {args.max_model_len}")


def configure_logging(verbose: bool) -> None:
    """The command's own process: warnings only on stderr, and jaxpaged's set-up lines with
    ``verbose``. JAX's backend probe ("Unable to initialize backend 'tpu'") logs at INFO on
    its own logger, so it stays out of a person's terminal."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    logging.getLogger("jaxpaged").setLevel(logging.INFO if verbose else logging.WARNING)


def one_sequence_llm(
    args: argparse.Namespace, *, owns_process: bool = True, one_shot: bool = False
) -> LLM:
    """An engine for one request at a time (see the module's docstring); with
    ``owns_process`` (the commands) it configures the process and keeps compiled programs
    in the default compile cache. ``one_shot`` (``generate``: one reply, then exit) skips
    moving the weights onto huge pages: up to ~0.3 s of CPU before the first token, repaid
    only after thousands of tokens."""
    return LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=1,
        num_kv_blocks=-(-args.max_model_len // BLOCK_SIZE),
        enforce_eager=True,
        tokenizer_mode="tokenizers",  # no transformers import: ~0.7 s of the start
        huge_pages=not one_shot,
        seed=args.seed or 0,
        show_progress=args.verbose,
        **(process_owner_args() if owns_process else {}),
        **({"program_cache_dir": default_program_cache_dir()} if owns_process else {}),
    )


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=max_tokens
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply:
    """One streamed generation: its text and tokens, why it ended ("stop", "length",
    "abort" after Ctrl-C), its prompt's size and how much of it the prefix cache held
    (the engine's prefix-hit counter over this request), and its times in seconds."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    prefix_hit_tokens: int
    first_token_s: float | None
    total_s: float

    def summary(self) -> str:
        """One line for a person: prompt, prefix-cache hits, speed."""
        n = len(self.token_ids)
        decode_s = self.total_s - (self.first_token_s or 0.0)
        speed = f", {(n - 1) / decode_s:.1f} tok/s" if n > 1 and decode_s > 0 else ""
        first = "" if self.first_token_s is None else f", first token {self.first_token_s:.2f} s"
        return (
            f"[prompt {self.prompt_tokens} tokens, {self.prefix_hit_tokens} from the prefix "
            f"cache; {n} tokens{first}{speed}; {self.finish_reason}]"
        )


def stream_reply(
    engine: LLMEngine,
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    write: Callable[[str], object],
    stop: threading.Event,
) -> Reply:
    """Runs one request to its end, passing each new piece of text to ``write`` as the
    engine produces it. ``stop`` set (Ctrl-C): the request is aborted between steps, which
    frees its blocks, and the reply ends with finish_reason "abort". ValueError (a bad
    prompt) before anything runs."""
    hits_before = engine.get_stats().prefix_cache_hits
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params, output_kind=RequestOutputKind.DELTA)
    pieces: list[str] = []
    tokens: list[int] = []
    first_token_s = None
    finish_reason = None
    prompt_tokens = 0
    try:
        while finish_reason is None:
            if stop.is_set():
                final = engine.abort(request_id)
                finish_reason = "abort"
                outputs = [] if final is None else [final]
            else:
                outputs = engine.step()
            for out in outputs:
                if out.request_id != request_id:
                    continue
                prompt_tokens = len(out.prompt_token_ids)
                sample = out.outputs[0]
                if sample.token_ids and first_token_s is None:
                    first_token_s = time.perf_counter() - start
                tokens += sample.token_ids
                if sample.text:
                    pieces.append(sample.text)
                    write(sample.text)
                if out.finished:
                    finish_reason = sample.finish_reason or "stop"
    except BaseException:
        engine.abort(request_id)
        raise
    # the counter is the engine's snapshot after its latest step: the admission is in it
    hits = engine.get_stats().prefix_cache_hits - hits_before
    return Reply(
        text="".join(pieces),
        token_ids=tuple(tokens),
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        prefix_hit_tokens=hits,
        first_token_s=first_token_s,
        total_s=time.perf_counter() - start,
    )


@contextmanager
def interrupt_sets(stop: threading.Event) -> Iterator[threading.Event]:
    """While inside: Ctrl-C (SIGINT) sets ``stop`` instead of raising, so the engine is
    never interrupted in the middle of a step; a second Ctrl-C before ``stop`` is cleared
    raises KeyboardInterrupt as usual. Main thread only (the commands' own process)."""
    stop.clear()

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
