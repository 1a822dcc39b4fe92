"""EngineArgs is the one source of engine settings: the CLI flags, the LLM / generate keywords
and the engine's configs all derive from its fields. No model is loaded here: construction is
stopped at ``LLMEngine.from_engine_args`` or fails before it reads a weight."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import types

import pytest

import jaxpaged
from jaxpaged.args import ATTENTION_BACKENDS, EngineArgs
from jaxpaged.cli.serve import build_parser
from jaxpaged.engine import LLMEngine
from jaxpaged.llm import LLM
from jaxpaged.models.testing import random_params, tiny_config

# field -> (command-line words, the value they give): every field, none at its default
CLI_CASES = {
    "model": (["/models/m.gguf"], "/models/m.gguf"),
    "runner": (["--runner", "generate"], "generate"),
    "revision": (["--revision", "v1.0"], "v1.0"),
    "download_dir": (["--download-dir", "/data/hub"], "/data/hub"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "quantization": (["-q", "int8"], "int8"),
    "hf_overrides": (
        ["--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"]}'],
        {"architectures": ["Qwen3ForSequenceClassification"]},
    ),
    "tensor_parallel_size": (["-tp", "2"], 2),
    "data_parallel_size": (["-dp", "2"], 2),
    "data_parallel_health_check_period": (["--data-parallel-health-check-period", "2.5"], 2.5),
    "data_parallel_max_restarts": (["--data-parallel-max-restarts", "0"], 0),
    "max_model_len": (["--max-model-len", "512"], 512),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "128"], 128),
    "max_prefill_tokens_with_decodes": (["--max-prefill-tokens-with-decodes", "32"], 32),
    "prefill_stall_ratio": (["--prefill-stall-ratio", "2.5"], 2.5),
    "fit_prefill_to_buckets": (["--fit-prefill-to-buckets"], True),
    "block_size": (["--block-size", "32"], 32),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "kv_cache_memory": (["--kv-cache-memory", "1GiB"], 1 << 30),
    "kv_cache_dtype": (["--kv-cache-dtype", "int8"], "int8"),
    "num_kv_blocks": (["--num-kv-blocks", "64"], 64),
    "swap_space": (["--swap-space", "16GiB"], 16.0),
    "kv_offloading_size": (["--kv-offloading-size", "512MiB"], 0.5),
    "kv_offloading_backend": (["--kv-offloading-backend", "native"], "native"),
    "kv_offloading_disk_dir": (["--kv-offloading-disk-dir", "/tmp/kv"], "/tmp/kv"),
    "kv_offloading_disk_size": (["--kv-offloading-disk-size", "2GiB"], 2.0),
    "preemption_mode": (["--preemption-mode", "swap"], "swap"),
    "scheduling_policy": (["--scheduling-policy", "priority"], "priority"),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "enforce_eager": (["--enforce-eager"], True),
    "attention_backend": (["--attention-backend", "xla"], "xla"),
    "seed": (["--seed", "7"], 7),
    "show_progress": (["--no-show-progress"], False),
    "configure_process": (["--configure-process"], True),
    "compile_cache_dir": (["--compile-cache-dir", "/tmp/xla-cache"], "/tmp/xla-cache"),
    "program_cache_dir": (["--program-cache-dir", "/tmp/programs"], "/tmp/programs"),
    "huge_pages": (["--no-huge-pages"], False),
    "tokenizer_mode": (["--tokenizer-mode", "tokenizers"], "tokenizers"),
    "enable_lora": (["--enable-lora"], True),
    "max_loras": (["--max-loras", "3"], 3),
    "limit_mm_per_prompt": (["--limit-mm-per-prompt", '{"image": 2}'], 2),
    "encoder_cache_images": (["--encoder-cache-images", "5"], 5),
    "max_lora_rank": (["--max-lora-rank", "32"], 32),
    "lora_modules": (["--lora-modules", "a=/x", "b=/y"], ["a=/x", "b=/y"]),
    "speculative_config": (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        {"method": "ngram", "num_speculative_tokens": 3},
    ),
}
NON_DEFAULT = {name: value for name, (_, value) in CLI_CASES.items()}
PYTHON_ONLY = {"logits_processors"}  # callables: a keyword of LLM / generate, not a flag
CLI_FIELDS = set(EngineArgs.field_names()) - PYTHON_ONLY


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments, less --help and second spellings (`--model` beside MODEL)."""
    return [a for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS]


