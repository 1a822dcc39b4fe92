"""Structured output with n-gram speculative decoding, on a tiny random model over the
bundled SmolLM2 tokenizer's vocabulary: a grammar request drafts too, each verified
position sampled under the grammar's mask after the drafts before it, so no token the
grammar rejects is ever emitted: greedy output is the engine's without speculation, token
for token, alone and beside plain drafting requests. (Drafts made on the device, by a
draft model or an EAGLE-3 head: test_spec_grammar_device.py.)"""

from __future__ import annotations

import json
import re

import pytest
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.models.testing import random_params, tiny_config
from jaxpaged.sampling_params import StructuredOutput

CONFIG = tiny_config(vocab_size=49152)  # the bundled tokenizer's
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2, "disable_by_batch_size": 8}  # fmt: skip
BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
            max_prefill_tokens_with_decodes=32,
            num_kv_blocks=48, show_progress=False, enforce_eager=True)  # fmt: skip
REGEX = "[a-z]{3,8}"


@pytest.fixture(scope="module")
def engines(bundled_model_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    params = random_params(CONFIG, seed=2)
    made = [
        LLM.from_engine(
            LLMEngine.from_params(CONFIG, params, tokenizer, eos_token_ids=[2], **BASE, **kw)
        )  # fmt: skip
        for kw in ({}, {"speculative_config": SPEC})
    ]
    yield made
    for llm in made:
        llm.close()


def test_grammar_request_beside_drafting_requests(engines):
    plain, spec = engines
    loop = [1043, 2219, 517, 8842]
    prompts = [loop * 5, [77, 901, 3344] * 6, loop * 3 + [12, 13]]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=24, structured_output=StructuredOutput(regex=REGEX)
        ),  # fmt: skip
    ]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
    text = got[2].outputs[0].text
    assert re.fullmatch(REGEX, text) and got[2].outputs[0].finish_reason == "stop", text
    m = spec.get_metrics()
    assert m["spec_decode_num_drafts"] > 0


def _spec_counts(llm) -> tuple[int, int]:
    m = llm.get_metrics()
    return m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]


def test_json_schema_request_drafts_within_its_grammar(engines, bundled_model_path):
    """A JSON-schema request alone: its prompt holds JSON written with spaces (which strict
    JSON's compact grammar rejects), so the n-gram drafts run into the grammar; every
    emitted token obeys it, the output equals the engine's without speculation, and drafts
    were verified and accepted."""
    plain, spec = engines
    tok = transformers.AutoTokenizer.from_pretrained(bundled_model_path)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        },
        "required": ["name", "tags"],
    }
    prompt = tok.encode('{"name": "ab ab", "tags": ["ab", "ab"]} {"name":"ab"' * 2)
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_output=StructuredOutput(json=schema)
    )
    before = _spec_counts(spec)
    (want,) = plain.generate([prompt], params)
    (got,) = spec.generate([prompt], params)
    drafted, accepted = (a - b for a, b in zip(_spec_counts(spec), before, strict=True))
    out = got.outputs[0]
    assert list(out.token_ids) == list(want.outputs[0].token_ids), (out.text, want.outputs[0].text)
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"name", "tags"}, out.text
    assert drafted > accepted > 0, (drafted, accepted)
