"""The queues a consumer holds a lease on under its id, and their listing in the queue set.

Registering on a queue recovers what an earlier run under the id left there, then takes the lease.
The queues it is registered on are listed in the queue set (what the dashboard finds queues by)
again once a lease, so a set deleted lists them again without a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from tasks_app.consumer import identity
from tasks_app.consumer.loops import LeaseClock, ReaperLoop, raise_key_errors
from tasks_app.protocol.broker import Broker

logger = logging.getLogger(__name__)


class Registration:
    """A consumer's id and the queues it is registered on under it; `run_once` lists them in the queue set again."""

    name = "registering"

    def __init__(
        self,
        broker: Broker,
        queues: Sequence[str],
        reaper: ReaperLoop,
        lease: LeaseClock,
        info: Callable[[], dict[str, Any]],
    ) -> None:
        self.broker = broker
        self.queues = list(queues)
        self.reaper = reaper
        self.lease = lease
        self.info = info  # what the consumer registers beside its lease
        # Held while the id, or the queues registered under it, change (the consumer's moving to a new id too).
        self.lock = threading.RLock()
        self._current: tuple[str, tuple[str, ...]] = ("", ())  # replaced whole: read without the lock
        self._listed_at = float("-inf")  # when the queues were last added to the queue set (monotonic s)

    def current(self) -> tuple[str, list[str]]:
        """The id registered last, and the queues it is registered on."""
        consumer_id, queues = self._current
        return consumer_id, list(queues)

    def register(self, consumer_id: str) -> list[str]:
        """Register `consumer_id` on every queue (it is the current id now); return them.

        A key of ours that Redis refuses here (another type) fails the registration: a misconfiguration.
        """
        with self.lock:
            for queue in self.queues:
                identity.recover_earlier_run(self.reaper, queue, consumer_id)
            sent_at = time.monotonic()
            lease_ms = int(self.lease.lease_s * 1000)
            errors, unlisted = self.broker.register_leases(self.queues, consumer_id, lease_ms, self.info())
            raise_key_errors(errors, "registering")
            self._current = (consumer_id, tuple(self.queues))
            self.lease.renewed(consumer_id, sent_at)
            # Only the dashboard reads the queue set: a refusal there is said by the next pass.
            self._listed_at = float("-inf") if unlisted else time.monotonic()
            return list(self.queues)

    def run_once(self) -> float:
        """List the registered queues in the queue set again, once a lease."""
        registered = self._current[1]
        if registered and time.monotonic() - self._listed_at >= self.lease.lease_s:
            unlisted = self.broker.list_queues(registered)
            if unlisted:
                raise ResponseError(f"listing queues in the queue set: {unlisted}")
            self._listed_at = time.monotonic()
        return self.lease.lease_s / 3

    def abandon(self, consumer_id: str, queues: Sequence[str]) -> None:
        """Tombstone a lost id on `queues`, so reapers sweep what it held."""
        errors = self.broker.abandon(queues, consumer_id)
        if errors:  # the move to a new id goes on: what the old one held is recovered when its lease lapses
            logger.error("could not tombstone lost id %s (misconfigured keys): %s", consumer_id, errors)
