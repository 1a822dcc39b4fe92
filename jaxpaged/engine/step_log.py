"""Per-step timing and composition, for finding what the slow steps of a served load are.

Off unless ``$JAXPAGED_STEP_LOG`` names a file: then every engine step appends one JSON line
with its wall time and the plan it finished (the one ``runner.collect`` waited for, since
steps overlap): ``{"t": start (s, time.time), "ms": duration, "decodes": sequences fed one
token, "prefill": tokens of longer chunks, "seqs": sequences, "gc_ms": time the Python
garbage collector ran inside the step}``. The tail of a latency distribution is a handful of
steps; this names their shape (a prefill chunk, a larger padded bucket) or a host pause.
Per request, for splitting a time to first token into the wait before its first chunk and
the steps after: ``"waits"`` maps the requests whose first chunk this step dispatched to
the seconds since they arrived, ``"first_tokens"`` lists the requests whose prompt's last
chunk the finished plan carried (the host has their first token at the step's end).
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Mapping
from typing import IO, Any

from jaxpaged.sched.output import SchedulerOutput

__all__ = ["StepLog", "first_tokens", "step_composition"]

ENV_VAR = "JAXPAGED_STEP_LOG"


def step_composition(plan: SchedulerOutput) -> dict[str, int]:
    """Decode rows, prefill tokens and sequences of one planned step."""
    decodes = sum(1 for s in plan.seqs if s.num_tokens == 1)
    prefill = sum(s.num_tokens for s in plan.seqs if s.num_tokens > 1)
    return {"decodes": decodes, "prefill": prefill, "seqs": len(plan.seqs)}


def first_tokens(plan: SchedulerOutput) -> list[str]:
    """Requests whose prompt's last chunk (more than one token, sampling) the plan carries."""
    return [s.request_id for s in plan.seqs if s.num_tokens > 1 and s.do_sample]


class StepLog:
    """Appends one JSON line per step to a file; times the garbage collector meanwhile."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._gc_start = 0.0
        self._gc_s = 0.0
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(ENV_VAR)
        return cls(path) if path else None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_start

    def record(
        self,
        start: float,
        seconds: float,
        finished: SchedulerOutput | None,
        arrivals: Mapping[str, float] | None = None,
    ) -> None:
        """One step that began at ``start`` (time.time) and took ``seconds``; ``finished``:
        the plan whose output it collected (None on the first step or an idle one);
        ``arrivals``: arrival time (time.time) of each request whose first chunk the step
        dispatched."""
        line: dict[str, Any] = {"t": round(start, 4), "ms": round(seconds * 1e3, 2)}
        line.update(step_composition(finished) if finished is not None else {"seqs": 0})
        if arrivals:
            line["waits"] = {rid: round(start - t, 4) for rid, t in arrivals.items()}
        firsts = first_tokens(finished) if finished is not None else []
        if firsts:
            line["first_tokens"] = firsts
        line["gc_ms"] = round(self._gc_s * 1e3, 2)
        self._gc_s = 0.0
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._file.close()
