"""Shared fixtures for kernel tests: a fresh random generator per test, seed printed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxpaged.kernels.testing import rel_err


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh inputs every run; set JAXPAGED_TEST_SEED to replay the seed a failure printed."""
    seed = int(os.environ.get("JAXPAGED_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"JAXPAGED_TEST_SEED={seed}")  # pytest shows captured stdout for failed tests
    return np.random.default_rng(seed)


def check_padding_rows(out, case) -> None:
    """Rows past cu_q_lens[num_seqs] must be finite zeros."""
    total = sum(q for q, _ in case.seqs)
    pad = np.asarray(out).astype(np.float32)[total:]
    assert np.all(pad == 0.0), "padding rows are not zeros"


@pytest.fixture
def tools():
    return {"rel_err": rel_err, "check_padding_rows": check_padding_rows}
