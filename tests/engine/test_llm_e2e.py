"""The engine end to end on the bundled SmolLM2, against Hugging Face transformers.

16 concurrent greedy requests of different prompt and output lengths must produce, token for
token, what transformers produces for each prompt alone - also when the pool is so small that
requests are preempted (both modes), and with prefix caching off and chunked prefill forced
by a tiny token budget. Engines here share shapes (max_num_seqs, max_model_len, token budget,
pool size) so the compiled programs are reused across tests: the warmed-up engine's buckets
are the eager engines' (it loads from the persistent compile cache what they compiled).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 16
# 64-token steps: the mixed buckets are 16, 32 and 64 tokens (the default budget of 512 adds
# 128 and 256, each one more program to compile)
BASE = dict(
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=MAX_NUM_SEQS,
    max_num_batched_tokens=64,
    show_progress=False,
)
NUM_KV_BLOCKS = 256  # every engine's pool but the preemption test's

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Name a famous physicist and one discovery.",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
    "Why is the sky blue? Answer briefly, please, in simple words a child understands.",
    "Describe a cat.",
    "What does a compiler do?",
    "Suggest a name for a small bakery in a quiet seaside town.",
    "How many legs does a spider have?",
    "Write one line of Python that prints hello.",
    "What is the boiling point of water at sea level, in Celsius and Fahrenheit?",
    "Tell me a fun fact about octopuses.",
]


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_model_path)


@pytest.fixture(scope="module")
def workload(tokenizer):
    """(prompt token ids, max_tokens) per request: chat prompts of different lengths."""
    rng = random.Random(0)
    out = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        out.append((list(ids), rng.randint(4, 24)))
    return out


@pytest.fixture(scope="module")
def hf_model(bundled_model_path):
    """transformers' float32 LlamaForCausalLM of the bundled model, loaded once for the module."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, workload):
    """Each prompt alone through transformers' LlamaForCausalLM, greedy, EOS ignored."""
    import torch

    model = hf_model
    refs = []
    with torch.no_grad():
        for ids, max_tokens in workload:
            out = model(torch.tensor([ids]), use_cache=True)
            past, toks = out.past_key_values, []
            for _ in range(max_tokens):
                t = int(out.logits[0, -1].argmax())
                toks.append(t)
                out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            refs.append(toks)
    return refs


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _run_and_compare(llm: LLM, workload, hf_greedy) -> None:
    outs = llm.generate(
        [ids for ids, _ in workload], [_greedy(m) for _, m in workload], use_tqdm=False
    )
    for i, (out, ref) in enumerate(zip(outs, hf_greedy, strict=True)):
        got = list(out.outputs[0].token_ids)
        assert got == ref, f"request {i}: jaxpaged {got} != transformers {ref}"
        assert out.outputs[0].finish_reason == "length"
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_kv_blocks"], "blocks leaked"
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(bundled_model_path):
    engine_llm = LLM(bundled_model_path, num_kv_blocks=NUM_KV_BLOCKS, enforce_eager=True, **BASE)
    yield engine_llm
    engine_llm.engine.close()


def test_concurrent_greedy_matches_transformers(llm, workload, hf_greedy):
    _run_and_compare(llm, workload, hf_greedy)
    m = llm.get_metrics()
    # every chat prompt starts with the same system preamble: full blocks are shared
    assert m["prefix_cache_hits"] > 0
    assert m["num_preemptions"] == 0


def test_prefix_caching_off_and_chunked_prefill(bundled_model_path, workload, hf_greedy):
    """Prefix caching off and every prompt split by a 16-token budget, in one engine (the
    default engine above has caching on and a 64-token budget)."""
    llm = LLM(
        bundled_model_path,
        num_kv_blocks=NUM_KV_BLOCKS,
        enable_prefix_caching=False,
        enforce_eager=True,
        **{**BASE, "max_num_batched_tokens": 16},
    )
    assert max(len(ids) for ids, _ in workload) > 16  # so prompts really are split
    _run_and_compare(llm, workload, hf_greedy)
    assert llm.get_metrics()["prefix_cache_hits"] == 0