def _dests(parser: argparse.ArgumentParser) -> list[str]:
    return [a.dest for a in _actions(parser)]


def test_cases_cover_every_field():
    assert set(CLI_CASES) == CLI_FIELDS
    defaults = EngineArgs()
    for name, value in NON_DEFAULT.items():
        assert getattr(defaults, name) != value, name


def test_every_field_has_help_and_a_flag():
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["help"], f.name
        assert bool(f.metadata["cli"].flags) == (f.name not in PYTHON_ONLY), f.name
    assert sorted(_dests(_engine_parser())) == sorted(CLI_FIELDS)


def test_defaults_round_trip_through_the_cli():
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_each_flag_round_trips(name):
    words, value = CLI_CASES[name]
    args = EngineArgs.from_cli_args(_engine_parser().parse_args(words))
    assert args == EngineArgs(**{name: value})


def test_all_flags_together_round_trip():
    words = [w for ws, _ in CLI_CASES.values() for w in ws]
    assert EngineArgs.from_cli_args(_engine_parser().parse_args(words)) == EngineArgs(**NON_DEFAULT)


def test_attention_backends_are_the_kernels():
    from jaxpaged.kernels import BACKENDS

    assert set(ATTENTION_BACKENDS) == set(BACKENDS)


def test_serve_takes_its_engine_flags_from_engine_args():
    """The serve parser defines each engine flag once, exactly as EngineArgs does, and none
    of its own flags is an engine setting."""
    serve = build_parser()
    engine_actions = {a.dest: a.option_strings for a in _actions(_engine_parser())}
    serve_dests = _dests(serve)
    assert len(serve_dests) == len(set(serve_dests)), "a flag is defined twice"
    for action in _actions(serve):
        if action.dest in engine_actions:
            assert action.option_strings == engine_actions[action.dest]
    assert CLI_FIELDS <= set(serve_dests)
    own = set(serve_dests) - CLI_FIELDS
    assert own == {
        "host", "port", "grpc_port", "served_model_name", "chat_template", "max_queue_len",
        "shutdown_timeout", "api_key", "log_level", "uvicorn_log_level", "disable_log_requests", "disable_log_stats",
        "config", "num_processes", "process_id", "coordinator_address", "enable_weight_updates",
        "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice",
        "allow_runtime_lora_updating", "responses_store_size", "allowed_media_domains",
        "media_fetch_timeout",
    }  # fmt: skip


def test_serve_flags_reach_the_engine(monkeypatch):
    """`serve`'s engine factory builds the engine (the data-parallel client with -dp N > 1)
    from exactly the EngineArgs of its flags."""
    from jaxpaged.cli.serve import engine_factory_from_args
    from jaxpaged.engine import async_engine, data_parallel

    seen = []
    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(lambda cls, a: seen.append(a)))
    monkeypatch.setattr(async_engine, "AsyncEngine", lambda e: ("async", e))
    monkeypatch.setattr(data_parallel, "DataParallelClient", lambda a: ("dp", a))
    words = [w for ws, _ in CLI_CASES.values() for w in ws]
    got = engine_factory_from_args(build_parser().parse_args(words))()
    assert got == ("dp", EngineArgs(**NON_DEFAULT))
    one = [w for name, (ws, _) in CLI_CASES.items() if name != "data_parallel_size" for w in ws]
    assert engine_factory_from_args(build_parser().parse_args(one))()[0] == "async"
    assert seen == [EngineArgs(**{**NON_DEFAULT, "data_parallel_size": 1})]


