"""The `jaxpaged` command as a vLLM user types it: subcommands, `--model` beside the positional
MODEL, sizes with units, several served model names, `--config FILE.yaml`; a server started
that way answers the real `openai` client under each of its names."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from jaxpaged.args import EngineArgs
from jaxpaged.cli import bench as bench_cli
from jaxpaged.cli.config_file import parse_args_with_config
from jaxpaged.cli.main import COMMANDS, main
from jaxpaged.cli.serve import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("jaxpaged")  # the console script of this venv


def _parse(*words: str):
    return parse_args_with_config(build_parser(), list(words))


def test_console_script_lists_and_dispatches_commands():
    out = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for name in ("serve", "generate", "chat", "convert", "run-batch", "bench", "client"):
        assert re.search(rf"^  {name}\s", out.stdout, re.M), out.stdout
    assert set(COMMANDS) == {"serve", "generate", "chat", "convert", "run-batch", "bench", "client"}
    bad = subprocess.run([str(SCRIPT), "srve"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command 'srve'" in bad.stderr
    helped = subprocess.run(
        [str(SCRIPT), "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0
    assert helped.stdout.startswith("usage: jaxpaged serve")
    for flag in ("--config", "--swap-space", "--served-model-name", "--uvicorn-log-level"):
        assert flag in helped.stdout
    module = subprocess.run(
        [sys.executable, "-m", "jaxpaged", "--help"], capture_output=True, text=True, timeout=60
    )
    assert module.returncode == 0 and module.stdout == out.stdout


def test_model_positional_or_flag():
    assert _parse("org/m").model == "org/m"
    assert _parse("--model", "org/m").model == "org/m"
    assert _parse("--model", "org/m", "--port", "9").model == "org/m"
    assert _parse("org/m", "--model", "org/m").model == "org/m"
    assert _parse().model is None
    with pytest.raises(SystemExit):
        _parse("--model", "org/a", "org/b")


def test_sizes_take_units_on_the_command_line_and_from_python():
    args = EngineArgs.from_cli_args(_parse("--swap-space", "16GiB", "--kv-cache-memory", "2GiB"))
    assert args.swap_space == 16.0 and args.kv_cache_memory == 2 << 30
    assert EngineArgs.from_cli_args(_parse("--swap-space", "512MiB")).swap_space == 0.5
    assert EngineArgs.from_cli_args(_parse("--swap-space", "4")).swap_space == 4.0  # GiB
    assert EngineArgs.from_cli_args(_parse("--swap-space", "0")).swap_space == 0.0
    assert EngineArgs(swap_space="16GiB").swap_space == 16.0
    assert EngineArgs(swap_space="1.5G").swap_space == pytest.approx(1.5e9 / (1 << 30))
    assert EngineArgs(kv_cache_memory="512MiB").kv_cache_memory == 512 << 20
    assert EngineArgs(swap_space=8).cache_config().swap_space_bytes == 8 << 30
    with pytest.raises(ValueError, match="swap_space: not a size: '16 parsecs'"):
        EngineArgs(swap_space="16 parsecs")
    with pytest.raises(SystemExit):
        _parse("--kv-cache-memory", "much")


def test_served_model_names_and_vllm_flags():
    args = _parse("--served-model-name", "qwen", "qwen-small", "--disable-log-requests")
    assert args.served_model_name == ["qwen", "qwen-small"] and args.disable_log_requests
    assert _parse("--uvicorn-log-level", "trace").uvicorn_log_level == "trace"
    assert _parse().uvicorn_log_level is None


def test_config_file_holds_flags_and_the_command_line_wins(tmp_path, capsys):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "model: org/from-config\n"
        "max-model-len: 4096\n"
        "max_num_seqs: 8\n"
        "enable-prefix-caching: false\n"
        "enforce-eager: true\n"
        "swap-space: 16GiB\n"
        "served-model-name: [a, b]\n"
        "port: 8001\n"
    )
    args = _parse("--config", str(cfg), "--port", "9000")
    engine = EngineArgs.from_cli_args(args)
    assert engine.model == "org/from-config" and engine.max_model_len == 4096
    assert engine.max_num_seqs == 8 and engine.swap_space == 16.0
    assert engine.enable_prefix_caching is False and engine.enforce_eager is True
    assert args.served_model_name == ["a", "b"] and args.port == 9000
    assert _parse(f"--config={cfg}", "org/cli").model == "org/cli"
    assert _parse("--model", "org/cli", "--config", str(cfg)).model == "org/cli"
    bad = tmp_path / "bad.yaml"
    for text, message in [
        ("max-modle-len: 5\n", "unknown flag 'max-modle-len'"),
        ("enforce-eager: sometimes\n", "enforce-eager must be true or false"),
        ("- a\n- b\n", "must hold a mapping"),
        ("port: [1, 2]\n", "port takes one value"),
        ("dtype: float64\n", "invalid choice: 'float64'"),
    ]:
        bad.write_text(text)
        with pytest.raises(SystemExit):
            _parse("--config", str(bad))
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--config", str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in capsys.readouterr().err


def test_config_file_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-modle-len: 5\n")
    with pytest.raises(SystemExit):
        _parse("--config", str(bad))
    assert "unknown flag 'max-modle-len'; did you mean" in capsys.readouterr().err


def test_bench_runs_a_benchmark_of_the_checkout(capsys, monkeypatch):
    folder = bench_cli.bench_dir()
    assert folder == ROOT / "bench"
    names = bench_cli.benchmarks(folder)
    assert {"throughput", "serving", "attention_backends"} <= set(names) and "common" not in names
    assert main(["bench"]) == 2
    assert main(["bench", "nope"]) == 2
    assert "no benchmark 'nope'" in capsys.readouterr().err
    assert main(["bench", "throughput", "--help"]) == 0  # the script's own argparse --help
    assert "usage: throughput.py" in capsys.readouterr().out  # runpy sets argv[0]
    monkeypatch.setenv("JAXPAGED_BENCH_DIR", "")
    monkeypatch.setattr(bench_cli, "bench_dir", lambda: None)
    assert main(["bench", "throughput"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_serve_from_a_config_file_answers_every_served_name(tmp_path):
    """`jaxpaged serve --config` with the fake engine: both names work with the openai client,
    /v1/models lists both, and an unknown name is a 400 naming it."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "served-model-name: [smol, smol-alias]\nport: 0\ngrpc-port: 0\n"
        "uvicorn-log-level: warning\ndisable-log-requests: true\n"
    )
    fake_main = ROOT / "tests" / "serving" / "fake_serve_main.py"
    proc = subprocess.Popen(
        [sys.executable, str(fake_main), "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "ready: serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(60), "".join(lines)
        port = next(
            int(m.group(1))
            for line in lines
            if (m := re.search(r"listening: gRPC .*, HTTP [\d.]+:(\d+)", line))
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
        for name in ("smol", "smol-alias"):
            out = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert out.model == "smol" and out.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="'other' does not exist"):
            client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert not any("Uvicorn running" in line for line in lines)  # uvicorn at warning
    finally:
        proc.kill()
        proc.wait(10)
