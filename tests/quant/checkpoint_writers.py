"""Writers of pre-quantized Llama checkpoints for the tests and bench/quant_quality.py: a
word-level tokenizer, compressed-tensors checkpoints written by the compressed-tensors library
itself, and AWQ and GPTQ packers that follow the formats' published layouts (AutoAWQ's GEMM packer: the
eight outputs of a word in the order 0, 2, 4, 6, 1, 3, 5, 7; AutoGPTQ's packer: inputs in
order along qweight's rows, zeros stored minus one in its v1 format), independent of the
reader in models/quant/gptq_awq.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 128
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
# name -> (compressed-tensors weight args, storage format forced, or None = its default)
CT_SCHEMES = {
    "fp8-channel": (dict(num_bits=8, type="float", strategy="channel"), None),
    "fp8-tensor": (dict(num_bits=8, type="float", strategy="tensor"), "float-quantized"),
    "int8-packed": (dict(num_bits=8, type="int", strategy="channel"), None),  # pack-quantized
    "int8-plain": (dict(num_bits=8, type="int", strategy="channel"), "int-quantized"),
    "w8a16": (dict(num_bits=8, type="int", strategy="group", group_size=32), "int-quantized"),
    "w4a16": (dict(num_bits=4, type="int", strategy="group", group_size=32), None),
    "w4a16-asym": (
        dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
        None,
    ),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8c + order[i]


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the model's vocabulary (t0 .. t127), so that the folder
    loads like any Hugging Face model."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1")
    fast.save_pretrained(folder)


def write_compressed_tensors(model, folder: Path, scheme: str, ignore=("lm_head",)) -> None:
    """``model`` (a transformers model, changed in place) quantized by compressed-tensors and
    saved to ``folder``: scales from each weight's own min/max (the library's
    calculate_qparams), compressed and saved by its ModelCompressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    weights, fmt = CT_SCHEMES[scheme]
    args = QuantizationArgs(**{"symmetric": True, **weights}, dynamic=False)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=list(ignore),
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            if args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                groups = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = groups.amin(-1), groups.amax(-1)
            else:
                lo, hi = w.amin(), w.amax()
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if not args.symmetric:
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))


def act_order_g_idx(k: int, group: int, rng: np.random.Generator) -> np.ndarray:
    """A GPTQ act-order g_idx (int32 [K]): the inputs taken in a random order (GPTQ's is by
    decreasing Hessian diagonal), G at a time, input perm[j] in group j // G."""
    g_idx = np.empty(k, np.int32)
    g_idx[rng.permutation(k)] = np.arange(k) // group
    return g_idx


