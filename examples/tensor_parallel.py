"""Tensor parallelism: the weights and the KV cache split over several devices.

    python examples/tensor_parallel.py [MODEL] [TP]

TP (default 3) must divide the model's query heads (SmolLM2-135M-Instruct, the default
model, has 9 query and 3 KV heads). Without 3 accelerators, JAX can show the CPU as several
devices: XLA_FLAGS=--xla_force_host_platform_device_count=3 python examples/tensor_parallel.py
"""

import sys

from jaxpaged import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "bundled" else None
TP = int(sys.argv[2]) if len(sys.argv) > 2 else 3

prompts = [
    "Hello, my name is",
    "The capital of France is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100)

llm = LLM(model=MODEL, tensor_parallel_size=TP)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