@pytest.mark.parametrize(
    "mode",
    [
        "recompute",
        # swap's exactness runs by default on tiny models (test_kv_offload, test_pool_layouts)
        pytest.param(
            "swap",
            marks=pytest.mark.skipif(
                os.environ.get("JAXPAGED_TEST_FULL") != "1", reason="JAXPAGED_TEST_FULL=1"
            ),
        ),
    ],
)
def test_preemption_keeps_outputs_exact(bundled_model_path, workload, hf_greedy, mode):
    llm = LLM(
        bundled_model_path,
        num_kv_blocks=16,  # one max_model_len sequence; 8 requests need ~6 each
        preemption_mode=mode,
        swap_space=0.5,
        enforce_eager=True,
        **BASE,
    )
    # every other request: still ~3x the pool, at half the compute of all 16
    _run_and_compare(llm, workload[::2], hf_greedy[::2])
    assert llm.get_metrics()["num_preemptions"] > 0


def test_bad_requests_raise_and_engine_keeps_serving(llm, workload, hf_greedy, tokenizer):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    bad = [
        ([], _greedy(4), "prompt"),
        ([1] * MAX_MODEL_LEN, _greedy(4), "prompt"),
        ([1, 2, vocab], _greedy(4), "vocabulary"),
        ([1, 2, 3], _greedy(MAX_MODEL_LEN), "max_tokens"),
        # more ids for min_tokens to hold back than the step's fixed-size ban list
        ([1, 2, 3], SamplingParams(min_tokens=3, stop_token_ids=list(range(40))), "stop_token_ids"),
    ]
    engine.add_request("good-0", workload[0][0], _greedy(workload[0][1]))
    for i, (prompt, params, word) in enumerate(bad):
        with pytest.raises(ValueError, match=word):
            engine.add_request(f"bad-{i}", prompt, params)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-0", workload[1][0], _greedy(4))
    outs, tokens = [], []  # the default output kind: deltas
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == "good-0"
            tokens += [t for c in o.outputs for t in c.token_ids]
            outs += [o] if o.finished else []
    assert [o.request_id for o in outs] == ["good-0"]
    assert tokens == hf_greedy[0]
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_kv_blocks"]


