"""jaxpaged: a pure-JAX LLM inference and serving engine (paged KV cache, continuous batching).

    from jaxpaged import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

The public names are imported on first use, so `import jaxpaged.kernels` (or `.models`) does
not pull in the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "jaxpaged.llm",
    "LoRARequest": "jaxpaged.lora_request",
    "generate": "jaxpaged.generate",
    "Generator": "jaxpaged.generate",
    "ClassificationRequestOutput": "jaxpaged.pooling_outputs",
    "CompletionOutput": "jaxpaged.outputs",
    "EmbeddingRequestOutput": "jaxpaged.pooling_outputs",
    "Logprob": "jaxpaged.outputs",
    "RequestMetrics": "jaxpaged.outputs",
    "RequestOutput": "jaxpaged.outputs",
    "SamplingParams": "jaxpaged.sampling_params",
    "ScoringRequestOutput": "jaxpaged.pooling_outputs",
    "StructuredOutput": "jaxpaged.sampling_params",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
