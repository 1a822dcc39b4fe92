"""Speculative decoding under tensor parallelism: greedy tokens at TP=2 with n-gram drafts,
with a draft model (the target itself kept int8, split over the same devices) and with an
EAGLE-3 head (tiny, random, in the published layout; its weights on the target's devices)
equal the engine's without speculation; registered in tp_checks.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from tp_harness import Ctx, greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: eagle3_heads
from eagle3_heads import write_eagle3_head  # noqa: E402


def check_spec_identity(ctx: Ctx) -> None:
    path = ctx.model("llama")
    ref = ctx.ref("llama")  # TP=1, no speculation (family_llama: TP=2 gives the same)
    head = _eagle3_head(path, os.path.join(ctx.workdir, "eagle3"))
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 8},
        {"model": path, "quantization": "int8", "num_speculative_tokens": 3,
         "disable_by_batch_size": 8},
        {"method": "eagle3", "model": head, "num_speculative_tokens": 2,
         "disable_by_batch_size": 8},
    ):  # fmt: skip
        got, llm = greedy(path, 2, speculative_config=spec)
        m = llm.get_metrics()
        if "quantization" in spec:
            _assert_split(llm.engine.runner.drafter.runner.params)
        if spec.get("method") == "eagle3":
            _assert_on_devices(llm.engine.runner.eagle_params)
        llm.engine.close()
        assert got == ref, f"TP=2 with {spec}: {got} != without {ref}"
        assert m["spec_decode_num_draft_tokens"] > 0, m
        if spec.get("method") != "eagle3":  # a random head's drafts are mostly rejected
            assert m["spec_decode_num_accepted_tokens"] > 0, m


def _eagle3_head(target: str, folder: str) -> str:
    """A random head for the checkpoint at ``target`` (its draft vocabulary: the whole
    target vocabulary, so that some drafts may land)."""
    with open(os.path.join(target, "config.json")) as f:
        hf = json.load(f)
    heads = hf["num_attention_heads"]
    cfg = SimpleNamespace(
        hidden_size=hf["hidden_size"],
        head_dim=hf["hidden_size"] // heads,
        num_kv_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"],
    )
    write_eagle3_head(Path(folder), target=cfg, num_heads=heads, draft_vocab=hf["vocab_size"])
    return folder


def _assert_on_devices(params) -> None:
    import jax

    assert {d for x in jax.tree.leaves(params) for d in x.sharding.device_set} == set(
        jax.devices()[:2]
    )


def _assert_split(params) -> None:
    """The draft's weights live on both devices, its attention projections halved."""
    _assert_on_devices(params)
    wqkv = params["layers"]["wqkv"].values  # int8 values, split like the float weights
    assert {s.data.shape[1] for s in wqkv.addressable_shards} == {wqkv.shape[1] // 2}
