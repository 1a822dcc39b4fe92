"""Offline batched inference: vLLM's first example, with jaxpaged.

    python examples/offline_inference.py [MODEL]

MODEL is a Hugging Face hub id, a local folder or a .gguf file; without it, the bundled
SmolLM2-135M-Instruct (no download).
"""

import sys

from jaxpaged import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else None  # None: the bundled SmolLM2

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100)

# Create an LLM.
llm = LLM(model=MODEL)
# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
