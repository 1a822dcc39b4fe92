"""Which runner a model runs (vLLM's ``--runner``): "generate" (the paged engine) or
"pooling" (engine/pooling.py). "auto" reads the checkpoint's config.json: its family's
declaration (``ModelFamily.runner``: encoders pool, decoders generate), and a decoder's
``*ForSequenceClassification`` (a converted reranker, or one ``hf_overrides`` names) pools. Imports no JAX at import
time (the checkpoint checks import models/ when called)."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxpaged.args import RUNNERS, EngineArgs
from jaxpaged.hf_overrides import apply_hf_overrides

__all__ = ["choose_runner", "read_hf_config"]


def choose_runner(args: EngineArgs) -> str:
    """ "generate" or "pooling": ``args.runner``, or for "auto" the runner the checkpoint's
    family declares (the bundled SmolLM2 and GGUF files generate). A decoder may pool
    (``runner="pooling"``: last-token embeddings, as Qwen3-Embedding); an encoder cannot
    generate (ValueError naming both)."""
    if args.runner not in RUNNERS:
        raise ValueError(f"runner: {args.runner!r} is not one of {', '.join(RUNNERS)}")
    declared = _declared_runner(args)
    if args.runner == "auto":
        return declared
    if args.runner == "generate" and declared == "pooling":
        raise ValueError(
            f"runner='generate' cannot run model {args.model!r}: it is a pooling model (an "
            "encoder: BERT, RoBERTa, XLM-R; or a *ForSequenceClassification checkpoint), which "
            "runs only runner='pooling' (embeddings and scores)"
        )
    return args.runner


def _declared_runner(args: EngineArgs) -> str:
    model = args.model
    if model is None or os.fspath(model).endswith(".gguf") or ":" in os.fspath(model):
        return "generate"
    from jaxpaged.models.hub import resolve_model_path
    from jaxpaged.models.registry import family_for_hf_config
    from jaxpaged.models.seq_cls import is_decoder_classifier

    folder = resolve_model_path(model, revision=args.revision, download_dir=args.download_dir)
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):  # an Orbax folder (jaxpaged.convert): decoders only
        return "generate"
    d = apply_hf_overrides(read_hf_config(folder), args.hf_overrides)
    if is_decoder_classifier(d):  # a converted reranker: its score head pools
        return "pooling"
    return family_for_hf_config(d).runner


def read_hf_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)
