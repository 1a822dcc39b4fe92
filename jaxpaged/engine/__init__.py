"""The engine: EngineCore (the loop, on one thread), LLMEngine (driven by the caller's
thread) and AsyncEngine (asyncio; the core on a thread of its own)."""

from jaxpaged.engine.async_engine import AsyncEngine, RequestStream
from jaxpaged.engine.core import EngineCore, EngineRequest, EngineStepError
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.process import configure_process, process_owner_args
from jaxpaged.engine.protocol import (
    EngineAsleepError,
    EngineClient,
    EngineDeadError,
    EngineStats,
    Prompt,
)

__all__ = [
    "AsyncEngine",
    "EngineAsleepError",
    "EngineClient",
    "EngineCore",
    "EngineDeadError",
    "EngineRequest",
    "EngineStats",
    "EngineStepError",
    "LLMEngine",
    "Prompt",
    "RequestStream",
    "configure_process",
    "process_owner_args",
]
