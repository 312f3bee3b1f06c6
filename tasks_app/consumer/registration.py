"""The queues a consumer holds a lease on under its id.

Registering on a queue recovers what an earlier run under the id left there, then takes the lease.
A queue held by another live process under the same id is joined once that process leaves.

The queues it is registered on are listed in the queue set (what the dashboard finds queues by)
again once a lease: a set deleted lists them again without a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from tasks_app.consumer import identity
from tasks_app.consumer.loops import LeaseClock, ReaperLoop
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker

logger = logging.getLogger(__name__)


class Registration:
    """A consumer's id and the queues it is registered on under it; `run_once` registers it on the others."""

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
        self._held_elsewhere: ProblemLog[str] = ProblemLog(logger)
        self._listed_at = float("-inf")  # when the queues were last added to the queue set (monotonic s)

    def current(self) -> tuple[str, list[str]]:
        """The id registered last, and the queues it is registered on."""
        consumer_id, queues = self._current
        return consumer_id, list(queues)

    def register(self, consumer_id: str) -> list[str]:
        """Register `consumer_id` on every queue (it is the current id now); return those."""
        with self.lock:
            recovered = self._recover(consumer_id, self.queues)
            sent_at = time.monotonic()
            registered = self._take_leases(consumer_id, recovered)
            self._current = (consumer_id, tuple(registered))
            self.lease.renewed(consumer_id, sent_at)
            return registered

    def run_once(self) -> float:
        """Register the current id on the queues it is not registered on yet, where nothing holds it meanwhile."""
        with self.lock:
            consumer_id, registered = self._current
            missing = [queue for queue in self.queues if queue not in registered]
            if consumer_id and missing:
                joined = self._take_leases(consumer_id, self._recover(consumer_id, self._free(consumer_id, missing)))
                if joined:
                    self._current = (consumer_id, tuple(q for q in self.queues if q in registered or q in joined))
            self._list_again()
        return self.lease.lease_s / 3

    def abandon(self, consumer_id: str, queues: Sequence[str]) -> None:
        """Tombstone a lost id on `queues`, so reapers sweep what it held."""
        self.broker.abandon(queues, consumer_id)

    def _recover(self, consumer_id: str, queues: Sequence[str]) -> list[str]:
        """Recover what an earlier run under `consumer_id` left on `queues`; return them."""
        recover = partial(identity.recover_earlier_run, self.reaper, consumer_id=consumer_id)
        for queue in queues:
            recover(queue)
        return list(queues)

    def _take_leases(self, consumer_id: str, queues: Sequence[str]) -> list[str]:
        """Register `consumer_id`'s lease on `queues`; return them."""
        if not queues:
            return []
        lease_ms = int(self.lease.lease_s * 1000)
        self.broker.register_leases(queues, consumer_id, lease_ms, self.info())
        self._listed_at = time.monotonic()
        return list(queues)

    def _list_again(self) -> None:
        """List the registered queues in the queue set again, once a lease."""
        registered = self._current[1]
        if registered and time.monotonic() - self._listed_at >= self.lease.lease_s:
            self.broker.list_queues(registered)
            self._listed_at = time.monotonic()

    def _free(self, consumer_id: str, queues: Sequence[str]) -> list[str]:
        """Those of `queues` where no other live process holds `consumer_id` ."""
        held = {holder.queue: holder for holder in identity.live_holders(self.broker, queues, consumer_id)}
        for queue in queues:
            if queue in held:
                message = "consumer id %s is held by a live process (pid %s) on queue %s: joining it once that leaves"
                self._held_elsewhere.failed(
                    queue, "held", message, consumer_id, held[queue].info.get("pid", "?"), queue
                )
            else:
                self._held_elsewhere.recovered(queue, "consumer id %s on queue %s is free", consumer_id, queue)
        return [queue for queue in queues if queue not in held]
