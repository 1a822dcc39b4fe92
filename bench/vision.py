"""Images on the paged engine: the vision encoder's images/s at each compiled batch size, the
prefill cost of one image, and a multi-turn chat that resends its image with and without the
encoder cache.

    python bench/vision.py [--vision-layers 4] [--vision-width 384] [--image-size 224]
                           [--patch-size 14] [--tokens-per-image 64] [--text-layers 4]
                           [--hidden 512] [--turns 4] [--repeats 5]

The model is a Gemma 3 with images (SigLIP tower, projector, Gemma 3 decoder) of the given
shapes with random weights, built in memory (no download): what is timed depends on the
shapes only. Gemma 3 4B's own tower is ``--vision-layers 27 --vision-width 1152
--image-size 896 --tokens-per-image 256`` (its decoder: ``--text-layers 34 --hidden 2560``).

1. Encoder: the encoder program alone (``ImageEncoder.program``) on random pixels at each
   batch size it is compiled for, median of ``--repeats``: images/s.
2. Prefill per image: one request alone (prefix caching off), time to its first token for
   the same prompt with the image not yet encoded (cold), already encoded (cached), and
   without the image (text only). Encoder cost per image = cold - cached; prefill cost of the
   image's tokens = cached - text only.
3. Multi-turn replay: a chat whose first message holds the image; each turn appends the
   reply (``--reply-tokens``, greedy) and a new question and resends the whole chat. Each
   turn runs twice on one engine, alternating which goes first: with the encoder cache, and
   without it (the cache is cleared before the turn, so the resent image is encoded again, as
   on an engine that keeps no encoded images). Prefix caching is off: with it on, a resent
   image's blocks come from the prefix cache while they stay cached and the encoder is not
   asked. Prints each turn's time (first token and whole turn), checks the tokens agree.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _config(a: argparse.Namespace) -> dict:
    """A Gemma 3 config.json of these shapes (transformers' field names)."""
    heads = max(1, a.hidden // 128)
    types = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "mm_tokens_per_image": a.tokens_per_image,
        "image_token_index": a.vocab - 1,
        "eos_token_id": 1,
        "text_config": {
            "model_type": "gemma3_text", "vocab_size": a.vocab, "hidden_size": a.hidden,
            "intermediate_size": 4 * a.hidden, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "head_dim": a.hidden // heads,
            "num_hidden_layers": a.text_layers, "max_position_embeddings": 8192,
            "sliding_window": 512, "query_pre_attn_scalar": a.hidden // heads,
            "layer_types": [types[i % 6] for i in range(a.text_layers)],
            "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": a.vision_width,
            "intermediate_size": 4 * a.vision_width, "num_hidden_layers": a.vision_layers,
            "num_attention_heads": max(1, a.vision_width // 64), "image_size": a.image_size,
            "patch_size": a.patch_size, "vision_use_head": False,
        },
    }  # fmt: skip


def _random_params(shapes, rng):  # nested dict of shapes -> of float32 arrays
    import numpy as np

    if isinstance(shapes, dict):
        return {k: _random_params(v, rng) for k, v in shapes.items()}
    return rng.normal(0.0, 0.02, shapes).astype(np.float32)


def _expanded(spec, text: list[int]) -> list[int]:
    """``text`` ids, then one image as Gemma 3's processor expands it (boi, I placeholders,
    eoi; the tokens around them stand in for its blank lines)."""
    image = [spec.image_token_id] * spec.tokens_per_image
    boi, eoi = spec.image_token_id - 2, spec.image_token_id - 1  # any ids but the placeholder's
    return [*text, 3, boi, *image, eoi - 2, 3]


def _run(llm, rid: str, prompt: list[int], image, max_tokens: int):
    """One request alone: (seconds to its first token, seconds in all, its tokens)."""
    from jaxpaged import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    item = {"prompt_token_ids": prompt}
    if image is not None:
        item["multi_modal_data"] = {"image": image}
    start = time.perf_counter()
    engine.add_request(rid, item, params)
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = [t for c in out.outputs for t in c.token_ids]
            if new and first is None:
                first = time.perf_counter() - start
            tokens += new
    return first, time.perf_counter() - start, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--vision-layers", type=int, default=4)
    p.add_argument("--vision-width", type=int, default=384)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--patch-size", type=int, default=14)
    p.add_argument("--tokens-per-image", type=int, default=64)
    p.add_argument("--text-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=64, help="text around the image")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--question-tokens", type=int, default=32, help="appended each turn")
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import jax
    import numpy as np
    from PIL import Image

    from jaxpaged import LLM
    from jaxpaged.engine import LLMEngine
    from jaxpaged.models.gemma3_vl import param_shapes, parse_config

    rng = np.random.default_rng(a.seed)
    config = parse_config(_config(a))
    spec = config.image
    params = _random_params(param_shapes(config), rng)
    block = 16
    engine = LLMEngine.from_params(
        config, params, max_model_len=a.max_model_len, block_size=block,
        num_kv_blocks=2 * -(-a.max_model_len // block), max_num_seqs=2,
        max_num_batched_tokens=max(256, a.tokens_per_image), enable_prefix_caching=False,
        limit_mm_per_prompt=1, show_progress=False,
    )  # fmt: skip
    llm = LLM.from_engine(engine)
    enc = engine.runner.images
    print(f"model: SigLIP {a.vision_layers} x {a.vision_width} at {a.image_size} px "
          f"({(a.image_size // a.patch_size) ** 2} patches) -> {spec.tokens_per_image} tokens; "
          f"decoder {a.text_layers} x {a.hidden}; {jax.devices()[0].platform}", flush=True)  # fmt: skip

    # 1. the encoder alone at each compiled batch size
    for n in enc.batch_sizes:
        pixels = rng.normal(0, 1, (n, *enc.pixel_shape)).astype(np.float32)
        slots = np.arange(n, dtype=np.int32)
        times = []
        for _ in range(a.repeats + 1):  # the first: transfers, caches
            start = time.perf_counter()
            enc.cache = enc.program(engine.runner.params, enc.cache, pixels, slots,
                                    graphdef=enc.graphdef)  # fmt: skip
            jax.block_until_ready(enc.cache)
            times.append(time.perf_counter() - start)
        t = statistics.median(times[1:])
        print(f"encoder batch {n}: {t * 1e3:8.1f} ms, {n / t:8.1f} images/s", flush=True)

    # 2. prefill cost of one image
    def image(seed: int) -> Image.Image:
        g = np.random.default_rng(seed)
        return Image.fromarray(g.integers(0, 256, (a.image_size, a.image_size, 3), np.uint8))

    text = [2, *rng.integers(10, a.vocab - 8, a.prompt_tokens).tolist()]
    prompt = _expanded(spec, text[: len(text) // 2]) + text[len(text) // 2 :]
    runs: dict[str, list[float]] = {"cold": [], "cached": [], "text only": []}
    for r in range(a.repeats):
        im = image(1000 + r)
        enc.clear()
        runs["cold"].append(_run(llm, f"cold{r}", prompt, im, 1)[0])
        runs["cached"].append(_run(llm, f"hit{r}", prompt, im, 1)[0])
        runs["text only"].append(_run(llm, f"text{r}", text, None, 1)[0])
    med = {k: statistics.median(v) for k, v in runs.items()}
    print("time to first token, one request alone (median): " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in med.items()))  # fmt: skip
    print(f"per image: encoder {(med['cold'] - med['cached']) * 1e3:.1f} ms, prefill of its "
          f"{len(prompt) - len(text)} tokens {(med['cached'] - med['text only']) * 1e3:.1f} ms",
          flush=True)  # fmt: skip

    # 3. multi-turn replay resending the image, with and without the encoder cache
    im = image(7)
    chats = {"cache": list(prompt), "no cache": list(prompt)}
    order = list(chats)
    print(f"{'turn':>4} {'prompt':>6} " + " ".join(f"{n + ' ttft/turn':>22}" for n in chats))
    totals: dict[str, list[float]] = {n: [] for n in chats}
    for t in range(a.turns):
        row, outs = {}, {}
        for name in order:
            if name == "no cache":
                enc.clear()
            first, whole, out = _run(llm, f"{name}{t}", chats[name], im, a.reply_tokens)
            row[name], outs[name] = (first, whole), out
            totals[name].append(whole)
        assert outs["cache"] == outs["no cache"], f"turn {t}: the tokens differ"
        n = len(chats["cache"])
        question = rng.integers(10, a.vocab - 8, a.question_tokens).tolist()
        for name in chats:
            chats[name] += outs[name] + question
        order.reverse()
        print(f"{t:>4} {n:>6} " + " ".join(
            f"{row[k][0] * 1e3:>9.1f} / {row[k][1] * 1e3:>7.1f} ms" for k in chats), flush=True)  # fmt: skip
    m = llm.get_metrics()
    c, nc = statistics.median(totals["cache"]), statistics.median(totals["no cache"])
    print(f"median time per turn: cache {c * 1e3:.1f} ms, no cache {nc * 1e3:.1f} ms "
          f"({nc / c:.2f}x); encoder cache {m['mm_cache_hits']}/{m['mm_cache_queries']} hits, "
          f"{m['mm_encoder_seconds'] * 1e3:.1f} ms encoding; compilations after warm-up "
          f"{m['num_compilations_after_warmup']}; tokens identical")  # fmt: skip
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