def test_serve_owns_its_process_by_default():
    """The library's engines leave the process alone; serve configures it and keeps a
    persistent compile cache unless told not to."""
    from jaxpaged.worker.compile_counter import default_compile_cache_dir

    library = EngineArgs()
    assert (library.configure_process, library.compile_cache_dir) == (False, None)
    served = EngineArgs.from_cli_args(build_parser().parse_args([]))
    assert served == EngineArgs(
        configure_process=True, compile_cache_dir=default_compile_cache_dir()
    )
    off = ["--no-configure-process", "--compile-cache-dir", ""]
    assert EngineArgs.from_cli_args(build_parser().parse_args(off)) == EngineArgs()


def test_cli_defaults_must_name_fields():
    with pytest.raises(ValueError, match="'configure_proces'.*'configure_process'"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), defaults={"configure_proces": True})


def test_compile_cache_dir_may_be_a_path():
    args = EngineArgs(compile_cache_dir=pathlib.Path("/tmp/xla-cache"))
    assert args.process_config().compile_cache_dir == "/tmp/xla-cache"
    programs = EngineArgs(program_cache_dir=pathlib.Path("/tmp/programs"))
    assert programs.process_config().program_cache_dir == "/tmp/programs"
    assert EngineArgs().process_config().huge_pages
    assert not EngineArgs(huge_pages=False).process_config().huge_pages
    with pytest.raises(ValueError, match="huge_pages must be a bool"):
        EngineArgs(huge_pages="no").process_config()


@pytest.fixture
def captured(monkeypatch):
    """The EngineArgs each construction reaches from_engine_args with (no engine is built)."""
    seen: list[tuple[EngineArgs, dict]] = []

    def fake(cls, args, **in_memory):
        seen.append((args, in_memory))
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(fake))
    # LLM(data_parallel_size=N > 1) builds the replicas' engine instead
    from jaxpaged.engine import dp_offline

    monkeypatch.setattr(dp_offline, "DataParallelEngine", lambda args: fake(None, args))
    return seen


def test_llm_keywords_are_the_engine_args(captured):
    model = NON_DEFAULT["model"]
    LLM(model, **{k: v for k, v in NON_DEFAULT.items() if k != "model"})
    LLM(**NON_DEFAULT)
    LLMEngine.from_args(**NON_DEFAULT)
    assert [args for args, _ in captured] == [EngineArgs(**NON_DEFAULT)] * 3


def test_generate_keywords_are_the_engine_args(captured, monkeypatch):
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: [])
    jaxpaged.generate(["hi"], use_tqdm=True, max_num_seqs=8)
    assert captured[-1][0] == EngineArgs(max_num_seqs=8, show_progress=True)
    cfg = tiny_config()
    params = random_params(cfg)
    jaxpaged.generate(["hi"], params=params, config=cfg, max_num_seqs=8)
    args, in_memory = captured[-1]
    assert args == EngineArgs(max_num_seqs=8, max_model_len=2048, show_progress=False)
    assert in_memory["params"] is params and in_memory["model_config"] is cfg


