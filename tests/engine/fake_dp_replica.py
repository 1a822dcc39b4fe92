"""A stand-in for jaxpaged.engine.dp_replica that speaks its pipe protocol with no engine
and no JAX (it starts in a fraction of a second), so the data-parallel client's restarts can
be tested on cheap processes. Run as ``python fake_dp_replica.py FD RANK``. Its environment
says what it does: it appends ``pid start`` and ``pid METHOD`` (each admin call) lines to
the file ``FAKE_DP_LOG`` (``pid add:REQUEST_ID`` for each request it takes, which it never
answers); with ``FAKE_DP_DIE=after_ready`` it exits right after saying it is ready (a replica
that keeps crashing), with ``FAKE_DP_DIE=after_add`` right after taking a request."""

from __future__ import annotations

import io
import os
import pickle
import sys
from multiprocessing.connection import Connection


class _Anything:
    """Whatever jaxpaged object a message carries (a LoRARequest): not needed here."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return _Anything if module.startswith("jaxpaged") else super().find_class(module, name)


def main() -> None:
    fd, _rank = (int(x) for x in sys.argv[1:3])
    conn = Connection(fd)
    conn.recv_bytes()  # the pickled EngineArgs
    log = os.environ["FAKE_DP_LOG"]

    def note(what: str) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {what}\n")

    note("start")
    info = {"model_config": None, "engine_config": {}, "max_model_len": 64, "tokenizer": None,
            "loras": {}, "stats": None}  # fmt: skip
    conn.send([("ready", info)])
    if os.environ.get("FAKE_DP_DIE") == "after_ready":
        sys.exit(4)
    while True:
        try:
            msg = _Unpickler(io.BytesIO(conn.recv_bytes())).load()
        except EOFError:
            return
        if msg[0] == "probe":
            conn.send([("alive",)])
        elif msg[0] == "call":
            _, call_id, method, _args = msg
            note(method)
            conn.send([("reply", call_id, True, 0)])
        elif msg[0] == "add":  # taken (never answered: no outputs from this fake)
            note(f"add:{msg[2]}")
            conn.send([("reply", msg[1], True, None)])
            if os.environ.get("FAKE_DP_DIE") == "after_add":
                sys.exit(5)
        elif msg[0] == "shutdown":
            return


if __name__ == "__main__":
    main()
