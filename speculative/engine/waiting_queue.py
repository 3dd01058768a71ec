"""The scheduler's waiting queue, in the order of its scheduling policy (as vLLM's): fcfs serves
requests in arrival order and puts a preempted one back in front; priority serves them by
(priority, arrival), lower first, and a preempted one goes back by the same key."""

import bisect
from collections import deque

from speculative.engine.request import Request


class WaitingQueue(deque):
    def __init__(self, policy: str = "fcfs"):
        super().__init__()
        assert policy in ("fcfs", "priority"), policy
        self.policy = policy

    def add(self, r: Request) -> None:
        """A new request; among equal keys, after those that came before it."""
        if self.policy == "priority":
            at = bisect.bisect_right(self, r.priority_key, key=lambda w: w.priority_key)
            self.insert(at, r)
        else:
            self.append(r)

    def put_back(self, r: Request) -> None:
        """A preempted request, to be recomputed: in front (fcfs), or by its key (priority)."""
        if self.policy == "priority":
            self.add(r)
        else:
            self.appendleft(r)
