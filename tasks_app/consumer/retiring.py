"""Ids a consumer left after losing its lease on some of its queues only, kept where its runs go on.

On Redis Cluster a consumer can lose its lease entry on one queue (a failover lost the write, its
node was cut off for a lease) while it still holds the others. It then takes a new id on every
queue, but what it started under the old id on the other queues still runs: there the old id's
lease is renewed (each lease/3, like the heartbeat) until none of its tasks is held any more, then
deregistered (what it had claimed but not started goes back to pending, uncounted). So no reaper
recovers and re-runs those runs while they go on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence, Sized

from redis.exceptions import RedisError

from tasks_app.consumer.loops import misconfiguration, raise_key_errors
from tasks_app.consumer.retrying import redis_away
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker

logger = logging.getLogger(__name__)


class RetiringIds:
    """Renews a lost id's leases on the queues where it still holds tasks, and deregisters it once it holds none."""

    name = "retiring"

    def __init__(self, broker: Broker, lease_s: float, held: Callable[[str, str], Sized], instance: str = "") -> None:
        self.broker = broker
        self.lease_s = lease_s
        self.instance = instance  # the consumer's renewal token (see heartbeat.lua)
        self.held = held  # (queue, consumer id) -> the tasks this consumer holds, claimed under it there
        self._queues: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._problems: ProblemLog[str] = ProblemLog(logger)

    def retire(self, consumer_id: str, queues: Sequence[str]) -> None:
        """Keep `consumer_id`'s lease on `queues` (where it was not lost) until its tasks there are settled."""
        if queues:
            with self._lock:
                self._queues[consumer_id] = list(queues)

    def run_once(self) -> float:
        try:
            self.renew()
        except RedisError as exc:  # retried at twice the renewal pace, as the heartbeat is
            if misconfiguration(exc):
                raise
            return redis_away(self._problems, self.name, exc, self.lease_s / 6)
        self._problems.recovered(self.name, "%s: works again", self.name)
        return self.lease_s / 3

    def renew(self, *, leaving: bool = False) -> None:
        """Deregister each retiring id where it holds nothing (everywhere, if `leaving`); renew it elsewhere."""
        with self._lock:
            retiring = {consumer_id: list(queues) for consumer_id, queues in self._queues.items()}
        for consumer_id, queues in retiring.items():
            held = [queue for queue in queues if not leaving and len(self.held(queue, consumer_id))]
            left = [queue for queue in queues if queue not in held]
            for queue in left:
                self.broker.deregister(queue, consumer_id, self.instance)
            lease_ms = int(self.lease_s * 1000)
            lost, errors = self.broker.renew_leases(held, consumer_id, lease_ms, self.instance) if held else ([], {})
            if lost:
                logger.error("retiring id %s lost its lease on %s too: its runs there may run again", consumer_id, lost)
            with self._lock:
                self._queues[consumer_id] = [queue for queue in queues if queue not in left and queue not in lost]
                if not self._queues[consumer_id]:
                    del self._queues[consumer_id]
            raise_key_errors(errors, f"renewing retiring id {consumer_id}")
