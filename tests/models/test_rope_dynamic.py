"""RoPE ``dynamic`` (dynamic NTK) against transformers: the frequencies per sequence length,
and greedy generation through the paged engine that crosses the context length, token for
token as transformers' generate() (prompt in one forward, then one token per forward), with
two sequences batched and nothing compiled after the warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.registry import parse_config
from jaxpaged.models.rope import rope_inv_freq_at

CONTEXT = 16  # max_position_embeddings: the length past which dynamic rescales
PROMPTS = [list(range(3, 13)), [40, 41, 42, 43, 44, 45, 46]]  # 10 and 7 tokens
MAX_TOKENS = 24  # generations reach 34 and 31 tokens: well past CONTEXT


def _hf_config(rope_type: str = "dynamic") -> transformers.LlamaConfig:
    rope = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "dynamic":
        rope["factor"] = 4.0
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        initializer_range=0.1,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("seq_len", [5, CONTEXT, CONTEXT + 1, 23, 40, 1000])
def test_frequencies_match_transformers(seq_len: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config()
    want, scale = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=seq_len)
    assert scale == 1.0
    config = parse_config(hf.to_dict())
    assert config.rope_scaling.rope_type == "dynamic"
    positions = np.arange(seq_len, dtype=np.int32)[-3:]
    got = rope_inv_freq_at(config, positions, np.full(positions.shape, seq_len, np.int32))
    assert got.shape == (3, config.head_dim // 2)
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(want.numpy(), got.shape), rtol=2e-6)
    # one sequence (no lengths given): max(positions) + 1
    np.testing.assert_array_equal(np.asarray(rope_inv_freq_at(config, positions)), got)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_hf_config()).eval()
    folder = str(tmp_path_factory.mktemp("dynamic"))
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(
        folder
    )
    return folder


def _hf_generate(folder: str, rope_type: str) -> list[list[int]]:
    """transformers' generate() per prompt, greedy, EOS off (its KV cache keeps each key's
    rotation; its dynamic rope grows with the length of each forward)."""
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, config=_hf_config(rope_type), dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def test_generation_matches_transformers(model_folder: str) -> None:
    want = _hf_generate(model_folder, "dynamic")
    # the rescaling changes the tokens here: a plain-rope engine could not pass
    assert want != _hf_generate(model_folder, "default")
    llm = LLM(
        model_folder,
        max_model_len=48,
        max_num_seqs=2,
        max_num_batched_tokens=32,  # both prompts prefilled whole, in one step
        num_kv_blocks=16,
        block_size=8,
        show_progress=False,
    )
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    metrics = llm.get_metrics()
    llm.engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert metrics["num_compilations_after_warmup"] == 0, metrics
