"""Preemption by swapping: when the KV cache runs out, a running request's blocks move to host
memory (at most swap_space of it) and come back later, bit-exact.

    python examples/swap_space.py [MODEL]

The KV cache is kept small here (num_kv_blocks) so that eight requests cannot all fit and
some are swapped out and back in; ignore_eos makes each of them run its 100 tokens.
"""

import sys

from jaxpaged import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else None  # None: the bundled SmolLM2

prompts = [f"Once upon a time, a {animal}" for animal in (
    "cat", "dog", "horse", "fox", "owl", "whale", "bee", "crow",
)]  # fmt: skip
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100, ignore_eos=True)

llm = LLM(
    model=MODEL,
    swap_space="16GiB",  # host memory for swapped-out blocks (a number is GiB, as in vLLM)
    preemption_mode="swap",
    num_kv_blocks=40,  # 640 tokens: too few for eight requests of up to ~120 tokens
    max_model_len=512,
)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
print("preemptions:", llm.get_metrics()["num_preemptions"])
