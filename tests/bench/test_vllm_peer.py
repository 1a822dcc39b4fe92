"""vLLM as a benchmark peer (bench/vllm_peer.py): the greedy-token comparison against
hand-computed answers, the clean refusal of a missing or vLLM-less environment, and (only
where ``JAXPAGED_VLLM_PYTHON`` names a vLLM environment; CI installs none) a real
side-by-side run."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_env import script_env

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
VLLM_PYTHON = os.environ.get("JAXPAGED_VLLM_PYTHON")


@pytest.fixture(scope="module")
def peer():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import vllm_peer

    return vllm_peer


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=script_env())  # fmt: skip


def test_compare_greedy_first_divergence(peer):
    a = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [1, 1, 1]]
    b = [[1, 2, 3, 4], [5, 0, 7], [8, 9, 10], [2, 1, 1]]
    cmp = peer.compare_greedy(a, b)
    assert cmp["first_divergence"] == [None, 1, 2, 0]
    assert cmp["identical"] == 1 and cmp["requests"] == 4
    assert cmp["earliest_divergence"] == 0
    assert cmp["tokens_before_divergence"] == 4 + 1 + 2 + 0
    assert cmp["tokens"] == 4 + 3 + 3 + 3
    line = peer.describe_agreement(cmp, ("x", "y"))
    assert "1 of 4 requests identical" in line and "first divergences at tokens 0, 1, 2" in line
    same = peer.compare_greedy(a, a)
    assert same["identical"] == 4 and same["earliest_divergence"] is None
    with pytest.raises(ValueError, match="different numbers of requests"):
        peer.compare_greedy(a, b[:2])


def test_check_vllm_python_refuses_bad_paths(peer, tmp_path):
    with pytest.raises(ValueError, match="not an executable file"):
        peer.check_vllm_python(str(tmp_path / "missing" / "python"))
    # this environment's own Python has no vLLM (it is never a dependency)
    with pytest.raises(ValueError, match="cannot import vllm"):
        peer.check_vllm_python(sys.executable)


def _main(script: str):
    """bench/SCRIPT.py's main(), run in-process: the exit status the script gives
    (`raise SystemExit(main())`), without a Python start per refusal."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(script).main


@pytest.mark.parametrize("script", ["throughput", "serving"])
def test_benchmarks_refuse_a_missing_vllm_env(script, tmp_path, capsys):
    extra = ["--launch"] if script == "serving" else []
    assert _main(script)([*extra, "--vllm-python", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--vllm-python" in err and "not an executable file" in err


def test_benchmark_flag_combinations_refused(capsys):
    assert _main("throughput")(["--systems", "vllm"]) == 2
    assert "--systems vllm needs --vllm-python" in capsys.readouterr().err
    assert _main("serving")(["--vllm-python", sys.executable]) == 2
    assert "--vllm-python needs --launch" in capsys.readouterr().err
    assert _main("serving")(["--vllm-client"]) == 2
    assert "--vllm-client needs --vllm-python" in capsys.readouterr().err


@pytest.mark.skipif(not VLLM_PYTHON, reason="JAXPAGED_VLLM_PYTHON names no vLLM environment")
def test_throughput_side_by_side_with_vllm(tmp_path):
    """The bundled model through jaxpaged and vLLM in float32: both produce every requested
    token, and greedy decoding of the same weights agrees on most tokens."""
    out = tmp_path / "t.json"
    proc = _bench("bench/throughput.py", "--systems", "jaxpaged", "--vllm-python", VLLM_PYTHON,
                  "--num-prompts", "4", "--max-output", "24", "--max-model-len", "512",
                  "--max-num-seqs", "4", "--decode-batch", "0", "--json-out", str(out),
                  timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"jaxpaged", "vllm"}
    assert report["ratio_vs_vllm"] > 0
    cmp = report["greedy_vs_vllm"]
    assert cmp["tokens_before_divergence"] >= cmp["tokens"] // 2, cmp
