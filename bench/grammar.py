"""What structured output costs: decode tok/s with and without a JSON schema, side by side.

    python bench/grammar.py [--model M] [--batch-sizes 1,32] [--max-tokens 64] [--rounds 2]
        [--compare-engines]

At each batch size the same chat prompts run unconstrained and under one JSON schema (an
object holding a long array of short strings, so the grammar does not end the output early),
temperature 0.8, seeded, in turn for --rounds rounds (the best round of each is quoted: this
machine's speed drifts). tok/s counts the tokens each request generated. A grammar request
waits for its previous token before its next step (the engine's overlapped loop cannot feed
it a token the host has not seen, as its next mask needs that token), so it decodes every
other step; the host's mask time (llguidance, per sampling row) is reported on its own.

--compare-engines times llguidance and xgrammar (if installed) on the model's tokenizer:
tokenizer set-up, compiling a nested JSON schema, and the per-token mask, which is how
jaxpaged's grammar engine was chosen (BUILD.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 24}},
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"pattern": "[0-9]{5}"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "address"],
}
NESTED_SAMPLE = {
    "name": "Ada Lovelace",
    "age": 36,
    "tags": ["a", "c"],
    "address": {"city": "London", "zip": "12345"},
}


def _run(llm: Any, prompts: list[list[dict]], params: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs), seconds


def bench_decode(args: argparse.Namespace) -> list[dict]:
    from jaxpaged import LLM, SamplingParams, StructuredOutput
    from jaxpaged.worker import grammar

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=max(sizes),
        enforce_eager=args.enforce_eager,
        show_progress=False,
    )
    mask_time = [0.0, 0]  # seconds in GrammarMatchers.masks, rows masked
    real_masks = grammar.GrammarMatchers.masks

    def timed_masks(self: Any, request_ids: Any) -> Any:
        t0 = time.perf_counter()
        out = real_masks(self, request_ids)
        mask_time[0] += time.perf_counter() - t0
        mask_time[1] += len(request_ids)
        return out

    grammar.GrammarMatchers.masks = timed_masks
    rows = []
    for b in sizes:
        prompts = [
            [{"role": "user", "content": f"List {10 + i} things you would pack for a trip."}]
            for i in range(b)
        ]
        common = dict(temperature=0.8, seed=0, max_tokens=args.max_tokens)
        plain = SamplingParams(**common, ignore_eos=True)
        constrained = SamplingParams(**common, structured_output=StructuredOutput(json=SCHEMA))
        _run(llm, prompts[:1], constrained)  # grammar compile and first-use costs, not timed
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, params in (("plain", plain), ("json_schema", constrained)):
                mask_time[:] = [0.0, 0]
                tokens, seconds = _run(llm, prompts, params)
                rate = tokens / seconds
                if rate > best.get(name, 0.0):
                    best[name] = rate
                    if name == "json_schema":
                        best["mask_us_per_row"] = 1e6 * mask_time[0] / max(mask_time[1], 1)
                        best["json_tokens"] = tokens / b
        row = {
            "batch": b,
            "plain_tok_s": round(best["plain"], 1),
            "json_schema_tok_s": round(best["json_schema"], 1),
            "ratio": round(best["json_schema"] / best["plain"], 3),
            "mask_us_per_row": round(best["mask_us_per_row"], 1),
            "json_tokens_per_request": round(best["json_tokens"], 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def compare_engines(model: str) -> list[dict]:
    """Tokenizer set-up, NESTED's compile and per-token mask for each grammar engine."""
    import transformers

    from jaxpaged.models import default_model_path

    hf = transformers.AutoTokenizer.from_pretrained(model or default_model_path())
    vocab = len(hf)
    ids = hf(json.dumps(NESTED_SAMPLE), add_special_tokens=False)["input_ids"]
    results = []

    import llguidance
    import llguidance.hf
    import llguidance.numpy as llnp

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(NESTED))
    compile_s = time.perf_counter() - t0
    mask = llnp.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        llnp.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t)
    results.append(("llguidance", setup, compile_s, times))
    try:
        import xgrammar
    except ImportError:
        print("xgrammar is not installed: skipped")
    else:
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        compiler = xgrammar.GrammarCompiler(info)
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(NESTED))
        compile_s = time.perf_counter() - t0
        m = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t)
        results.append(("xgrammar", setup, compile_s, times))
    rows = []
    for name, setup, compile_s, times in results:
        row = {
            "engine": name,
            "tokenizer_setup_ms": round(1e3 * setup, 1),
            "compile_ms": round(1e3 * compile_s, 1),
            "mask_median_us": round(1e6 * statistics.median(times), 1),
            "mask_max_us": round(1e6 * max(times), 1),
            "tokens": len(ids),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--enforce-eager", action="store_true", help="skip warm-up (smoke tests)")
    p.add_argument("--compare-engines", action="store_true")
    args = p.parse_args(argv)
    if args.compare_engines:
        compare_engines(args.model)
    else:
        bench_decode(args)


if __name__ == "__main__":
    main()
