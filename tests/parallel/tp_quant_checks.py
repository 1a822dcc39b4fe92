"""Tensor-parallel checks of group-wise quantized weights (GGUF, AWQ, GPTQ, compressed-tensors
W4A16): each served kept quantized under TP, its values, scales and mins split at group
boundaries, greedy tokens equal to TP=1's; registered in tp_checks.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from tp_family_checks import hf_greedy
from tp_harness import SPLIT_AXIS, Ctx, greedy

GROUPED_LEAVES = ("layers/wqkv", "layers/wo", "layers/w_gate_up", "layers/w_down")
# the XLA dequantize-then-dot path at every TP (the native CPU kernel serves only TP=1)
QUANT_ARGS = dict(attention_backend="xla")


def write_tiny_gguf(path: str | os.PathLike, *, seed: int = 0) -> str:
    """A random 2-layer qwen2 GGUF (8 query / 2 KV heads of 16, D = 128, F = 256, a
    byte-level vocabulary of 260) whose matmul weights and embedding are Q4_0, Q4_1 and Q8_0
    (groups of 32), written with the gguf package's own quantizer."""
    import gguf
    import numpy as np
    import torch
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from jaxpaged.models.testing import gguf_tensor_name

    config = transformers.Qwen2Config(
        vocab_size=260, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=258, eos_token_id=259,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).eval()
    q = gguf.GGMLQuantizationType
    qtypes = {
        "token_embd.weight": q.Q8_0,
        "output.weight": q.Q4_1,
        "attn_q.weight": q.Q4_0,
        "attn_k.weight": q.Q4_0,
        "attn_v.weight": q.Q4_0,
        "attn_output.weight": q.Q4_1,
        "ffn_gate.weight": q.Q8_0,
        "ffn_up.weight": q.Q8_0,
        "ffn_down.weight": q.Q4_0,
    }
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(128)
    w.add_feed_forward_length(256)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(bytes_to_unicode().values()) + ["ĠĠ", "ĠĠĠĠ", "<|s|>", "<|e|>"])
    w.add_token_types([1] * 258 + [3, 3])
    w.add_token_merges(["Ġ Ġ", "ĠĠ ĠĠ"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_add_bos_token(False)
    for hf_name, t in model.state_dict().items():
        name = gguf_tensor_name(hf_name)
        value = t.detach().numpy().astype(np.float32)
        qtype = qtypes.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if qtype is None:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_grouped_split(params: Any, tp: int, paths: tuple[str, ...]) -> None:
    """Each of ``paths`` is a GroupedWeight whose values, scales and mins are each split in
    ``tp`` distinct pieces: on the float leaf's split axis when it is an output (leading) axis,
    else on the arrays' last (contracted, K) axis, into whole groups."""
    from jaxpaged.models.quant import GroupedWeight

    for path in paths:
        w = params
        for key in path.split("/"):
            w = w[key]
        assert isinstance(w, GroupedWeight), f"{path} is {type(w).__name__}, not kept quantized"
        split = SPLIT_AXIS[path]
        lead = w.values.ndim - 1
        arrays = {"values": w.values, "scales": w.scales}
        if w.mins is not None:
            arrays["mins"] = w.mins
        for field, x in arrays.items():
            axis = split if split < lead else x.ndim - 1
            if field != "values" and split >= lead and w.g_idx is not None:
                continue  # act-order scales and mins: whole on every device
            piece = x.shape[axis] // tp
            assert piece * tp == x.shape[axis], (path, field, x.shape)
            shards = x.addressable_shards
            assert len({s.device for s in shards}) == tp, (path, field)
            for s in shards:
                assert s.data.shape[axis] == piece, (path, field, s.data.shape, piece)
            starts = sorted({s.index[axis].start or 0 for s in shards})
            assert starts == [i * piece for i in range(tp)], (path, field, starts)
        if w.g_idx is not None:  # act-order: g_idx split with the values
            axis = split if split < lead else w.g_idx.ndim - 1
            if w.g_idx.shape[axis] > 1:
                for s in w.g_idx.addressable_shards:
                    assert s.data.shape[axis] == w.g_idx.shape[axis] // tp, (path, "g_idx")
        elif split >= lead:  # a K split: each device's values hold exactly its groups
            per_device = w.in_features // tp
            assert per_device % w.group_size == 0, (path, per_device, w.group_size)
            assert w.scales.addressable_shards[0].data.shape[-1] == per_device // w.group_size


def check_grouped_gguf(ctx: Ctx, tps: tuple[int, ...]) -> None:
    """A GGUF model (Q4_0 / Q4_1 / Q8_0) at each TP of ``tps`` (at 4, each KV head is
    replicated twice) keeps every matmul weight, the embedding and the LM head quantized,
    split at group boundaries, and decodes the greedy tokens transformers computes over its
    float expansion (the same numbers: tests/quant/test_gguf_quant.py)."""
    from jaxpaged.models.resolve import resolve_model_folder

    path = os.path.join(ctx.workdir, "tiny_q.gguf")
    if not os.path.exists(path):
        write_tiny_gguf(path)
    if "gguf" not in ctx.refs:
        ctx.refs["gguf"] = hf_greedy(str(resolve_model_folder(path)))
    ref = ctx.refs["gguf"]
    assert len({t for seq in ref for t in seq}) > 3, f"degenerate reference {ref}"
    for tp in tps:
        got, llm = greedy(path, tp, **QUANT_ARGS)
        assert got == ref, f"GGUF TP={tp}: {got} != transformers {ref}"
        assert llm.engine.model_config.num_kv_heads == max(2, tp)
        assert_grouped_split(llm.engine.runner.params, tp, (*GROUPED_LEAVES, "embed", "lm_head"))


def _writers():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
    import checkpoint_writers

    return checkpoint_writers


def write_prequantized(folder: str, fmt: str, group: int = 32) -> tuple[str, str]:
    """A tiny random Llama (4 query / 2 KV heads of 16, D = 64, F = 128) in ``fmt``: "awq",
    "gptq", "gptq-act" (act-order; the formats' published packings) or "w4a16" (compressed-tensors' own writer,
    symmetric groups). Returns (its folder, the folder transformers reads as the reference:
    the same weights dequantized by the formats' own formula, or, for W4A16, the checkpoint
    itself, which transformers decompresses)."""
    import torch
    import transformers

    cw = _writers()
    path, ref = Path(folder), Path(f"{folder}_float")
    if fmt == "w4a16":
        ref = path
    if not path.exists():
        path.mkdir(parents=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cw.TINY)).eval()
        if fmt == "w4a16":
            cw.write_compressed_tensors(model, path, "w4a16")
        else:
            act_order = fmt == "gptq-act"
            weights = cw.write_4bit_checkpoint(
                path, fmt.removesuffix("-act"), group=group, model=model, act_order=act_order
            )
            model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
            model.save_pretrained(ref)
        cw.write_tokenizer(path)
    return str(path), str(ref)


def check_grouped_prequantized(ctx: Ctx, fmt: str) -> None:
    """An AWQ, GPTQ (act-order too) or compressed-tensors W4A16 checkpoint at TP 2: every
    decoder matmul weight kept 4-bit and split at group boundaries (act-order: its g_idx split
    with the values, the scales whole on every device), greedy tokens equal to transformers'
    own over the same weights (which tests/quant checks TP=1 against)."""
    path, ref_path = write_prequantized(os.path.join(ctx.workdir, f"tiny_{fmt}"), fmt)
    ref = hf_greedy(ref_path)
    assert len({t for seq in ref for t in seq}) > 3, f"{fmt}: degenerate reference {ref}"
    got, llm = greedy(path, 2, **QUANT_ARGS)
    assert got == ref, f"{fmt} TP=2: {got} != transformers {ref}"
    assert_grouped_split(llm.engine.runner.params, 2, GROUPED_LEAVES)


def check_grouped_split_refused(ctx: Ctx) -> None:
    """A split that would cut a group is refused with a ValueError naming the weight and the
    sizes (GPTQ groups of 32: TP 4 gives each device 16 of o_proj's 64 inputs), never served
    through a float fallback."""
    from jaxpaged import LLM

    path, _ = write_prequantized(os.path.join(ctx.workdir, "tiny_gptq"), "gptq")
    try:
        LLM(path, tensor_parallel_size=4, show_progress=False, enforce_eager=True)
    except ValueError as e:
        msg = str(e)
        assert "layers/wo" in msg and "groups of 32" in msg and "64 inputs" in msg, msg
    else:
        raise AssertionError("GPTQ groups of 32 split in pieces of 16 were not refused")
