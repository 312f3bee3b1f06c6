"""Tasks of a queue paused after they were claimed go back unstarted (claims of it stop in lua/claim.lua).

Such a task's receipt is withdrawn as it goes back, as for a deferred one: a cancel while the queue
stays paused cancels it outright (it reads CANCELLED at once), rather than asking a consumer that
no longer holds it to stop.
"""

from __future__ import annotations

import logging
import threading
import time

from redis.exceptions import RedisError

from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.receipts import withdrawals
from tasks_app.consumer.retrying import until_done
from tasks_app.protocol.broker import Broker

logger = logging.getLogger(__name__)

# How old the pause state of a queue a worker acts on may be.
PAUSE_STATE_MAX_AGE_S = 0.25


class PauseWatch:
    """Whether a claimed task's queue was paused since, read from Redis at most every PAUSE_STATE_MAX_AGE_S."""

    def __init__(
        self, broker: Broker, give_up: threading.Event, result_ttl_s: int, max_age_s: float = PAUSE_STATE_MAX_AGE_S
    ) -> None:
        self.broker = broker
        self.give_up = give_up
        self.result_ttl_s = result_ttl_s
        self.max_age_s = max_age_s
        self._seen: dict[str, tuple[bool, float]] = {}

    def paused(self, queue: str) -> bool:
        """True if `queue` is paused (as of at most max_age_s ago; the last answer while Redis is away)."""
        now = time.monotonic()
        seen = self._seen.get(queue)
        if seen is not None and now - seen[1] < self.max_age_s:
            return seen[0]
        try:
            paused = self.broker.is_paused(queue)
        except RedisError:
            paused = seen[0] if seen is not None else False
        self._seen[queue] = (paused, now)
        return paused

    def return_if_paused(self, claimed: Claimed) -> bool:
        """Put a claimed task of a paused queue back at the head of pending, unstarted; False if it runs."""
        if not self.paused(claimed.queue):
            return False
        self.return_unstarted(claimed)
        logger.info("queue %s is paused: a claimed task went back to pending unstarted", claimed.queue)
        return True

    def return_unstarted(self, claimed: Claimed) -> None:
        """Put a claimed task back at the head of pending, unstarted, its receipt withdrawn."""
        withdrawn = withdrawals([claimed], self.result_ttl_s)
        until_done(
            lambda: self.broker.return_unstarted(claimed.queue, claimed.consumer_id, [claimed.raw], withdrawn),
            what="return_unstarted",
            give_up=self.give_up,
        )
