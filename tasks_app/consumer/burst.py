"""Burst mode: whether a consumer started with `--burst` has nothing left it may claim, so it exits.

A paused queue counts as idle: its pending and delayed tasks wait for a resume that a burst run
cannot wait for (as RQ's burst workers leave when suspended). Tasks in flight anywhere still keep
it running, and so do the pending and delayed tasks of every queue that is not paused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker

logger = logging.getLogger(__name__)


def nothing_to_claim(broker: Broker, queues: Sequence[str]) -> bool:
    """True once no queue has tasks in flight and only paused ones have tasks waiting (logged)."""
    stats = [broker.queue_stats(queue) for queue in queues]
    if any(queue.processing or (not queue.paused and (queue.pending or queue.delayed)) for queue in stats):
        return False
    for queue in stats:
        if queue.pending or queue.delayed:
            logger.warning(
                "burst: queue %s is paused with %d task(s) pending and %d delayed; leaving them for a resume",
                queue.queue,
                queue.pending,
                queue.delayed,
            )
    return True


class IdleCheck:
    """`nothing_to_claim` as a burst consumer asks it at every tick: False while Redis is away, which is said once."""

    def __init__(self, broker: Broker, queues: Sequence[str]) -> None:
        self.broker = broker
        self.queues = list(queues)
        self._problem: ProblemLog[str] = ProblemLog(logger)

    def __call__(self) -> bool:
        """True once the queues are idle (see `nothing_to_claim`); False if they cannot be checked."""
        try:
            idle = nothing_to_claim(self.broker, self.queues)
        except Exception as exc:
            self._problem.failed("check", repr(exc), "burst: cannot check the queues: %s", exc)
            return False
        self._problem.recovered("check", "burst: the queues can be checked again")
        return idle
