"""A tiny random Gemma 3 with images, saved by transformers with its processor (a word-level
tokenizer with Gemma's image tokens and a Gemma-style chat template), shared by the
multimodal tests of one process."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

# the serving tests' harness (a server on loopback ports in a thread)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "serving"))
sys.path.insert(0, os.path.dirname(__file__))  # tiny_qwen

VOCAB = 128
BOI, EOI, IMAGE = 125, 126, 127  # <start_of_image>, <end_of_image>, <image_soft_token>
TOKENS_PER_IMAGE = 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model {% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyVL:
    hf: object  # transformers.Gemma3ForConditionalGeneration
    processor: object  # transformers.Gemma3Processor
    folder: str


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab["\n\n"] = len(vocab)
    words = ["user", "model", "system"] + [f"w{i}" for i in range(VOCAB)]
    for w in words:
        if len(vocab) >= BOI:
            break
        vocab[w] = len(vocab)
    vocab.update({"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMAGE})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    tok.add_special_tokens(["<start_of_image>", "<end_of_image>", "<image_soft_token>",
                            "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "\n\n"])  # fmt: skip
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )  # fmt: skip


def build_tiny_vl(folder: str) -> TinyVL:
    import torch
    import transformers

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=3, max_position_embeddings=256,
        sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0, bos_token_id=2,
        eos_token_id=1, initializer_range=0.1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8, layer_norm_eps=1e-6, vision_use_head=False,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
        initializer_range=0.1, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zero: give it weights that matter
        proj = hf.model.multi_modal_projector
        proj.mm_input_projection_weight.normal_(0, 0.3)
        proj.mm_soft_emb_norm.weight.normal_(0, 0.3)
    hf.save_pretrained(folder)
    images = transformers.Gemma3ImageProcessor(  # mean and std as the engine must read them
        size={"height": 32, "width": 32}, image_mean=[0.48, 0.45, 0.4], image_std=[0.26, 0.27, 0.28]
    )
    processor = transformers.Gemma3Processor(
        image_processor=images, tokenizer=_tokenizer(), chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )  # fmt: skip
    processor.save_pretrained(folder)
    return TinyVL(hf, processor, folder)


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory) -> TinyVL:
    return build_tiny_vl(str(tmp_path_factory.mktemp("tiny-gemma3-vl")))


@pytest.fixture(scope="session")
def tiny_qwen_vl(tmp_path_factory):
    from tiny_qwen import build_tiny_qwen_vl

    return build_tiny_qwen_vl(str(tmp_path_factory.mktemp("tiny-qwen2-5-vl")))
