"""FastTokenizer (tokenizer.json + jinja2, no transformers) against transformers' own
tokenizer of the same folder: ids, chat prompts (system, tools, tool calls, generation
prompt, template errors), decoding and incremental detokenization must be equal."""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.models.fast_tokenizer import FastTokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces,\n\nnewlines\tand tabs ",
    "<|im_start|>user\nhi<|im_end|><s></s>",
    "h\u00e9llo w\u00f6rld \U0001f916 \u4e2d\u6587 x\u00b2 don't 12345",
]

# Qwen2.5's tool-calling template (tools, tojson, tool calls, tool results)
QWEN_TOOLS = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([]) %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Gemma's (bos_token, raise_exception on bad alternation, namespace, a strftime_now call)
GEMMA = """{{ bos_token }}{% set ns = namespace(first=true) %}
{%- if messages[0]['role'] == 'system' -%}{%- set sys = messages[0]['content'] + '\\n\\n' -%}
{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set sys = '' -%}
{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (sys if loop.first else '') }}{{ message['content'] | trim }}
{{ '<end_of_turn>\\n' }}{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
{%- if strftime_now('%Y') | length != 4 %}{{ raise_exception('no date') }}{% endif -%}"""

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, \u00b0C <now>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "tool_calls": None},
        {"role": "user", "content": "Weather in Paris?"},
    ],
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris \u00e9"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]


def _tiny_sentencepiece_folder(path) -> str:
    """A SentencePiece-style tokenizer (byte fallback, Metaspace, BOS added by the
    post-processor, specials in the config) written as a transformers folder."""
    pieces = [
        "<unk>",
        "<s>",
        "</s>",
        "\u2581",
        *"helowrd",
        "\u2581h",
        "\u2581w",
        "ll",
        "ell",
        "ello",
    ]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("\u2581", "h"), ("\u2581", "w"), ("l", "l"), ("e", "ll"), ("ell", "o")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "chat_template": GEMMA,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module", params=["bundled", "sentencepiece"])
def pair(request, bundled_model_path, tmp_path_factory):
    if request.param == "bundled":
        folder = bundled_model_path
    else:
        folder = _tiny_sentencepiece_folder(tmp_path_factory.mktemp("spm"))
    return FastTokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_encode_decode_and_special_tokens_match_transformers(pair):
    fast, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
    assert fast.special_tokens_map == hf.special_tokens_map
    assert (fast.bos_token_id, fast.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert sorted(fast.all_special_ids) == sorted(hf.all_special_ids)
    assert (len(fast), fast.vocab_size) == (len(hf), hf.vocab_size)
    ids = hf.encode(TEXTS[3])
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("template", [None, QWEN_TOOLS, GEMMA], ids=["own", "qwen", "gemma"])
def test_chat_template_matches_transformers(pair, template):
    fast, hf = pair
    cases = [(c, None) for c in CONVERSATIONS]
    if template is QWEN_TOOLS:
        cases += [(CONVERSATIONS[0], [TOOL]), (TOOL_CONVERSATION, [TOOL])]
    for conversation, tools in cases:
        for gen in (True, False):
            kw = dict(chat_template=template, tools=tools, add_generation_prompt=gen)
            if template is GEMMA and conversation is CONVERSATIONS[1]:
                kw["chat_template"] = GEMMA
            text = fast.apply_chat_template(conversation, tokenize=False, **kw)
            assert text == hf.apply_chat_template(conversation, tokenize=False, **kw)
            assert fast.apply_chat_template(conversation, **kw) == _ids(
                hf.apply_chat_template(conversation, **kw)
            )
    if template is GEMMA:  # the template's own error, raised the same way
        bad = [{"role": "assistant", "content": "x"}]
        with pytest.raises(Exception, match="roles must alternate") as theirs:
            hf.apply_chat_template(bad, chat_template=GEMMA, tokenize=False)
        with pytest.raises(type(theirs.value), match="roles must alternate"):
            fast.apply_chat_template(bad, chat_template=GEMMA, tokenize=False)


def test_incremental_detokenization_matches_transformers(pair):
    fast, hf = pair
    prompt = hf.encode("Say something:")
    out = hf.encode(
        " h\u00e9llo w\u00f6rld \U0001f916, don't\n\u4e2d\u6587!", add_special_tokens=False
    )
    out += [hf.eos_token_id]
    for skip in (True, False):
        texts = []
        for tok in (fast, hf):
            d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=["\u6587!"])
            texts.append([d.add_tokens([t])[0] for t in out] + [d.flush()])
        assert texts[0] == texts[1]


def test_missing_tokenizer_json_and_unsupported_arguments_are_value_errors(tmp_path, pair):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        FastTokenizer.from_folder(tmp_path)
    with pytest.raises(ValueError, match="continue_final_message"):
        pair[0].apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(ValueError, match=r"tools\[0\] must be a JSON schema"):
        pair[0].apply_chat_template(CONVERSATIONS[0], tools=[len], chat_template=QWEN_TOOLS)


def test_tokenizer_modes():
    from jaxpaged.args import TOKENIZER_MODES
    from jaxpaged.models.loader import TOKENIZER_MODES as LOADER_MODES
    from jaxpaged.models.loader import load_tokenizer

    assert TOKENIZER_MODES == LOADER_MODES
    with pytest.raises(ValueError, match="tokenizer_mode"):
        load_tokenizer("unused", "slow")
