"""Which queues a producer added to the queue set lately, so it adds each once a while, not once per enqueue."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# How long a producer trusts its last SADD of a queue. The set can be deleted or rewritten behind
# it (an operator, a restore); a queue is then listed again within this time.
ANNOUNCE_AGAIN_S = 60.0


class AnnouncedQueues:
    """The queues added to the queue set within the last `again_s` seconds (by this process's clock)."""

    __slots__ = ("_added_at", "_again_s", "_clock")

    def __init__(self, again_s: float = ANNOUNCE_AGAIN_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._added_at: dict[str, float] = {}
        self._again_s = again_s
        self._clock = clock

    def __contains__(self, queue: object) -> bool:
        added_at = self._added_at.get(queue) if isinstance(queue, str) else None
        return added_at is not None and self._clock() - added_at < self._again_s

    def missing(self, queues: Iterable[str]) -> set[str]:
        """Those of `queues` not added lately: the ones an enqueue adds to the set with its tasks."""
        return {queue for queue in queues if queue not in self}

    def add(self, queues: Iterable[str]) -> None:
        """Remember `queues` as added to the set now."""
        now = self._clock()
        for queue in queues:
            self._added_at[queue] = now
