"""Shared pytest fixtures for the whole suite."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bundled_model_path() -> str:
    """HF-format folder of the bundled SmolLM2-135M-Instruct (converted once, then cached)."""
    from jaxpaged.models import bundled

    return bundled.default_model_path()
