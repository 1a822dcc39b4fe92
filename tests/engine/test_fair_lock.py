"""FairLock: a thread that re-takes the lock in a loop (the engine stepping) cannot starve
a waiter (an abort from a server thread)."""

import threading
import time

import pytest

from jaxpaged.engine.fair_lock import FairLock


def _holds_taken_while_waiting(lock, hold_s: float = 0.005) -> int:
    """A looping holder like the engine thread; returns how many holds began while the
    main thread waited for the lock."""
    holds = [0]
    stop = threading.Event()
    started = threading.Event()

    def holder():
        while not stop.is_set():
            with lock:
                holds[0] += 1
                started.set()
                time.sleep(hold_s)  # a step: releases the GIL, keeps the lock

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    started.wait(5)
    time.sleep(0.02)
    before = holds[0]
    with lock:
        during = holds[0] - before
    stop.set()
    t.join(5)
    return during


@pytest.mark.parametrize("trial", range(5))
def test_waiter_gets_the_lock_after_the_running_hold(trial):
    # the hold running when we asked, plus at most one that began in the same instant
    assert _holds_taken_while_waiting(FairLock()) <= 1


def test_reentrant_and_exclusive():
    lock = FairLock()
    got = threading.Event()

    def other():
        with lock:
            got.set()

    with lock:
        with lock:
            t = threading.Thread(target=other)
            t.start()
            assert not got.wait(0.05)
        assert not got.wait(0.05)  # still held once
    assert got.wait(5)
    t.join(5)


def test_release_by_a_non_owner_raises():
    lock = FairLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
