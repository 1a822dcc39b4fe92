"""Tensor-parallel checks of the families split beyond the Llama layout (GPT-2/OPT, Gemma,
BLOOM, the MoE families) and of the 8-bit KV cache, each against transformers' own greedy
tokens or TP=1's; registered in tp_checks.py."""

from __future__ import annotations

import os

from tp_cases import MAX_TOKENS, PROMPTS, make_tiny_model
from tp_harness import Ctx, assert_sharded, greedy


def check_bloom(ctx: Ctx) -> None:
    """BLOOM (ALiBi, 6 heads) at TP=2: each device runs 3 heads with its own 3 slopes (not a
    uniform share of a power-of-two sequence); greedy tokens equal transformers' own, with a
    prompt prefilled beside decodes."""
    import torch
    import transformers

    path = os.path.join(ctx.workdir, "bloom")
    config = transformers.BloomConfig(
        vocab_size=256, hidden_size=48, n_layer=2, n_head=6, initializer_range=0.2
    )
    torch.manual_seed(0)
    hf = transformers.BloomForCausalLM(config).eval()
    with torch.no_grad():  # random norms and biases, so that every parameter matters
        for name, p in hf.named_parameters():
            if "layernorm" in name or "ln_f" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(path)
    make_tiny_model("llama", os.path.join(ctx.workdir, "bloom_tok"))  # borrow its tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ctx.workdir, "bloom_tok"))
    tok.save_pretrained(path)
    prompts = [[5, 9, 30, 7, 2, 11], [17], [42]]
    want = hf_greedy(path, prompts)
    assert len({t for seq in want for t in seq}) > 3, f"degenerate reference {want}"
    got, llm = greedy(path, 2, prompts=prompts)
    assert got == want, f"bloom TP=2: {got} != transformers {want}"
    assert_sharded(llm.engine, 2, num_kv_heads=6, vocab=256)


def hf_greedy(path: str, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy tokens (float32, every step a full forward over the sequence)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        out.append(ids[len(prompt) :])
    return out


def check_family_vs_hf(
    ctx: Ctx, family: str, tps: tuple[int, ...], *, with_tp1: bool = False
) -> None:
    """A family that tensor parallelism newly splits: each TP in ``tps`` gives transformers'
    greedy tokens (and TP=1's, ``with_tp1``), and the weights and pool are split as the
    tables above say."""
    import json as _json

    path = ctx.model(family)
    with open(os.path.join(path, "config.json")) as f:
        hf = _json.load(f)
    want = hf_greedy(path)
    assert len({t for seq in want for t in seq}) > 3, f"degenerate reference {want}"
    if with_tp1:
        assert ctx.ref(family) == want, f"{family} TP=1 {ctx.ref(family)} != transformers {want}"
    heads = hf.get("num_attention_heads") or hf["n_head"]
    for tp in tps:
        got, llm = greedy(path, tp)
        assert got == want, f"{family} TP={tp}: {got} != transformers {want}"
        kv_heads = hf.get("num_key_value_heads") or heads
        assert_sharded(llm.engine, tp, num_kv_heads=kv_heads, vocab=hf["vocab_size"])


def check_warmup_family(ctx: Ctx, family: str) -> None:
    """Warm-up on, TP 2, prompts of several lengths (prefill chunks and decode steps mixed):
    nothing compiles after the warm-up, the tokens are transformers', and the weights and
    pool are split as the tables above say."""
    from jaxpaged import LLM, SamplingParams

    prompts = [list(range(3, 12)), list(range(20, 25)), [7, 8, 9]]  # the first in 2 chunks
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(max_model_len=24, max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=12)
    llm = LLM(ctx.model(family), tensor_parallel_size=2, block_size=8, show_progress=False, **kw)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    m = llm.get_metrics()
    cfg = llm.engine.model_config  # no KV heads replicated at TP 2 in these models
    assert_sharded(llm.engine, 2, num_kv_heads=cfg.num_kv_heads, vocab=cfg.vocab_size)
    llm.engine.close()
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = hf_greedy(ctx.model(family), prompts, 8)
    assert got == want, f"{family} TP=2 warmed up: {got} != transformers {want}"
    assert m["num_compilations_after_warmup"] == 0, (family, m)


def check_kv_8bit(ctx: Ctx, kv_dtype: str, tps: tuple[int, ...]) -> None:
    """kv_cache_dtype int8 / fp8 under TP (KV heads replicated at 4): the same greedy tokens
    as TP=1 with the same cache dtype, the scales split with the KV heads."""
    path = ctx.model("llama")
    ref, _ = greedy(path, 1, kv_cache_dtype=kv_dtype)
    assert len({t for seq in ref for t in seq}) > 3, f"degenerate reference {ref}"
    for tp in tps:
        got, llm = greedy(path, tp, kv_cache_dtype=kv_dtype)
        assert got == ref, f"{kv_dtype} TP={tp}: {got} != TP=1 {ref}"
        assert len(llm.engine.runner.pool) == 4, "an 8-bit pool has pages and scales"
        assert_sharded(llm.engine, tp, num_kv_heads=2, vocab=256)


def check_quantized_families(ctx: Ctx, cases: tuple[tuple[str, str], ...]) -> None:
    """int8 / fp8 weights on the families beyond the Llama layout at TP=2: greedy tokens
    equal TP=1's (XLA's dequant dots on both), and every matmul weight the family declares
    is quantized, its values split on the float leaf's axis and its scales alike, except
    over a contracted axis, which they hold once."""
    from jaxpaged.distributed.parallel import split_axes
    from jaxpaged.models.quant import QuantizedWeight
    from jaxpaged.models.registry import family_of

    for family, method in cases:  # (family, quantization method)
        path = ctx.model(family)
        kw = dict(quantization=method, attention_backend="xla")
        ref, _ = greedy(path, 1, **kw)
        assert len({t for seq in ref for t in seq}) > 3, f"degenerate reference {ref}"
        got, llm = greedy(path, 2, **kw)
        assert got == ref, f"{family} {method} TP=2: {got} != TP=1 {ref}"
        cfg = llm.engine.model_config
        axes, layers = split_axes(cfg), llm.engine.runner.params["layers"]
        for name in family_of(cfg).matmul_weights:
            w = layers[name]
            assert isinstance(w, QuantizedWeight), (family, name)
            split = axes[f"layers/{name}"]
            for values, scales in zip(
                w.values.addressable_shards, w.scales.addressable_shards, strict=True
            ):
                assert values.data.shape[split] == w.shape[split] // 2, (family, name)
                whole = w.scales.shape[split]
                assert scales.data.shape[split] == (whole // 2 if whole > 1 else 1), name
        llm.engine.close()