def test_repetition_penalty_matches_transformers(llm, hf_model, workload):
    """Penalty counts kept on the device (filled once, updated by every overlapped step,
    also from tokens the host has not seen yet) give transformers' greedy tokens under its
    own RepetitionPenaltyLogitsProcessor, with penalised and plain requests in one batch."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    picked = [workload[i][0] for i in (1, 4, 9)]
    n, penalty = 24, 1.3
    model = hf_model
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    refs = []
    with torch.no_grad():
        for ids in picked:
            seq = torch.tensor([ids])
            out = model(seq, use_cache=True)
            for _ in range(n):
                scores = processor(seq, out.logits[:, -1].float())
                t = int(scores[0].argmax())
                seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
                out = model(
                    torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True
                )
            refs.append(seq[0, len(ids) :].tolist())
    pen = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=penalty)
    prompts = [picked[0], workload[2][0], picked[1], workload[3][0], picked[2]]
    params = [pen, _greedy(n), pen, _greedy(n), pen]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [list(outs[i].outputs[0].token_ids) for i in (0, 2, 4)]
    assert got == refs
    plain = llm.generate(picked, _greedy(n), use_tqdm=False)
    assert got != [list(o.outputs[0].token_ids) for o in plain]  # the penalty changed something
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_kv_blocks"]


def test_abort_frees_blocks(llm, workload):
    engine = llm.engine
    free0 = engine.get_stats().num_free_blocks
    for i, (ids, _) in enumerate(workload[:4]):
        engine.add_request(f"abort-{i}", ids, _greedy(30))
    engine.step()
    engine.step()
    assert engine.get_stats().num_free_blocks < free0
    final = [engine.abort(f"abort-{i}") for i in range(4)]
    assert all(o is not None and o.outputs[0].finish_reason == "abort" for o in final)
    assert engine.abort("abort-0") is None  # already gone
    assert engine.get_stats().num_free_blocks == free0
    assert not engine.has_unfinished_requests()


def test_seeded_sampling_is_independent_of_the_batch(llm, workload):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    alone = llm.generate([workload[3][0]], params, use_tqdm=False)[0]
    others = [ids for ids, _ in workload[:6]]
    mixed = llm.generate(
        others[:2] + [workload[3][0]] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=20)] * 2
        + [params]
        + [SamplingParams(temperature=1.0, max_tokens=20)] * 4,
        use_tqdm=False,
    )[2]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids


def test_n_samples_share_the_prompt(llm, workload):
    ids = workload[8][0]
    before = llm.get_metrics()["prefix_cache_hits"]
    out = llm.generate([ids], SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=8))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({c.token_ids for c in out.outputs}) > 1  # different samples
    # samples 1..3 start from sample 0's prompt blocks
    assert llm.get_metrics()["prefix_cache_hits"] - before >= 3 * (len(ids) - 1)


def test_reset_prefix_cache_recomputes_the_prompt(llm, workload):
    """After reset_prefix_cache a repeated prompt hits nothing (a benchmark round computes it
    in full) and still gives the same greedy tokens."""
    ids = workload[5][0]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = llm.generate([ids], params, use_tqdm=False)[0]
    before = llm.get_metrics()["prefix_cache_hits"]
    llm.generate([ids], params, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] - before >= (len(ids) - 1) // 16 * 16 > 0
    llm.reset_prefix_cache()
    before = llm.get_metrics()["prefix_cache_hits"]
    again = llm.generate([ids], params, use_tqdm=False)[0]
    assert llm.get_metrics()["prefix_cache_hits"] == before
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_kv_blocks"], "blocks leaked"


def test_no_compilation_after_warmup(bundled_model_path, workload):
    """A warmed-up engine serves varied batch sizes and lengths without compiling, with
    prompt logprobs, logit bias and grammar masks in the mix."""
    llm = LLM(
        bundled_model_path,
        num_kv_blocks=NUM_KV_BLOCKS,
        # a given cap: nothing timed at start-up (test_prefill_budget covers the measurement)
        max_prefill_tokens_with_decodes=32,
        **BASE,  # the eager engines' shapes: most of its warm-up loads their programs
    )
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0
    rng = np.random.default_rng(0)
    for batch in (1, 3, 8, 16):
        picks = rng.choice(len(workload), size=batch, replace=batch > len(workload))
        llm.generate(
            [workload[i][0] for i in picks],
            [
                SamplingParams(
                    temperature=float(rng.choice([0.0, 0.8])),
                    top_k=int(rng.choice([-1, 20])),
                    max_tokens=int(rng.integers(1, 30)),
                    logprobs=int(rng.choice([0, 3])) if batch == 3 else None,
                    repetition_penalty=1.1 if batch == 8 else 1.0,
                    prompt_logprobs=2 if batch == 1 else None,
                    logit_bias={5: 2.0} if batch == 16 and k % 3 == 1 else None,
                    structured_output=StructuredOutput(regex="[a-z ]{1,40}")
                    if batch == 16 and k % 3 == 0
                    else None,
                )
                for k in range(len(picks))
            ],
            use_tqdm=False,
        )
    assert llm.get_metrics()["num_compilations_after_warmup"] == 0


def test_bfloat16_engine_tracks_transformers(bundled_model_path, hf_model, workload):
    """A bfloat16 model on CPU (bf16 matmul weights, bf16 KV pool written in place), with
    transformers teacher-forced on the engine's own tokens (so one bf16 near-tie cannot
    derail the rest): every greedy token is float32 transformers' argmax up to a near-tie,
    its logprob is close to float32's, and on average no further from it than transformers'
    own bfloat16 model is."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.kernels import cpu

    llm = LLM(
        bundled_model_path,
        dtype="bfloat16",
        num_kv_blocks=NUM_KV_BLOCKS,
        enforce_eager=True,
        **BASE,
    )
    assert (llm.engine.runner.kernels.linear is cpu.linear) == cpu.available()
    reqs = workload[:6]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([ids for ids, _ in reqs], params, use_tqdm=False)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_kv_blocks"], "blocks leaked"
    llm.engine.close()

    models = {
        torch.float32: hf_model,
        torch.bfloat16: AutoModelForCausalLM.from_pretrained(
            bundled_model_path, dtype=torch.bfloat16
        ),
    }
    ours, theirs = [], []
    for (ids, _), out in zip(reqs, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        assert len(got) == 8
        ref = {}
        with torch.no_grad():
            for dt, model in models.items():
                logits = model(torch.tensor([ids + got])).logits[0].float()
                ref[dt] = torch.log_softmax(logits, -1)[len(ids) - 1 : len(ids) - 1 + 8]
        f32 = ref[torch.float32]
        for i, (tok, lp) in enumerate(zip(got, out.outputs[0].logprobs, strict=True)):
            assert lp.token_id == tok
            assert float(f32[i].max() - f32[i, tok]) < 0.25, (i, tok)  # argmax up to a tie
            ours.append(abs(lp.logprob - float(f32[i, tok])))
            theirs.append(abs(float(ref[torch.bfloat16][i, tok]) - float(f32[i, tok])))
    assert max(ours) < 0.25, max(ours)
    assert np.mean(ours) <= 1.5 * np.mean(theirs), (np.mean(ours), np.mean(theirs))
