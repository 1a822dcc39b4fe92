"""Tensor-parallel checks, run in ONE subprocess with 4 simulated CPU devices by
test_parallel.py (so the rest of the suite keeps its single device and every check shares one
JAX start-up and its compiled programs).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel/tp_checks.py \
        --workdir /tmp/x --out /tmp/x/results.json [CHECK ...]

Each check raises AssertionError on failure; the JSON maps check -> "ok" or the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tp_cases import ENGINE_ARGS, MAX_TOKENS, PROMPTS  # noqa: E402
from tp_family_checks import (  # noqa: E402
    check_bloom,
    check_family_vs_hf,
    check_kv_8bit,
    check_quantized_families,
    check_warmup_family,
)
from tp_harness import SPLIT_AXIS, Ctx, assert_sharded, greedy, leaves  # noqa: E402
from tp_quant_checks import (  # noqa: E402
    check_grouped_gguf,
    check_grouped_prequantized,
    check_grouped_split_refused,
)
from tp_spec_checks import check_spec_identity  # noqa: E402

# ------------------------------------------------------------------------------ checks


def check_family(ctx: Ctx, family: str, sizes: tuple[int, ...] = (2, 4)) -> None:
    import json as _json

    path = ctx.model(family)
    with open(os.path.join(path, "config.json")) as f:
        hf = _json.load(f)
    ref = ctx.ref(family)
    assert len({t for seq in ref for t in seq}) > 3, f"degenerate reference {ref}"
    for tp in sizes:
        got, llm = greedy(path, tp)
        assert got == ref, f"{family} TP={tp}: {got} != TP=1 {ref}"
        assert_sharded(
            llm.engine, tp, num_kv_heads=hf["num_key_value_heads"], vocab=hf["vocab_size"]
        )


def check_multihost(ctx: Ctx) -> None:
    """Two processes x 2 CPU devices, one global mesh of 4 (KV heads replicated), gloo."""
    import socket

    path = ctx.model("llama")
    ref = ctx.ref("llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    worker = os.path.join(here, "multihost_worker.py")
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    outs = [os.path.join(ctx.workdir, f"rank{r}.json") for r in (0, 1)]
    logs = [open(os.path.join(ctx.workdir, f"rank{r}.log"), "w") for r in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, worker, path, str(r), f"127.0.0.1:{port}", outs[r], "4"],
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        rcs = [p.wait(timeout=420) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    if rcs != [0, 0]:
        tails = [open(f.name).read()[-3000:] for f in logs]
        raise AssertionError(f"worker exit codes {rcs}\n" + "\n----\n".join(tails))
    r0 = json.load(open(outs[0]))
    r1 = json.load(open(outs[1]))
    assert r0["device_count"] == 4 and r0["local_device_count"] == 2, r0
    assert r0["tokens"] == ref, f"2-process TP=4 {r0['tokens']} != TP=1 {ref}"
    # each process holds 2 of the 4 KV-head shards
    assert r0["pool_shape"][2] == 4 and [s[2] for s in r0["pool_local_shards"]] == [1, 1], r0
    assert r1["follower_steps"] >= MAX_TOKENS, r1


def check_smollm2_tp3(ctx: Ctx) -> None:
    """The bundled model (9 q / 3 KV heads) at TP=3, with real chat prompts (prefill + decode)."""
    from transformers import AutoTokenizer

    from jaxpaged.models import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = []
    for q in ("What is the capital of France?", "Write a haiku about the sea."):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts.append(list(ids))
    kw = dict(max_model_len=256, max_num_batched_tokens=128, num_kv_blocks=64)
    ref, _ = greedy(path, 1, prompts=prompts, max_tokens=12, **kw)
    got, llm = greedy(path, 3, prompts=prompts, max_tokens=12, **kw)
    assert got == ref, f"SmolLM2 TP=3 {got} != TP=1 {ref}"
    assert_sharded(llm.engine, 3, num_kv_heads=3, vocab=49152)


def check_warmup_no_recompile(ctx: Ctx) -> None:
    """With warm-up on and TP on, serving mixed prefill/decode steps, n > 1 (shared prefix
    blocks) and a preemption that swaps blocks out and back compiles nothing new, and the
    pool keeps its head split throughout."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.distributed.parallel import kv_pool_sharding

    llm = LLM(
        ctx.model("llama"),
        tensor_parallel_size=4,
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_kv_blocks=6,
        block_size=8,
        preemption_mode="swap",
        show_progress=False,
    )
    runner = llm.engine.runner
    want = kv_pool_sharding(runner.mesh)
    assert all(p.sharding.is_equivalent_to(want, 4) for p in runner.pool), runner.pool[0].sharding
    prompts = [list(range(3, 14)), list(range(20, 30)), [7, 8, 9]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    m = llm.get_metrics()
    assert all(p.sharding.is_equivalent_to(want, 4) for p in runner.pool), runner.pool[0].sharding
    llm.engine.close()
    assert [len(o.outputs) for o in outs] == [1, 2, 1]
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [12] * 4
    assert m["num_preemptions"] >= 1, m  # the swap path ran
    assert m["num_compilations_after_warmup"] == 0, m


def check_orbax(ctx: Ctx) -> None:
    """convert CLI -> restore into no mesh / TP 2 / TP 4 (replicated KV heads), identical to
    the safetensors loads; params saved from a TP=2 mesh restore into TP=4; LLM(model=OUT)."""
    import jax
    import numpy as np

    from jaxpaged.cli import convert
    from jaxpaged.distributed import orbax, parallel
    from jaxpaged.distributed.loading import load_params
    from jaxpaged.models import load_model

    path = ctx.model("llama")
    out = os.path.join(ctx.workdir, "llama-orbax")
    assert convert.main([path, out]) == 0
    assert orbax.is_orbax_model(out) and not orbax.is_orbax_model(path)

    def same(a: Any, b: Any) -> None:
        la, lb = leaves(a), leaves(b)
        assert la.keys() == lb.keys()
        for k in la:
            x, y = np.asarray(jax.device_get(la[k])), np.asarray(jax.device_get(lb[k]))
            assert x.dtype == y.dtype and np.array_equal(x, y), k
            assert la[k].sharding == lb[k].sharding, (k, la[k].sharding, lb[k].sharding)

    cfg0, p0 = load_model(path, progress=False)
    cfg, p = orbax.restore(out)
    assert cfg == cfg0
    same(p, p0)
    for n in (2, 4):
        mesh = parallel.make_mesh(n)
        want_cfg, want = load_params(path, mesh=mesh, progress=False)
        got_cfg, got = orbax.restore(out, mesh=mesh)
        assert got_cfg == want_cfg and got_cfg.num_kv_heads == max(2, n)
        same(got, want)

    # a checkpoint written from params sharded over 2 devices, restored over 4 and 1
    out2 = os.path.join(ctx.workdir, "llama-orbax-tp2")
    os.makedirs(out2)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(path, name), "rb") as src, open(os.path.join(out2, name), "wb") as d:
            d.write(src.read())
    _, p2 = load_params(path, mesh=parallel.make_mesh(2), progress=False)
    orbax.save_params(p2, out2, dtype="float32")
    _, back1 = orbax.restore(out2)
    same(back1, p0)
    _, back4 = orbax.restore(out2, mesh=parallel.make_mesh(4))
    same(back4, load_params(path, mesh=parallel.make_mesh(4), progress=False)[1])

    got, llm = greedy(out, 4)  # LLM(model=OUT) detects the Orbax folder
    assert got == ctx.ref("llama"), got
    assert_sharded(llm.engine, 4, num_kv_heads=2, vocab=256)
    assert convert.main([path, out]) == 2  # OUT not empty: clear error, exit code 2


