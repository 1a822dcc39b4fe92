"""The encoder family against transformers on tiny random checkpoints: BERT's and
RoBERTa's last hidden states over a padded batch (RoBERTa's positions start after its
padding id; BERT's token types), and both cross-encoder heads' logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from encoders import VOCAB, save_encoder

from jaxpaged.models import bert
from jaxpaged.models.loader import load_model
from jaxpaged.models.registry import family_of

LENGTHS = (9, 4, 1)  # one padded batch: rows of different lengths


def _batch(pad: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    s = max(LENGTHS)
    tokens = np.full((len(LENGTHS), s), pad, np.int32)
    mask = np.zeros((len(LENGTHS), s), bool)
    types = np.zeros((len(LENGTHS), s), np.int32)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = rng.integers(5, VOCAB, n)
        mask[i, :n] = True
    types[0, 5:9] = 1  # a pair's second segment
    return tokens, mask, types


def _hf(model: torch.nn.Module, tokens, mask, types, *, typed: bool) -> dict:
    kwargs = dict(input_ids=torch.tensor(tokens, dtype=torch.long),
                  attention_mask=torch.tensor(mask, dtype=torch.long))  # fmt: skip
    if typed:
        kwargs["token_type_ids"] = torch.tensor(types, dtype=torch.long)
    with torch.no_grad():
        return model(**kwargs, output_hidden_states=True)


@pytest.mark.parametrize(
    "kind",
    ["BertForSequenceClassification", "RobertaForSequenceClassification", "XLMRobertaModel"],
)
def test_hidden_states_and_heads_match_transformers(kind, tmp_path):
    hf = save_encoder(str(tmp_path), kind, num_labels=3)
    config, params = load_model(str(tmp_path), progress=False)
    assert family_of(config).name == "bert" and family_of(config).runner == "pooling"
    typed = kind.startswith("Bert")
    tokens, mask, types = _batch(config.pad_token_id)
    if not typed:
        types[:] = 0
    ref = _hf(hf, tokens, mask, types, typed=typed)
    hidden = np.asarray(bert.encode(params, config, jnp.asarray(tokens), jnp.asarray(mask),
                                    jnp.asarray(types)))  # fmt: skip
    want = ref.hidden_states[-1].numpy() if hasattr(ref, "hidden_states") else None
    want = ref.last_hidden_state.numpy() if want is None else want
    assert np.abs(hidden - want)[mask].max() < 1e-5
    if config.classifier:
        assert config.num_labels == 3
        logits = np.asarray(bert.classify(params, jnp.asarray(hidden)))
        np.testing.assert_allclose(logits, ref.logits.numpy(), atol=1e-5)
    else:  # positions must count from pad + 1: shifting them changes the states
        assert config.position_offset == 2
        shifted = bert.encode(params, bert.dataclasses.replace(config, position_offset=0),
                              jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(types))  # fmt: skip
        assert np.abs(np.asarray(shifted) - want)[mask].max() > 1e-3


def test_refused_options_are_named():
    base = dict(model_type="bert", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        bert.parse_config({**base, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act 'swish'"):
        bert.parse_config({**base, "hidden_act": "swish"})
