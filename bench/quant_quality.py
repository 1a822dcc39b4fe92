"""Quality of weight quantization on one model against its float32 self, in one process.

    python bench/quant_quality.py [--text FILE] [--text-tokens 1024] [--greedy-tokens 32]
                                  [--prequantized]

For int8 (the native CPU kernel, as served), fp8 (XLA's dequant dots), "gguf" (a GGUF
model's own weights in the native group-wise kernel, as served; float32 is their float
expansion, so this measures the kernel alone) and "g4" (the float32 weights requantized to
4 bits in groups of 32 with a min, quant.quantize_grouped: what the 4-bit format loses from
a float model): the first position where greedy decoding parts from float32's on fixed chat
prompts (teacher-forced on float32's greedy tokens, models/quant/quality.py) and the
perplexity on the first ``--text-tokens`` tokens of ``--text`` (default: chapters 1-3 of
Pride and Prejudice, bench/data/README.md) against float32's.

``--prequantized`` also writes the model as pre-quantized checkpoints and measures each as
loaded from its folder: compressed-tensors fp8 and int8 per channel and W4A16 in groups of 32
(written by the compressed-tensors library, scales from min/max) and AWQ and GPTQ 4-bit in
groups of 64 (tests/quant/checkpoint_writers.py: min-max round-to-nearest, no calibration, so
these are the formats' floor, not what AWQ's or GPTQ's own searches reach); lm_head stays
float.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 10.",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    p.add_argument(
        "--text", default=str(Path(__file__).parent / "data" / "pride_and_prejudice_ch1-3.txt")
    )
    p.add_argument("--text-tokens", type=int, default=1024)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--prequantized", action="store_true", help="also pre-quantized checkpoints")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.engine import LLMEngine
    from jaxpaged.kernels.cpu.backend import CpuBackend
    from jaxpaged.kernels.cpu.linear_q4 import linear_q4
    from jaxpaged.models import load_tokenizer
    from jaxpaged.models.gguf_params import has_quantized_weights, load_gguf_host_params
    from jaxpaged.models.linear import map_matmul_weights
    from jaxpaged.models.llama import LINEARS
    from jaxpaged.models.loader import load_host_params
    from jaxpaged.models.quant import quantize_grouped, quantize_params, weight_bytes
    from jaxpaged.models.quant.quality import first_divergence, perplexity
    from jaxpaged.models.registry import family_of, load_config
    from jaxpaged.models.resolve import resolve_model_folder

    folder = str(resolve_model_folder(args.model))
    config = load_config(folder)
    tok = load_tokenizer(folder)
    host = load_host_params(folder, config, np.float32, progress=False)
    f32 = jax.tree.map(jnp.asarray, host)
    f32_bytes = weight_bytes(f32)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True)["input_ids"]
        for q in PROMPTS
    ]  # fmt: skip
    engine = LLMEngine.from_params(config, f32, tok, max_model_len=512, max_num_seqs=4,
                                   num_kv_blocks=128, enforce_eager=True, show_progress=False)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True)
    outs = LLM.from_engine(engine).generate(prompts, sp, use_tqdm=False)
    engine.close()
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    ids = tok(Path(args.text).read_text())["input_ids"][: args.text_tokens]
    base = perplexity(f32, config, ids)
    print(f"text: {args.text}, {len(ids)} tokens; float32 perplexity {base:.4f}", flush=True)
    methods = ["int8", "fp8", "g4"] + (["gguf"] if has_quantized_weights(folder) else [])
    for method in methods:
        linear_fn = None
        if method == "gguf":
            params, linear_fn = (
                load_gguf_host_params(folder, config, np.float32, family_of(config)),
                linear_q4,
            )
        elif method == "g4":  # every matmul weight, as params.quantize_params picks them
            layers = dict(host["layers"])
            for name, in_axes in {"wqkv": 1, "wo": 3, "w_gate_up": 1, "w_down": 1}.items():
                layers[name] = quantize_grouped(layers[name], in_axes, 32, 4)
            head = host.get("lm_head", host["embed"])
            params = {**host, "layers": layers, "lm_head": quantize_grouped(head, 1, 32, 4)}
            linear_fn = linear_q4
        else:
            params = quantize_params(host, config, method)
        params = jax.tree.map(jnp.asarray, params)
        nbytes = weight_bytes(params)  # before any kernel layout (which copies a tied head)
        if method == "int8":  # as served: int8 layers in linear_q8, the float head in cpu.linear
            weight_map = lambda p, fn: map_matmul_weights(p, LINEARS, fn)  # noqa: E731
            backend = CpuBackend.select(params, weight_map, attention_backend="cpu", sharded=False)
            params, linear_fn = backend.pack_weights(params, weight_map), backend.kernels.linear
        parted = [
            first_divergence(params, config, q, g, linear_fn=linear_fn)
            for q, g in zip(prompts, greedy, strict=True)
        ]
        ppl = perplexity(params, config, ids, linear_fn=linear_fn)
        print(f"{method}: greedy first divergence per prompt (of {args.greedy_tokens}; None = "
              f"never) {parted}; perplexity {ppl:.4f} ({ppl / base - 1:+.2%}); weights "
              f"{nbytes / 2**20:.1f} MiB (float32 {f32_bytes / 2**20:.1f})",
              flush=True)  # fmt: skip
    if args.prequantized:
        for name, params in _prequantized(folder):
            parted = [
                first_divergence(params, config, q, g) for q, g in zip(prompts, greedy, strict=True)
            ]
            ppl = perplexity(params, config, ids)
            print(f"{name}: greedy first divergence per prompt {parted}; perplexity "
                  f"{ppl:.4f} ({ppl / base - 1:+.2%})", flush=True)  # fmt: skip
    return 0


def _prequantized(folder: str):
    """(name, params loaded from a pre-quantized checkpoint of ``folder``'s model), one at a
    time (each written to a temporary folder, loaded by models/loader.py as a user's)."""
    import sys
    import tempfile

    import torch
    import transformers

    from jaxpaged.models.loader import load_model

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "quant"))
    from checkpoint_writers import write_4bit_checkpoint, write_compressed_tensors

    def fresh():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    writers = {
        "compressed-tensors fp8 (channel)": lambda d: write_compressed_tensors(fresh(), d, "fp8-channel"),
        "compressed-tensors int8 (channel, packed)": lambda d: write_compressed_tensors(fresh(), d, "int8-packed"),
        "compressed-tensors W4A16 (groups of 32, symmetric)": lambda d: write_compressed_tensors(fresh(), d, "w4a16"),
        "AWQ 4-bit g64": lambda d: write_4bit_checkpoint(d, "awq", group=64, model=fresh()),
        "GPTQ 4-bit g64": lambda d: write_4bit_checkpoint(d, "gptq_v2", group=64, model=fresh()),
    }  # fmt: skip
    for name, write in writers.items():
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp))
            yield name, load_model(tmp, progress=False)[1]


if __name__ == "__main__":
    raise SystemExit(main())