def check_errors(ctx: Ctx) -> None:
    import dataclasses

    from jaxpaged import LLM
    from jaxpaged.config import ParallelConfig
    from jaxpaged.distributed import multihost, parallel
    from jaxpaged.models.config import ModelConfig

    def raises(fn: Callable[[], Any], *words: str) -> None:
        try:
            fn()
        except ValueError as exc:
            msg = str(exc)
            assert all(w in msg for w in words), (msg, words)
            return
        raise AssertionError(f"no ValueError (wanted {words})")

    raises(lambda: parallel.make_mesh(5), "tensor_parallel_size=5", "4 available")
    raises(lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size")
    raises(lambda: LLM(ctx.model("llama"), tensor_parallel_size=8), "tensor_parallel_size=8")
    # qwen3 tiny has 8 query heads: 3 does not divide them (fails before any weight is read)
    raises(
        lambda: LLM(ctx.model("qwen3"), tensor_parallel_size=3),
        "tensor_parallel_size=3",
        "num_attention_heads=8",
    )
    base = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_layers=1,
        num_heads=6,
        num_kv_heads=3,
        head_dim=8,
    )
    raises(lambda: parallel.kv_replication(base, 2), "num_key_value_heads=3")
    raises(lambda: parallel.kv_replication(base, 4), "num_attention_heads=6")
    odd_mlp = dataclasses.replace(base, intermediate_size=90, num_heads=4, num_kv_heads=2)
    raises(lambda: parallel.kv_replication(odd_mlp, 4), "intermediate_size=90")
    assert parallel.kv_replication(dataclasses.replace(base, num_heads=12), 6) == 2
    raises(
        lambda: multihost.initialize(num_processes=2, process_id=2, coordinator_address="x:1"),
        "process_id",
    )
    raises(
        lambda: multihost.initialize(num_processes=2, process_id=0, coordinator_address=None),
        "coordinator_address",
    )
    raises(
        lambda: multihost.check_engine_args(num_processes=2, preemption_mode="swap"),
        "preemption_mode",
    )


