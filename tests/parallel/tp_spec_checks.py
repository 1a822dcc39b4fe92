"""Speculative decoding under tensor parallelism: greedy tokens at TP=2 with n-gram drafts
and with a draft model (the target itself kept int8, split over the same devices) equal the
engine's without speculation; registered in tp_checks.py."""

from __future__ import annotations

from tp_harness import Ctx, greedy


def check_spec_identity(ctx: Ctx) -> None:
    path = ctx.model("llama")
    ref = ctx.ref("llama")  # TP=1, no speculation (family_llama: TP=2 gives the same)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 8},
        {"model": path, "quantization": "int8", "num_speculative_tokens": 3,
         "disable_by_batch_size": 8},
    ):  # fmt: skip
        got, llm = greedy(path, 2, speculative_config=spec)
        m = llm.get_metrics()
        if "model" in spec:
            _assert_split(llm.engine.runner.drafter.runner.params)
        llm.engine.close()
        assert got == ref, f"TP=2 with {spec}: {got} != without {ref}"
        assert m["spec_decode_num_draft_tokens"] > 0, m
        assert m["spec_decode_num_accepted_tokens"] > 0, m


def _assert_split(params) -> None:
    """The draft's weights live on both devices, its attention projections halved."""
    import jax

    assert {d for x in jax.tree.leaves(params) for d in x.sharding.device_set} == set(
        jax.devices()[:2]
    )
    wqkv = params["layers"]["wqkv"].values  # int8 values, split like the float weights
    assert {s.data.shape[1] for s in wqkv.addressable_shards} == {wqkv.shape[1] // 2}
