"""The bundled SmolLM2-135M quantized to int8 at load, run by the native int8 kernel as CPU
serving runs it, against its float32 self: greedy agreement on fixed chat prompts (first
divergence, teacher-forced on float32's greedy tokens) and perplexity on a fixed text.
fp8 and longer texts: bench/quant_quality.py (too slow for the suite)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels import cpu
from jaxpaged.kernels.cpu.linear_q8 import linear_q8, pack_panels_q8
from jaxpaged.models import load_tokenizer
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import map_matmul_weights
from jaxpaged.models.loader import load_host_params
from jaxpaged.models.quant import quantize_params
from jaxpaged.models.quant.quality import first_divergence, perplexity

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels did not build")

PROMPTS = ["What is the capital of France?", "Explain in one sentence what a hash table is."]
GREEDY_TOKENS = 24
# the project's own architecture notes: a fixed text, 256 tokens of it (see the report of
# issue 27 for the longer measurement)
TEXT = Path(__file__).parents[2] / "docs" / "architecture.md"
TEXT_TOKENS = 256


@pytest.fixture(scope="module")
def bundled(bundled_model_path):
    """(config, float32 host params, tokenizer) of the bundled model, loaded once."""
    config = ModelConfig.from_pretrained(bundled_model_path)
    host = load_host_params(bundled_model_path, config, np.float32, progress=False)
    return config, host, load_tokenizer(bundled_model_path)


@pytest.fixture(scope="module")
def float32_greedy(bundled):
    """float32's greedy tokens after each chat prompt, from the engine (native kernels)."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.engine import LLMEngine

    config, host, tok = bundled
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                tokenize=True)["input_ids"]
        for p in PROMPTS
    ]  # fmt: skip
    engine = LLMEngine.from_params(config, jax.tree.map(jnp.asarray, host), tok,
                                   max_model_len=256, max_num_seqs=2, num_kv_blocks=64,
                                   enforce_eager=True, show_progress=False)  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        outs = LLM.from_engine(engine).generate(prompts, sp, use_tqdm=False)
    finally:
        engine.close()
    return [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs, strict=True)]


def test_bundled_int8_tracks_float32(bundled, float32_greedy):
    config, host, tok = bundled
    params = jax.tree.map(jnp.asarray, quantize_params(host, config, "int8"))
    params = map_matmul_weights(params, config, pack_panels_q8)
    parted = [
        first_divergence(params, config, p, c, linear_fn=linear_q8) for p, c in float32_greedy
    ]
    ids = tok(TEXT.read_text())["input_ids"][:TEXT_TOKENS]
    base = perplexity(jax.tree.map(jnp.asarray, host), config, ids)
    ppl = perplexity(params, config, ids, linear_fn=linear_q8)
    print(f"int8: greedy first divergence {parted}, perplexity {ppl:.3f} vs {base:.3f}")
    # measured: all 24 tokens of the first prompt agree, the second parts at token 22;
    # perplexity +2.2% on these 256 tokens (+0.9% on 1024, bench/quant_quality.py)
    assert all(at is None or at >= 16 for at in parted), parted
    assert ppl / base - 1 < 0.03