def check_update_weights(ctx: Ctx) -> None:
    """update_weights on a TP=2 engine: unsharded params are resharded on the devices, params
    already on the mesh with the engine's shardings are used as they are; outputs equal a TP=1
    engine built on the new params, the split is kept, and after the first reshard (JAX
    compiles its slicing programs once per shape) nothing compiles."""
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.distributed.loading import load_params
    from jaxpaged.engine import LLMEngine
    from jaxpaged.worker.compile_counter import CompileCounter

    path = ctx.model("llama")
    config, params = load_params(path, progress=False)  # on one device, unsplit
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ref = LLMEngine.from_params(config, scaled, show_progress=False, **ENGINE_ARGS)
    want = [
        list(o.outputs[0].token_ids)
        for o in LLM.from_engine(ref).generate(PROMPTS, sp, use_tqdm=False)
    ]
    ref.close()
    llm = LLM(path, tensor_parallel_size=2, show_progress=False, **ENGINE_ARGS)
    # the engine's shardings (made before counting: the multiply compiles)
    on_mesh = jax.tree.map(lambda x: x * 1.5, llm.engine.runner.params)
    # ENGINE_ARGS skip warm-up (enforce_eager): this first generate compiles the step shapes
    base = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    # the first reshard from one device compiles JAX's slicing programs (once per shape)
    llm.update_weights(scaled)
    with CompileCounter() as compiles:
        llm.update_weights(scaled)  # resharded on the devices again
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert got == want and want != base, (got, want)
        assert_sharded(llm.engine, 2, num_kv_heads=2, vocab=256)
        llm.update_weights(on_mesh)
        held = jax.tree.leaves(llm.engine.runner.params)
        assert all(a is b for a, b in zip(held, jax.tree.leaves(on_mesh), strict=True))
        again = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert again == want
    assert compiles.count == 0, compiles.count
    llm.engine.close()


def check_quantized_int8(ctx: Ctx) -> None:
    """quantization="int8" at TP 4 (KV heads replicated) decodes as TP=1 does
    (XLA's dequant dots everywhere), and each quantized weight's scales are split on the
    values' output axis and replicated over their contracted one."""
    from jaxpaged.models.quant import QuantizedWeight

    path = ctx.model("llama")
    kw = dict(quantization="int8", attention_backend="xla")
    ref, _ = greedy(path, 1, **kw)
    assert len({t for seq in ref for t in seq}) > 3, f"degenerate reference {ref}"
    for tp in (4,):
        got, llm = greedy(path, tp, **kw)
        assert got == ref, f"int8 TP={tp}: {got} != TP=1 {ref}"
        layers = llm.engine.runner.params["layers"]
        for name, in_axis in (("wqkv", 4), ("wo", 2), ("w_down", 2)):  # an axis K spans
            w = layers[name]
            assert isinstance(w, QuantizedWeight), name
            split = SPLIT_AXIS[f"layers/{name}"]
            for values, scales in zip(
                w.values.addressable_shards, w.scales.addressable_shards, strict=True
            ):
                assert values.data.shape[split] == w.shape[split] // tp, name
                assert scales.data.shape[in_axis] == 1, name
                want = w.scales.shape[split] // (tp if split != in_axis else 1)
                assert scales.data.shape[split] == want, (name, scales.data.shape)


