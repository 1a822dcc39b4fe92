"""Custom logits processors on the bundled SmolLM2: a no-repeat-n-gram rule and a
classifier-free-guidance-style mix of two prompts, both chosen per request in one batch.

    .venv/bin/python examples/logits_processors.py

A processor is ``fn(logits [B, V], history, args [B, A]) -> logits [B, V]``, traced once into
the engine's jitted step; requests pick one by name with their own numbers, so any mix of
requests runs without recompiling (the compilation count is printed).
"""

from __future__ import annotations

from jaxpaged import LLM, SamplingParams
from jaxpaged.worker.compile_counter import CompileCounter
from jaxpaged.worker.logits_processors import guidance_mix, no_repeat_ngram

GREEDY = dict(temperature=0, max_tokens=40)


def main() -> None:
    llm = LLM(
        max_model_len=256,
        max_num_seqs=8,
        show_progress=False,
        logits_processors=(no_repeat_ngram(), guidance_mix()),
    )

    def chat(text: str) -> list[int]:
        return llm.apply_chat_template([{"role": "user", "content": text}])

    story = chat("Repeat the word 'hello' many times.")
    plain = SamplingParams(**GREEDY)
    no_repeat = SamplingParams(
        **GREEDY, logits_processor="no_repeat_ngram", logits_processor_args=(2,)
    )
    # guidance: the conditional prompt asks for a style, the unconditional one does not; the
    # pair (group 1) decodes uncond + 3 * (cond - uncond) on log-probabilities
    cond, uncond = chat("Describe the sea like a pirate."), chat("Describe the sea.")
    guided = [
        SamplingParams(**GREEDY, logits_processor="guidance", logits_processor_args=(1, role, 3.0))
        for role in (1, 0)
    ]
    with CompileCounter() as compiles:
        outs = llm.generate(
            [story, story, cond, uncond, cond],
            [plain, no_repeat, *guided, plain],
            use_tqdm=False,
        )
    names = ["plain", "no_repeat_ngram n=2", "guided (cond)", "guided (uncond)", "cond, plain"]
    for name, out in zip(names, outs, strict=True):
        print(f"{name:22s} {out.outputs[0].text!r}")
    print(f"compilations while generating: {compiles.count}")


if __name__ == "__main__":
    main()
