"""An on-policy loop on the bundled SmolLM2: generate from the current weights, update them
(a toy step standing in for a trainer's), generate again, with one engine for the whole loop.

    .venv/bin/python examples/on_policy_loop.py [--rounds 4] [--compare]

The first round builds the engine (KV pool, warm-up compiles every step shape); later rounds
swap the new weights in (``LLM.update_weights``, through the ``jaxpaged.Generator`` the loop
owns) and compile nothing. ``--compare`` also times one round the old way, a fresh engine per
``jaxpaged.generate`` call.
"""

from __future__ import annotations

import argparse
import time

import jax

import jaxpaged
from jaxpaged.models import default_model_path, load_model, load_tokenizer
from jaxpaged.worker.compile_counter import CompileCounter

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
]
SETTINGS = dict(max_model_len=256, max_num_seqs=8)


@jax.jit
def toy_update(params):
    """A stand-in for an optimizer step: every weight shrinks by 0.1% (new arrays, same
    shapes; the old ones are not donated, as the engine may still hold them)."""
    return jax.tree.map(lambda w: w * 0.999, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compare", action="store_true")
    cli = parser.parse_args()

    folder = default_model_path()
    config, params = load_model(folder, progress=False)
    tokenizer = load_tokenizer(folder)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    sampling = jaxpaged.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)
    kwargs = dict(config=config, tokenizer=tokenizer, **SETTINGS)

    times = []
    with jaxpaged.Generator() as gen:
        for r in range(cli.rounds):
            with CompileCounter() as compiles:
                # jaxpaged.generate(prompts, sampling, params=params, generator=gen, **kwargs)
                # does these two steps; they are timed apart here
                start = time.perf_counter()
                llm = gen.llm(params=params, **kwargs)  # round 0 builds; later ones swap
                ready = time.perf_counter()
                outs = llm.generate(prompts, sampling, use_tqdm=False)
                done = time.perf_counter()
            times.append(done - start)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(
                f"round {r}: {done - start:6.2f} s (engine {'build' if r == 0 else 'weight swap'} "
                f"{ready - start:5.2f} s, generate {done - ready:5.2f} s), "
                f"{compiles.count:3d} compilations, {tokens} tokens, "
                f"engines built {gen.engines_built}: {outs[0].outputs[0].text!r}"
            )
            params = jax.block_until_ready(toy_update(params))
    later = sum(times[1:]) / max(1, len(times) - 1)
    print(f"later rounds take {later / times[0]:.1%} of the first on average ({later:.2f} s)")
    if cli.compare:
        start = time.perf_counter()
        jaxpaged.generate(prompts, sampling, params=params, **kwargs)
        took = time.perf_counter() - start
        print(f"one round with a fresh engine (no Generator, same process): {took:.2f} s")


if __name__ == "__main__":
    main()