CHECKS: dict[str, Callable[[Ctx], None]] = {
    "errors": check_errors,
    # llama at TP 4 (KV heads replicated): multihost, warmup_no_recompile, quantized_int8
    "family_llama": lambda c: check_family(c, "llama", (2,)),
    "multihost": check_multihost,
    "family_qwen2": lambda c: check_family(c, "qwen2"),
    # q/k norm (qwen3) and MQA replicated 4 ways (mistral) at TP 4
    "family_qwen3": lambda c: check_family(c, "qwen3", (4,)),
    "family_mistral": lambda c: check_family(c, "mistral", (4,)),
    "bloom": check_bloom,
    "orbax": check_orbax,
    "warmup_no_recompile": check_warmup_no_recompile,
    "smollm2_tp3": check_smollm2_tp3,
    "update_weights": check_update_weights,
    "quantized_int8": check_quantized_int8,
    "grouped_gguf": lambda c: check_grouped_gguf(c, (2,)),
    "grouped_gptq_act": lambda c: check_grouped_prequantized(c, "gptq-act"),
    "grouped_split_refused": check_grouped_split_refused,
    # the default suite: one engine per family newly split (against transformers)
    "family_gemma2": lambda c: check_family_vs_hf(c, "gemma2", (4,)),
    "family_mixtral": lambda c: check_family_vs_hf(c, "mixtral", (2,)),
    # GPT-2's fused, biased Conv1D layout split at TP 2 (eager); its warm-up under TP, and
    # its int8 weights, in the full matrix (Llama's cover both by default)
    "family_gpt2": lambda c: check_family_vs_hf(c, "gpt2", (2,)),
    "warmup_gpt2": lambda c: check_warmup_family(c, "gpt2"),
    "quantized_families": lambda c: check_quantized_families(c, (("gemma2", "fp8"),)),
    "quantized_gpt2": lambda c: check_quantized_families(c, (("gpt2", "int8"),)),
    "kv_int8": lambda c: check_kv_8bit(c, "int8", (2,)),
    "spec_identity": check_spec_identity,
    # slow: the rest of the matrix, with TP=1 engines as well
    "full_gpt2": lambda c: check_family_vs_hf(c, "gpt2", (2, 4), with_tp1=True),
    "full_opt": lambda c: check_family_vs_hf(c, "opt", (2,), with_tp1=True),
    "full_gemma2": lambda c: check_family_vs_hf(c, "gemma2", (2, 4), with_tp1=True),
    "full_gemma3": lambda c: check_family_vs_hf(c, "gemma3_text", (2,), with_tp1=True),
    "full_mixtral": lambda c: check_family_vs_hf(c, "mixtral", (2, 4), with_tp1=True),
    "full_qwen3_moe": lambda c: check_family_vs_hf(c, "qwen3_moe", (2,), with_tp1=True),
    "full_granite": lambda c: check_family_vs_hf(c, "granite", (2, 4), with_tp1=True),
    "warmup_gemma3": lambda c: check_warmup_family(c, "gemma3_text"),
    "kv_int8_tp4": lambda c: check_kv_8bit(c, "int8", (4,)),
    "kv_fp8": lambda c: check_kv_8bit(c, "fp8", (2, 4)),
    "grouped_gguf_tp4": lambda c: check_grouped_gguf(c, (4,)),
    "grouped_awq": lambda c: check_grouped_prequantized(c, "awq"),
    "grouped_gptq": lambda c: check_grouped_prequantized(c, "gptq"),
    "grouped_w4a16": lambda c: check_grouped_prequantized(c, "w4a16"),
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("checks", nargs="*", default=list(CHECKS))
    args = parser.parse_args()
    import jax

    assert jax.device_count() >= 4, f"need 4 devices (XLA_FLAGS), got {jax.device_count()}"
    ctx = Ctx(args.workdir)
    results: dict[str, str] = {}
    for name in args.checks:
        start = time.perf_counter()
        try:
            CHECKS[name](ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        print(f"CHECK {name}: {results[name][:2000]} ({time.perf_counter() - start:.1f} s)")
        sys.stdout.flush()
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