def quantize_4bit(
    w: np.ndarray, group: int, g_idx: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min-max 4-bit per group of inputs (input k in group g_idx[k], default
    k // group): (q uint8 [N, K], zeros uint8 [N, K/G], float16 scales [N, K/G]) with
    w ~ (q - zero[g_idx]) * scale[g_idx]."""
    n, k = w.shape
    g_idx = np.arange(k) // group if g_idx is None else g_idx
    order = np.argsort(g_idx, kind="stable")  # the inputs of group 0, then of group 1, ...
    groups = w[:, order].reshape(n, k // group, group)
    lo, hi = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
    scales = ((hi - lo) / 15).astype(np.float16)
    s = scales.astype(np.float32)
    zeros = np.clip(np.rint(-lo / s), 0, 15).astype(np.uint8)
    z = zeros.astype(np.float32)
    q = np.clip(np.rint(w / s[:, g_idx]) + z[:, g_idx], 0, 15).astype(np.uint8)
    return q, zeros, scales


def dequantize_4bit(q, zeros, scales, group: int, g_idx=None) -> np.ndarray:  # float32 [N, K]
    """The formats' own formula, (q[n, k] - zero[n, g]) * scale[n, g] with g = g_idx[k]
    (default k // group)."""
    g_idx = np.arange(q.shape[1]) // group if g_idx is None else g_idx
    z, s = zeros.astype(np.float32)[:, g_idx], scales.astype(np.float32)[:, g_idx]
    return (q.astype(np.float32) - z) * s


def _words(nibbles: np.ndarray) -> np.ndarray:  # [R, 8C] in word order -> int32 [R, C]
    r, c8 = nibbles.shape
    fields = nibbles.reshape(r, c8 // 8, 8).astype(np.uint64)
    shifts = (4 * np.arange(8)).astype(np.uint64)
    words = (fields << shifts).sum(-1).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(words)  # safetensors writes the buffer in memory order


def pack_awq(q, zeros, scales) -> dict[str, np.ndarray]:
    """AWQ GEMM tensors of one linear from q [N, K], zeros and scales [N, K / G]."""

    def along_outputs(x):  # [N, R] -> int32 [R, N / 8]
        t = x.T  # [R, N]
        r, n = t.shape
        order = np.asarray(AWQ_PACK_ORDER)
        return _words(t.reshape(r, n // 8, 8)[:, :, order].reshape(r, n))

    return {
        "qweight": along_outputs(q),
        "qzeros": along_outputs(zeros),
        "scales": np.ascontiguousarray(scales.T),
    }


def pack_gptq(
    q, zeros, scales, group: int, *, v1: bool = True, g_idx=None
) -> dict[str, np.ndarray]:
    """GPTQ tensors of one linear (g_idx default k // group)."""
    n, k = q.shape
    if v1 and not zeros.all():
        raise ValueError("GPTQ v1 stores zero - 1 and cannot hold a zero point of 0")
    stored = zeros.astype(np.int16) - (1 if v1 else 0)
    return {
        "qweight": np.ascontiguousarray(_words(q).T),  # [N, K/8] -> [K/8, N]
        "qzeros": _words((stored & 0xF).astype(np.uint8).T),  # [K/G, N] -> [K/G, N/8]
        "scales": np.ascontiguousarray(scales.T),
        "g_idx": (np.arange(k) // group if g_idx is None else g_idx).astype(np.int32),
    }


def write_4bit_checkpoint(
    folder: Path, fmt: str, group: int = 32, seed: int = 0, model=None, act_order: bool = False
) -> dict:
    """``model`` (default: a tiny random Llama) with every decoder linear in ``fmt``
    ("awq", "gptq" or "gptq_v2"), lm_head and the rest float; with ``act_order`` (GPTQ), in
    desc_act's groups: one random g_idx per layer input, shared by the linears that read it
    (q/k/v, gate/up), as GPTQ's Hessian of that input orders them alike. Returns the float
    state dict of the same dequantized weights (the reference for transformers)."""
    if model is None:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.save_pretrained(folder)  # config, generation config; the weights are rewritten
    reference = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    tensors = {}
    rng, orders = np.random.default_rng(seed), {}
    for name, value in reference.items():
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS):
            tensors[name] = value
            continue
        g_idx = None
        if act_order:  # one order per input: q/k/v share the layer's, gate/up the MLP's
            layer, linear = module.rsplit(".", 2)[0], module.rsplit(".", 1)[1]
            reads = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
            key = (layer, reads.get(linear, linear))
            if key not in orders:
                orders[key] = act_order_g_idx(value.shape[1], group, rng)
            g_idx = orders[key]
        q, zeros, scales = quantize_4bit(value, group, g_idx)
        reference[name] = dequantize_4bit(q, zeros, scales, group, g_idx)
        packed = (
            pack_awq(q, zeros, scales)
            if fmt == "awq"
            else pack_gptq(q, zeros, scales, group, v1=fmt == "gptq", g_idx=g_idx)
        )
        tensors.update({f"{module}.{k}": v for k, v in packed.items()})
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
              "sym": False, "checkpoint_format": fmt}  # fmt: skip
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    return reference
