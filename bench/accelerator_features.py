"""Stages of bench/accelerator_check.py for features newer than its first stages: per-row
causal limits in the Pallas kernel (Gemma 3's bidirectional image spans) and EAGLE-3 drafting
inside the engine's step. Each writes PASS/FAIL lines and starts only while the deadline
leaves room; a dry run uses tiny shapes and the kernels in interpret mode."""

from __future__ import annotations

import json
import os
import struct
import tempfile

import numpy as np
from accelerator_kernels import Report, attention, case_args, kernel_backend


# ---------------------------------------------------------------- causal limits
def limits_cases(small: bool) -> list[tuple[str, dict, list, dict]]:
    """(label, shape, seqs, options): decode rows, prefill from scratch, chunked prefill."""
    if small:
        return [("6q/2kv d16 bs8 window 7", dict(hq=6, hkv=2, d=16, bs=8, dtype="float32"),
                 [(1, 9), (13, 13), (6, 15)], dict(sliding_window=7))]  # fmt: skip
    seqs = [(1, 700), (300, 300), (90, 400), (1, 33), (257, 600)]
    return [
        ("8q/4kv d256 bs16 (Gemma 3 4B)", dict(hq=8, hkv=4, d=256, bs=16, dtype="bfloat16"),
         seqs, {}),
        ("16q/8kv d128 bs16 window 96", dict(hq=16, hkv=8, d=128, bs=16, dtype="float32"),
         seqs, dict(sliding_window=96)),
    ]  # fmt: skip


def poison_free_memory(shape: tuple, dtype) -> None:
    """Fill, then free, a NaN buffer of the output's size: the allocator hands that memory to
    the next call's buffers, so a tile the kernel never writes comes out NaN, not zero."""
    import jax
    import jax.numpy as jnp

    junk = jax.block_until_ready(jnp.full(shape, jnp.nan, dtype))
    junk.delete()


def causal_limits_stage(rep: Report, platform: str, interpret: bool, small: bool) -> None:
    import jax
    import jax.numpy as jnp

    from jaxpaged.kernels.testing import TOLERANCE, random_spans, rel_err

    rep.stage("Per-row causal limits (bidirectional image spans) against the reference")
    if platform == "tpu":
        rep.line("- not run: JAX's TPU kernel takes no causal_limits (refused by design)")
        return
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    rep.line(f"seed {seed}")
    reference = attention("reference", False)
    attend = attention(kernel_backend(platform), interpret)
    for label, shape, seqs, opts in limits_cases(small):
        if rep.left() < rep.reserve:
            rep.line(f"- {label}: skipped: deadline")
            continue
        try:
            case, args = case_args(rng, seqs, **shape, max_seqs=8, pad_tokens=3)
            limits, spans = random_spans(rng, case, case.q.shape[0])
            kw = dict(sm_scale=case.sm_scale, **opts)
            lim = jnp.asarray(limits)
            with jax.default_matmul_precision("highest"):
                ref = reference(*args, **kw, causal_limits=lim)
                plain = reference(*args, **kw)
                poison_free_memory(args[0].shape, args[0].dtype)
                out = jax.block_until_ready(attend(*args, **kw, causal_limits=lim))
            err = rel_err(out, ref)
            total = sum(q for q, _ in seqs)
            rows = np.asarray(out.astype("float32"))
            pad_ok = bool(np.all(rows[total:] == 0))
            finite = bool(np.all(np.isfinite(rows)))
            spans_matter = rel_err(plain, ref) > 1e-2  # else the check could not fail
            ok = err < TOLERANCE[shape["dtype"]] and pad_ok and finite and spans_matter
            rep.failures += not ok
            why = "" if ok else f" (padding zero: {pad_ok}, finite: {finite}, spans matter: "
            why += "" if ok else f"{spans_matter})"
            rep.line(f"- {'PASS' if ok else 'FAIL'} {label} {shape['dtype']}: {len(spans)} rows "
                     f"in spans, rel err {err:.1e} (limit {TOLERANCE[shape['dtype']]:g}){why}")  # fmt: skip
        except Exception as e:
            rep.fail(f"causal limits {label}", e)


# ---------------------------------------------------------------- EAGLE-3
_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(bool): "BOOL"}


