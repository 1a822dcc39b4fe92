"""`jaxpaged run-batch` on the fake engine: OpenAI's batch format in and out, per-line errors
written without stopping the batch, and a stopped batch resumed without redoing a line."""

from __future__ import annotations

import json

from fakes import FakeAsyncEngine, expected_text

from jaxpaged.cli.run_batch import main

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "hi", "max_tokens": 3}},
    {"custom_id": "resp", "method": "POST", "url": "/v1/responses",
     "body": {"input": "hi", "max_output_tokens": 3}},
    {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}},
    "{not json",
    {"custom_id": "typo", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "hi", "max_tokenz": 3}},
    {"custom_id": "chat", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    {"custom_id": "stream", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "hi", "stream": True}},
    {"custom_id": "long", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "x" * 300}},
]  # fmt: skip


def _run(tmp_path, out_name="out.jsonl") -> tuple[FakeAsyncEngine, list[dict]]:
    src = tmp_path / "in.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in LINES))
    engine = FakeAsyncEngine(max_model_len=128)
    out = tmp_path / out_name
    argv = ["-i", str(src), "-o", str(out), "--no-progress", "--served-model-name", "m"]
    assert main(argv, engine_factory=lambda: engine) == 0
    return engine, [json.loads(line) for line in out.read_text().splitlines()]


def test_run_batch_writes_every_line_and_resumes(tmp_path):
    engine, rows = _run(tmp_path)
    assert len(rows) == len(LINES)
    by_id = {r["custom_id"]: r for r in rows if r["custom_id"] is not None}
    hi = [ord(c) for c in "hi"]
    assert by_id["cmpl"]["response"]["body"]["choices"][0]["text"] == expected_text(hi, 3)
    assert by_id["chat"]["response"]["status_code"] == 200 and by_id["chat"]["error"] is None
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["resp"]["response"]["body"]["object"] == "response"
    for cid, code in [("emb", "invalid_line"), ("stream", "invalid_line")]:
        assert by_id[cid]["error"]["code"] == code and by_id[cid]["response"] is None
    assert "max_tokenz" in by_id["typo"]["error"]["message"]
    assert by_id["typo"]["response"]["status_code"] == 400
    assert by_id["long"]["response"]["status_code"] == 400
    no_id = sorted((r["line"], r["error"]["code"]) for r in rows if r["custom_id"] is None)
    assert no_id == [(5, "invalid_json"), (7, "duplicate_custom_id")]
    assert len(engine.added) == 3  # only the valid requests reached the engine

    # a batch stopped after seven lines (one answered 200), the eighth cut off mid-write
    out = tmp_path / "out.jsonl"
    kept = out.read_text().splitlines(keepends=True)[:7]
    out.write_text("".join(kept) + '{"id": "ba')
    engine2, rows2 = _run(tmp_path)
    assert len(rows2) == len(LINES) and rows2[:7] == [json.loads(x) for x in kept]
    keys = [(r["custom_id"], r.get("line")) for r in rows2]
    assert len(set(keys)) == len(LINES)  # nothing written twice
    redone = {r["custom_id"] for r in rows2[7:]}
    ran_before = {json.loads(x)["custom_id"] for x in kept}
    assert ran_before & {"chat", "cmpl", "resp"}
    assert len(engine2.added) == len({"chat", "cmpl", "resp"} - ran_before)
    assert not redone & ran_before - {None}
