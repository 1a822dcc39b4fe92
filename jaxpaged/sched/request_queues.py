"""The scheduler's three queues (waiting, running, swapped), each kept in scheduling order:
arrival order, or under the priority policy the lower ``SamplingParams.priority`` value first,
then arrival. Preemption takes from the end of ``running``."""

from __future__ import annotations

import bisect
import collections

from jaxpaged.sched.request import Request, RequestStatus

__all__ = ["RequestQueues"]


class RequestQueues:
    """``by_priority``: the priority policy's order (else first come first served)."""

    def __init__(self, *, by_priority: bool) -> None:
        self.by_priority = by_priority
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []

    def order(self, req: Request) -> tuple[int, int]:
        """Who goes first: the earlier arrival, or under the priority policy the lower
        priority value, then the earlier arrival. Preemption takes the last."""
        return (req.sampling_params.priority if self.by_priority else 0, req.arrival_order)

    def add_waiting(self, req: Request) -> None:
        """A new request joins ``waiting``: at the end (fcfs), or in priority order."""
        if not self.by_priority:
            self.waiting.append(req)
            return
        self._insert_ordered(self.waiting, req)

    def set_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self._insert_ordered(self.running, req)

    def set_swapped(self, req: Request) -> None:
        req.status = RequestStatus.SWAPPED
        self._insert_ordered(self.swapped, req)

    def requeue(self, req: Request) -> None:
        """A request preempted by recompute goes back to ``waiting`` ahead of later arrivals
        (of its priority, under the priority policy)."""
        req.status = RequestStatus.WAITING
        if self.by_priority:
            at = bisect.bisect_left(self.waiting, self.order(req), key=self.order)
            self.waiting.insert(at, req)
        else:
            self.waiting.appendleft(req)

    def _insert_ordered(
        self, queue: list[Request] | collections.deque[Request], req: Request
    ) -> None:
        """Inserts ``req`` into ``queue`` (sorted by :meth:`order`) after its equals."""
        queue.insert(bisect.bisect(queue, self.order(req), key=self.order), req)
