"""A tiny random Qwen2.5-VL saved by transformers with its processor (a word-level tokenizer
with Qwen's vision tokens and a Qwen-style chat template): patch size 4, windows of 2 x 2
merge groups, a vision tower of two blocks (the second with full attention), images of
8 x 8 to 48 x 48 pixels."""

from __future__ import annotations

import dataclasses

VOCAB = 128
VISION_START, VISION_END, VIDEO, IMAGE = 124, 125, 126, 127
MIN_PIXELS, MAX_PIXELS = 8 * 8, 48 * 48
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
SPECIALS = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
            "<|video_pad|>": VIDEO, "<|image_pad|>": IMAGE}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TinyQwenVL:
    hf: object  # transformers.Qwen2_5_VLForConditionalGeneration
    images: object  # transformers.Qwen2VLImageProcessorPil
    tokenizer: object
    folder: str

    def inputs(self, text: str, images: list) -> dict:
        """transformers' inputs of a prompt, as ``Qwen2_5_VLProcessor`` makes them (which
        needs torchvision for its video half): each <|image_pad|> repeated once per token
        of its image (grid t * h * w / 4)."""
        import torch

        out = {}
        if images:
            out = dict(self.images(images=images, return_tensors="pt"))
            for grid in out["image_grid_thw"].tolist():
                n = grid[0] * grid[1] * grid[2] // 4
                text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        out.update(input_ids=ids, attention_mask=torch.ones_like(ids))
        out["mm_token_type_ids"] = (ids == IMAGE).int()
        return out


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for w in ["user", "assistant", "system"] + [f"w{i}" for i in range(VOCAB)]:
        if len(vocab) >= VISION_START:
            break
        vocab[w] = len(vocab)
    vocab.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    tok.add_special_tokens([*SPECIALS, "<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )  # fmt: skip


def build_tiny_qwen_vl(folder: str) -> TinyQwenVL:
    import torch
    import transformers

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
        patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
        fullatt_block_indexes=[1], initializer_range=0.1,
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    hf.save_pretrained(folder)
    images = transformers.Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=4, merge_size=2,
        temporal_patch_size=2, image_mean=[0.48, 0.45, 0.4], image_std=[0.26, 0.27, 0.28],
    )  # fmt: skip
    images.save_pretrained(folder)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(folder)
    return TinyQwenVL(hf, images, tokenizer, folder)
