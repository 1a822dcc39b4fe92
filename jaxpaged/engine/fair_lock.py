"""FairLock: a reentrant lock that hands itself to waiters in arrival order.

The engine thread runs ``step()`` back to back under the engine lock. With a plain
``threading.RLock`` the thread that just released the lock takes it again before a
waiter wakes, so an ``abort`` or ``add_request`` from a server thread could wait many
steps. Here a waiter takes a ticket, and the holder's next acquire queues behind it:
a caller waits for at most the step that is running.
"""

from __future__ import annotations

import threading


class FairLock:
    """Reentrant FIFO lock (ticket lock on a condition variable)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()
            self._owner = me
            self._depth = 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._serving += 1
                self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