def save_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
    """The safetensors layout (8-byte header length, JSON header, raw little-endian data),
    written with numpy alone: the lent machine may lack the safetensors package."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": _ST_DTYPES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def write_eagle3_head(path: str, config, *, draft_vocab: int = 64, seed: int = 3) -> None:
    """A random one-layer EAGLE-3 head for ``config`` in the published layout (as
    tests/engine/test_spec_eagle3.py writes it): its drafts are mostly rejected, and the
    output must still be the target's, token for token."""
    rng = np.random.default_rng(seed)
    h, hd, f, nq, nkv = config.hidden_size, config.head_dim, 64, 4, config.num_kv_heads

    def w(*shape, scale=0.3):
        return rng.normal(0, scale, shape).astype(np.float32)

    keep = np.sort(rng.choice(config.vocab_size, draft_vocab, replace=False))
    t2d = np.zeros(config.vocab_size, bool)
    t2d[keep] = True
    p = "midlayer."
    tensors = {
        "fc.weight": w(h, 3 * h, scale=0.05),
        p + "hidden_norm.weight": 1 + w(h, scale=0.1),
        p + "input_layernorm.weight": 1 + w(h, scale=0.1),
        p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        p + "self_attn.q_proj.weight": w(nq * hd, 2 * h, scale=0.05),
        p + "self_attn.k_proj.weight": w(nkv * hd, 2 * h, scale=0.05),
        p + "self_attn.v_proj.weight": w(nkv * hd, 2 * h, scale=0.05),
        p + "self_attn.o_proj.weight": w(h, nq * hd, scale=0.05),
        p + "mlp.gate_proj.weight": w(f, h, scale=0.1),
        p + "mlp.up_proj.weight": w(f, h, scale=0.1),
        p + "mlp.down_proj.weight": w(h, f, scale=0.1),
        "norm.weight": 1 + w(h, scale=0.1),
        "lm_head.weight": w(draft_vocab, h, scale=1.0),
        "d2t": (keep - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
    }
    head_config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": f, "num_hidden_layers": 1, "num_attention_heads": nq,
        "num_key_value_heads": nkv, "head_dim": hd, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "vocab_size": config.vocab_size, "draft_vocab_size": draft_vocab,
        "target_hidden_size": h,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(head_config, fh)
    save_safetensors(tensors, os.path.join(path, "model.safetensors"))


def eagle3_stage(rep: Report, greedy_tokens, config, want: list, *, eager: bool) -> None:
    """``greedy_tokens``, the model's ``config`` and ``want`` (the CPU engine's tokens without
    speculation) come from bench/accelerator_check.py; the engine runs the device's default
    attention backend."""
    rep.stage("EAGLE-3 drafting in the step (tiny random head, same model, greedy)")
    if rep.left() < rep.reserve:
        rep.line("skipped: deadline")
        return
    max_tokens = len(want[0])
    try:
        with tempfile.TemporaryDirectory() as path:
            write_eagle3_head(path, config)
            # a dry run's 4 tokens leave room for 2 drafts after the first; a CPU engine caps the
            # drafting batch unless told (engine_setup.CPU_SPEC_MAX_BATCH): 4 requests draft
            spec = {"method": "eagle3", "model": path, "num_speculative_tokens": 2 if eager else 3,
                    "disable_by_batch_size": 64}  # fmt: skip
            tokens, tok_s, stats = greedy_tokens(None, max_tokens, eager=eager,
                                                 speculative_config=spec)  # fmt: skip
    except Exception as e:
        rep.fail("EAGLE-3 run", e)
        return
    same = tokens == want
    drafted = stats.spec_decode_num_draft_tokens
    compiles = stats.num_compilations_after_warmup
    ok = same and drafted > 0 and (eager or compiles == 0)  # eager: no warm-up to count from
    rep.failures += not ok
    rep.line(f"- {sum(map(len, tokens))} tokens at {tok_s:.0f} tok/s, "
             f"{stats.spec_decode_num_accepted_tokens} of {drafted} drafts accepted, "
             f"{compiles} compilations after warm-up")  # fmt: skip
    rep.line(f"- {'PASS' if ok else 'FAIL'}: greedy tokens {'equal' if same else 'DIFFER FROM'} "
             "the CPU engine's without speculation" + ("" if same else f": got {tokens}, CPU {want}")
             + ("" if eager or compiles == 0 else " (compiled after warm-up)")
             + ("" if drafted else " (the head made no drafts)"))  # fmt: skip
