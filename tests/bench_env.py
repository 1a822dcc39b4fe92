"""The environment the bench scripts run in under the suite: tests/conftest.py sets
PYTHONSAFEPATH for the suite's children, and a bench script imports its siblings (common,
vllm_peer) from its own folder, which PYTHONSAFEPATH leaves off sys.path."""

from __future__ import annotations

import os


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return {**env, **extra}
