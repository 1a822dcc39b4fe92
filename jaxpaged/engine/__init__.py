"""The engine: LLMEngine (synchronous) and AsyncEngine (asyncio, engine on its own thread)."""

from jaxpaged.engine.async_engine import AsyncEngine, RequestStream
from jaxpaged.engine.llm_engine import (
    EngineDeadError,
    EngineStats,
    LLMEngine,
    Prompt,
    configure_process,
)

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "Prompt",
    "RequestStream",
    "configure_process",
]