@pytest.mark.parametrize(
    "build",
    [
        lambda kw: LLM(**kw),
        lambda kw: LLMEngine.from_args(**kw),
        lambda kw: LLMEngine.from_params(tiny_config(), {}, **kw),
        lambda kw: jaxpaged.generate(["hi"], **kw),
        lambda kw: jaxpaged.generate(["hi"], params={}, config=tiny_config(), **kw),
    ],
)
def test_unknown_keyword_is_a_value_error_with_close_matches(build):
    with pytest.raises(ValueError, match=r"'max_num_seq'.*'max_num_seqs'"):
        build({"max_num_seq": 8})
    with pytest.raises(
        ValueError, match=r"'colour'.*engine arguments are: model, revision, download_dir, dtype"
    ):
        build({"colour": "blue"})


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_num_seqs", 0),
        ("max_num_seqs", "8"),
        ("max_model_len", 1),
        ("max_num_batched_tokens", -1),
        ("block_size", 0),
        ("gpu_memory_utilization", 1.5),
        ("swap_space", -1.0),
        ("kv_cache_memory", "lots"),
        ("kv_cache_memory", "0GiB"),
        ("swap_space", "16 parsecs"),
        ("num_kv_blocks", 0),
        ("preemption_mode", "pause"),
        ("scheduling_policy", "lottery"),
        ("enable_prefix_caching", "yes"),
        ("tensor_parallel_size", 0),
        ("data_parallel_size", 0),
        ("data_parallel_health_check_period", 0),
        ("data_parallel_max_restarts", -1),
        ("configure_process", "yes"),
        ("compile_cache_dir", ""),
        ("kv_offloading_size", -1),
        ("kv_offloading_size", "lots"),
        ("kv_offloading_backend", "lmcache"),
        ("kv_offloading_disk_size", "lots"),
    ],
)
def test_bad_value_is_a_value_error_naming_the_field(field, value):
    """Raised while building the configs, before any engine (or weight) exists."""
    with pytest.raises(ValueError, match=field):
        LLMEngine.from_params(tiny_config(), random_params(tiny_config()), **{field: value})


def test_settings_the_model_does_not_decide_fail_before_loading(monkeypatch):
    from jaxpaged.engine import llm_engine

    monkeypatch.setattr(llm_engine, "load_model", lambda *a: pytest.fail("loaded"))
    for bad in (
        {"gpu_memory_utilization": 0},
        {"block_size": 0},
        {"tensor_parallel_size": 0},
        {"data_parallel_size": 0},
        {"compile_cache_dir": 7},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLM(**bad)


def test_derived_defaults():
    cfg = tiny_config(max_position_embeddings=4096)
    sched = EngineArgs().scheduler_config(cfg)
    assert sched.max_model_len == 4096 and sched.max_num_batched_tokens == 512
    assert EngineArgs(max_num_seqs=1024).scheduler_config(cfg).max_num_batched_tokens == 1024
    assert EngineArgs(max_num_seqs=4096).scheduler_config(cfg).max_num_batched_tokens == 2048
    explicit = EngineArgs(max_model_len=300, max_num_batched_tokens=64).scheduler_config(cfg)
    assert (explicit.max_model_len, explicit.max_num_batched_tokens) == (300, 64)
    assert EngineArgs(dtype="auto").load_dtype is None
    assert EngineArgs(dtype="float16").load_dtype == "float16"


def test_in_memory_params_conflicts():
    cfg = tiny_config()
    params = random_params(cfg)  # float32
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        LLMEngine.from_params(cfg, params, dtype="bfloat16")
    with pytest.raises(ValueError, match="model"):
        LLMEngine.from_params(cfg, params, model="m.gguf")
    with pytest.raises(ValueError, match="model_config"):
        LLMEngine.from_engine_args(EngineArgs(), params=params)
    with pytest.raises(ValueError, match="come with params"):
        LLMEngine.from_engine_args(EngineArgs(), model_config=cfg)


def test_engine_from_params_uses_the_args():
    """One real engine over a tiny random model (no warm-up): the configs are EngineArgs'."""
    import jax

    cfg = tiny_config(max_position_embeddings=256)
    engine = LLMEngine.from_params(
        cfg,
        jax.tree.map(jax.numpy.asarray, random_params(cfg)),
        dtype="float32",
        max_num_seqs=4,
        num_kv_blocks=32,
        block_size=8,
        enable_prefix_caching=False,
        enforce_eager=True,
        show_progress=False,
    )
    try:
        assert engine.scheduler_config.max_model_len == 256
        assert engine.scheduler_config.max_num_batched_tokens == 512
        assert engine.scheduler_config.max_num_seqs == 4
        assert engine.cache_config.block_size == 8
        assert engine.cache_config.enable_prefix_caching is False
        assert engine.layout.num_blocks == 32
    finally:
        engine.close()
