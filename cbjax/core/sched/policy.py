"""Scheduling policies (vLLM's `scheduling_policy`): who is admitted next, who is preempted first.

- "fcfs": arrival order. A preempted request (or one released once the prompt it waited for is
  computed) goes back first in line; the most recently admitted running request is preempted first.
- "priority": lower `Request.priority` first, ties by arrival time (vLLM's rule). A preempted
  request goes back to its place by that key; the running request with the largest priority value
  (the latest arrival among equals) is preempted first, as vLLM V1 does.

A policy is the scheduler's waiting queue, and it places each admitted request in the scheduler's
running list (`admit`), which it keeps in preemption order: the last is preempted first. The
scheduler serves running requests in that list's order, so a request it already scheduled in a
step always sits before the one that needs a block, and is never the victim.
"""

import bisect
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from cbjax.core.request import Request


class RequestQueue(ABC):
    """The waiting requests, in the order the policy admits them."""

    name: str  # the scheduling_policy that picks it

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def requeue(self, request: Request) -> None:
        """Queue a preempted request, or one released from waiting for another's prompt."""

    @abstractmethod
    def peek(self) -> Request:
        """The request admitted next (the queue is not empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Take the request admitted next (the one peek gives)."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take `request` out wherever it is (an abort)."""

    @abstractmethod
    def admit(self, running: list[Request], request: Request) -> None:
        """Put `request`, just popped, into `running`, which is kept in preemption order (the last goes first)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the order they would be admitted."""

    def __bool__(self) -> bool:
        return len(self) > 0

    @classmethod  # a rule of the policy, asked before any queue exists (core/request_checks.py)
    def check_priority(cls, priority: int) -> None:
        """Refuse a priority this policy would ignore (vLLM's rule: only the priority policy takes one)."""
        if priority != 0:
            raise ValueError(
                f"priority={priority} is only allowed with scheduling_policy='priority'; this engine's is "
                f"{cls.name!r}; start it with scheduling_policy='priority' (--scheduling-policy priority) "
                "or leave priority at 0"
            )


class FcfsQueue(RequestQueue):
    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def admit(self, running: list[Request], request: Request) -> None:
        running.append(request)  # admission order: the newest is preempted first

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then earlier arrival."""
    return request.priority, request.arrival_time


class PriorityQueue(RequestQueue):
    name = "priority"

    def __init__(self) -> None:
        # (priority, arrival_time, tiebreak, request): a heap of tuples never compares two Requests.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()  # equal keys: the one queued first goes first

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    def requeue(self, request: Request) -> None:
        self.add(request)  # back to its place by priority and arrival: no line to jump

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def admit(self, running: list[Request], request: Request) -> None:
        # After its equals: among requests of one key, the latest admitted is preempted first.
        bisect.insort_right(running, request, key=priority_key)

    @classmethod
    def check_priority(cls, priority: int) -> None:
        pass  # every int orders requests here

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


SCHEDULING_POLICIES: dict[str, type[RequestQueue]] = {queue.name: queue for queue in (FcfsQueue, PriorityQueue)}


def check_scheduling_policy(scheduling_policy: str) -> None:
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"scheduling_policy={scheduling_policy!r} is not one of {sorted(SCHEDULING_POLICIES)}; "
            "pick 'fcfs' (arrival order) or 'priority' (lower priority value first)"
        )


def make_request_queue(scheduling_policy: str) -> RequestQueue:
    check_scheduling_policy(scheduling_policy)
    return SCHEDULING_POLICIES[scheduling_policy]()
