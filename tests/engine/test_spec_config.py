"""speculative_config: vLLM's keys through LLM / EngineArgs and `jaxpaged serve
--speculative-config`, with unknown keys and unsupported combinations refused by name."""

from __future__ import annotations

import pytest

from jaxpaged.args import EngineArgs
from jaxpaged.cli.serve import build_parser
from jaxpaged.spec import SpeculativeConfig


def test_vllm_keys_and_defaults():
    c = SpeculativeConfig.from_value(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 2,
        }  # fmt: skip
    )
    assert (c.method, c.num_speculative_tokens, c.lookup_window) == ("ngram", 4, (2, 3))
    # vLLM's rule: neither bound -> 5 and 5; one bound -> both that value
    assert SpeculativeConfig(num_speculative_tokens=2).lookup_window == (5, 5)
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).lookup_window == (3, 3)
    # method left out: ngram without a model, draft_model with one
    assert SpeculativeConfig.from_value('{"num_speculative_tokens": 2}').method == "ngram"
    draft = SpeculativeConfig.from_value({"model": "/drafts/q4.gguf", "num_speculative_tokens": 3})
    assert (draft.method, draft.model) == ("draft_model", "/drafts/q4.gguf")
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3}, "prompt_lookup_max"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "medusa"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": "x"}, "EAGLE-1/2"),
        ({"method": "mtp", "num_speculative_tokens": 2}, "mtp"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "eagle3", "num_speculative_tokens": 2, "model": "x", "quantization": "fp8"},
         "quantization"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "gguf"}, "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
         "draft_tensor_parallel_size"),
        ({"method": "eagle3", "num_speculative_tokens": 2, "model": "x",
          "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ("{not json", "JSON"),
        ([1, 2], "dict"),
    ],
)  # fmt: skip
def test_refused_by_name(value, names):
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.from_value(value)


def test_engine_args_and_llm_keyword():
    args = EngineArgs.from_kwargs(speculative_config={"num_speculative_tokens": 3})
    assert args.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="lookahead"):
        EngineArgs.from_kwargs(speculative_config={"num_speculative_tokens": 3, "lookahead": 1})


def test_serve_flag(capsys):
    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    args = EngineArgs.from_cli_args(build_parser().parse_args(["--speculative-config", flag]))
    assert args.speculative_config == SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=3
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative-config", '{"num_speculative_tokens": 4, "x": 1}'])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "unknown key 'x'" in err


def test_draft_split_as_the_target():
    """A draft model runs on the target's devices: draft_tensor_parallel_size is the engine's
    tensor_parallel_size or unset (the draft itself at TP=2: tests/parallel/tp_spec_checks.py)."""
    from jaxpaged.config import SchedulerConfig
    from jaxpaged.engine.spec_builder import check_draft
    from jaxpaged.models.testing import tiny_config

    cfg, sched = tiny_config(), SchedulerConfig(max_model_len=64)
    for tp, draft_tp in ((2, None), (2, 2), (1, 1)):
        spec = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2,
                                 draft_tensor_parallel_size=draft_tp)  # fmt: skip
        check_draft(cfg, cfg, spec, sched, tensor_parallel_size=tp)
    spec = SpeculativeConfig(
        method="draft_model", model="d", num_speculative_tokens=2, draft_tensor_parallel_size=1
    )
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size \(1\).*\(2\)"):
        check_draft(cfg, cfg, spec, sched, tensor_parallel_size=2)
