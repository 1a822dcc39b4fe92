"""Speculative decoding, host side: the configuration (vLLM's ``speculative_config`` keys)
and the n-gram prompt-lookup proposer. Plain Python, no JAX: the scheduler drafts with it;
the verification of drafts runs in the worker's step (:mod:`jaxpaged.worker.spec_verify`)."""

from jaxpaged.spec.config import SpeculativeConfig
from jaxpaged.spec.ngram import DeviceDraftSlots, NgramProposer, proposer_for

__all__ = ["DeviceDraftSlots", "NgramProposer", "SpeculativeConfig", "proposer_for"]
