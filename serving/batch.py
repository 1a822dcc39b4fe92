"""OpenAI's batch file format, run in process (``jaxpaged run-batch``): each input line
``{"custom_id", "method": "POST", "url", "body"}`` goes through the HTTP app itself (the same
validation, chat template, tools and output as the server, over an in-process ASGI
transport), and each result is written at once as an output line ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``.

A line that fails (malformed JSON, a URL jaxpaged does not serve, a refused body, a failed
request) becomes an output line with ``error`` set; the batch goes on. Output is appended
in completion order, so a batch that was stopped resumes: the custom_ids (and, for lines
that had none, the line numbers) already in the output file are skipped, and a last line
cut off mid-write is dropped first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TextIO

import httpx

from jaxpaged.serving.frontend import Frontend
from jaxpaged.serving.http_app import create_app

__all__ = ["BATCH_URLS", "BatchCounts", "resume_point", "run_batch"]

# the endpoints a batch line may name (OpenAI's batch API also takes /v1/embeddings, which
# jaxpaged does not serve: such lines are errors)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclasses.dataclass
class BatchCounts:
    completed: int = 0  # lines answered 200
    failed: int = 0  # lines written with an error
    skipped: int = 0  # lines already in the output (resumed)


@dataclasses.dataclass(frozen=True)
class _Done:
    custom_ids: frozenset[str]
    lines: frozenset[int]  # 1-based numbers of input lines that had no usable custom_id


def resume_point(path: str) -> _Done:
    """What an existing output file already holds; a last line without its newline (cut
    off mid-write) is removed from the file."""
    if not os.path.exists(path):
        return _Done(frozenset(), frozenset())
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    ids, lines = set(), set()
    for raw in data[:end].splitlines():
        try:
            row = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: not a batch output file (a line is not JSON)") from None
        if row.get("custom_id") is not None:
            ids.add(row["custom_id"])
        elif isinstance(row.get("line"), int):
            lines.add(row["line"])
    return _Done(frozenset(ids), frozenset(lines))


def _error_line(custom_id: str | None, code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
        **extra,
    }


def _check_line(number: int, raw: str, seen: set[str]) -> tuple[dict[str, Any] | None, dict]:
    """(the request, None) of a valid input line, or (None, its error line)."""
    try:
        line = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, _error_line(None, "invalid_json", f"line {number}: {e}", line=number)
    if not isinstance(line, dict):
        return None, _error_line(None, "invalid_line", f"line {number}: not an object", line=number)
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, _error_line(
            None, "invalid_line", f"line {number}: custom_id must be a string", line=number
        )
    if cid in seen:
        return None, _error_line(
            None, "duplicate_custom_id", f"line {number}: custom_id {cid!r} repeats", line=number
        )
    seen.add(cid)
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    problems = []
    if unknown:
        problems.append(f"unknown fields {unknown}")
    if line.get("method") != "POST":
        problems.append(f"method must be POST, got {line.get('method')!r}")
    if line.get("url") not in BATCH_URLS:
        problems.append(f"url must be one of {list(BATCH_URLS)}, got {line.get('url')!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        problems.append("body must be an object")
    elif body.get("stream"):
        problems.append("stream is not available in a batch")
    if problems:
        return None, _error_line(cid, "invalid_line", f"line {number}: " + "; ".join(problems))
    return line, {}


async def run_batch(
    frontend: Frontend,
    lines: Iterable[str],
    out: TextIO,
    *,
    done: _Done | None = None,
    max_concurrency: int = 64,
    on_line: Callable[[], None] | None = None,
) -> BatchCounts:
    """Runs the batch lines against ``frontend`` (its engine attached and started), at most
    ``max_concurrency`` at a time, appending an output line to ``out`` as each ends;
    ``on_line()`` after each input line is settled (a progress bar)."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    done = done or _Done(frozenset(), frozenset())
    counts = BatchCounts()
    seen: set[str] = set()
    slots = asyncio.Semaphore(max_concurrency)
    tasks: set[asyncio.Task] = set()

    def skip() -> None:
        counts.skipped += 1
        if on_line is not None:
            on_line()

    def write(row: dict[str, Any], ok: bool) -> None:
        out.write(json.dumps(row, separators=(",", ":")) + "\n")
        out.flush()
        if ok:
            counts.completed += 1
        else:
            counts.failed += 1
        if on_line is not None:
            on_line()

    async def one(client: httpx.AsyncClient, line: dict[str, Any]) -> None:
        try:
            r = await client.post(line["url"], json=line["body"])
            body = r.json()
        except Exception as e:  # the batch goes on whatever one request does
            write(_error_line(line["custom_id"], "request_failed", f"{type(e).__name__}: {e}"),
                  ok=False)  # fmt: skip
            return
        finally:
            slots.release()
        rid = f"req_{uuid.uuid4().hex}"
        if r.status_code == 200:
            row = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"],
                   "response": {"status_code": 200, "request_id": rid, "body": body},
                   "error": None}  # fmt: skip
            write(row, ok=True)
            return
        err = body.get("error", {}) if isinstance(body, dict) else {}
        row = _error_line(line["custom_id"], str(err.get("type", r.status_code)),
                          str(err.get("message", body)))  # fmt: skip
        row["response"] = {"status_code": r.status_code, "request_id": rid, "body": body}
        write(row, ok=False)

    transport = httpx.ASGITransport(app=create_app(frontend))
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as c:
        try:
            for number, raw in enumerate(lines, 1):
                if not raw.strip():
                    continue
                if number in done.lines:
                    skip()
                    continue
                line, error = _check_line(number, raw, seen)
                cid = line["custom_id"] if line is not None else error.get("custom_id")
                if cid is not None and cid in done.custom_ids:
                    skip()
                elif line is None:
                    write(error, ok=False)
                else:
                    await slots.acquire()
                    task = asyncio.create_task(one(c, line))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return counts
