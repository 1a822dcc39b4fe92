"""bench/embed.py end to end on a tiny random sentence-transformers folder, so it cannot
rot: both systems' rows of the table, their embeddings agreeing."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from encoders import save_encoder, save_sentence_transformers_files

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_embed_bench_prints_both_systems(tmp_path, capsys):
    folder = str(tmp_path)
    save_encoder(folder, "BertModel")
    save_sentence_transformers_files(folder, "mean", normalize=True, max_seq_length=64, dim=32)
    sys.path.insert(0, str(BENCH))
    try:
        bench = importlib.import_module("embed")
    finally:
        sys.path.remove(str(BENCH))
    bench.main(["--model", folder, "--batches", "1", "2", "--num-sentences", "8",
                "--rounds", "1", "--max-model-len", "64"])  # fmt: skip
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| (\d+) \| [\d.]+ \| [\d.]+ \| \*\*[\d.]+x\*\* \| ([\d.]+) \|$",
                      out, re.M)  # fmt: skip
    assert [r[:2] for r in rows] == [("1", "8"), ("2", "8")], out
    assert all(float(r[2]) > 0.9999 for r in rows)  # made-up words: [UNK] for both systems
    assert "compilations after warm-up: 0" in out
