"""Concurrency caps (`max_running`): a capped type's task runs only while it holds one of the type's slots.

A slot is held under this consumer's lease: taken with the lease's length, renewed by every
heartbeat, released when the run ends. A consumer that dies stops renewing, so its slots lapse
with its lease and the next script on that slot set evicts them. A task that finds no free slot
is deferred into delayed (no attempt used) and queued as a waiter; each freed slot is handed to
the oldest waiter, whose task is moved to pending at once. The deferral's due time (about
TASKS_THROTTLE_RECHECK_S) is only the fallback for a wake that was lost. docs/PROTOCOL.md
("Concurrency caps") has the scripts.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections import defaultdict
from collections.abc import Sequence

from redis.exceptions import RedisError

from tasks_app import metrics
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.retrying import GaveUp, until_done
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task
from tasks_app.protocol.keys import limit_key_token
from tasks_app.protocol.slots import SlotSet, Waiter
from tasks_app.task_types import TaskTypeConfig

logger = logging.getLogger(__name__)

# Idle slot sets and waiter lists expire after this long (at least), counted from their last write.
MIN_IDLE_KEEP_MS = 60_000


def key_token_of(kwarg: str, arguments: Arguments) -> str | None:
    """The key value token of a keyed limit (None when the limit is not keyed)."""
    return limit_key_token(arguments.kwargs, kwarg) if kwarg else None


class ConcurrencyGate:
    """Takes, renews and gives back the slots of this consumer's runs of capped types."""

    def __init__(
        self, broker: Broker, renew_broker: Broker, lease_s: float, recheck_s: float, give_up: threading.Event
    ) -> None:
        self.broker = broker
        # The heartbeat's own connection: renewals go out right after the lease's, never behind a busy worker.
        self.renew_broker = renew_broker
        self.lease_ms = int(lease_s * 1000)
        self.recheck_s = recheck_s
        self.idle_ms = max(MIN_IDLE_KEEP_MS, 4 * self.lease_ms, int(4000 * recheck_s))
        self.give_up = give_up
        self._held: dict[str, SlotSet] = {}
        self._lock = threading.Lock()
        self._renewal_problem: ProblemLog[str] = ProblemLog(logger)  # Redis away at every heartbeat

    @staticmethod
    def permits_of(config: TaskTypeConfig, arguments: Arguments) -> SlotSet:
        """The set of permits (a slot set, in Redis) a task of a capped type needs one of."""
        return SlotSet(config.name, key_token_of(config.max_running_key, arguments), int(config.max_running or 0))

    def acquire(self, claimed: Claimed, task: Task, slots: SlotSet) -> str | None:
        """Take a slot for `task`; its holder token, or None when none is free."""
        holder = uuid.uuid4().hex
        waiter = Waiter.of(claimed.queue, task.priority, claimed.raw)
        taken, woken = until_done(
            lambda: self.broker.acquire_slot(slots, holder, waiter, self.lease_ms, self.idle_ms),
            what="acquire_slot",
            give_up=self.give_up,
        )
        metrics.CONCURRENCY_DECISIONS.labels(task.type, "allowed" if taken else "denied").inc()
        self._wake(woken)
        if taken:
            # Renewed from now on, not before: just after a Redis restart a renewal puts back the
            # holders it is sent, and must not create one whose slot was refused. A renewal that
            # misses it meanwhile is harmless: the slot is good for a lease from its taking.
            with self._lock:
                self._held[holder] = slots
        return holder if taken else None

    def wait(self, claimed: Claimed, task: Task, slots: SlotSet) -> None:
        """Queue a deferred task for the next free slot of `slots` (wakes it at once if one is free)."""
        waiter = Waiter.of(claimed.queue, task.priority, claimed.raw)
        order_ms = task.enqueued_at_ms or 0
        woken = until_done(
            lambda: self.broker.wait_for_slot(slots, waiter, order_ms, self.idle_ms, self.lease_ms),
            what="wait_for_slot",
            give_up=self.give_up,
        )
        self._wake(woken)

    def release(self, holder: str) -> None:
        """Give a run's slot back and wake one waiter per free slot; if Redis is away, the slot lapses."""
        slots = self._forget(holder)
        if slots is None:
            return
        try:
            woken = until_done(
                lambda: self.broker.release_slot(slots, holder, self.idle_ms, self.lease_ms),
                what="release_slot",
                give_up=self.give_up,
            )
        except GaveUp:  # stopping without Redis: no longer renewed, the slot lapses with the lease
            logger.warning(
                "could not release a slot of %s; it frees when this consumer's lease lapses", slots.task_type
            )
            return
        self._wake(woken)

    def renew(self) -> None:
        """Extend every slot held by this consumer's runs (called after each lease renewal)."""
        with self._lock:
            held: dict[tuple[str, str | None], list[str]] = defaultdict(list)
            for holder, slots in self._held.items():
                held[(slots.task_type, slots.key_token)].append(holder)
        try:
            self.renew_broker.renew_slots(held, self.lease_ms, self.idle_ms)
        except RedisError as exc:  # the next heartbeat tries again, well within the lease
            metrics.REDIS_ERRORS.labels("renew_slots").inc()
            message = "could not renew %d concurrency slot(s): %s"
            self._renewal_problem.failed("renew", "redis", message, sum(map(len, held.values())), exc)
            return
        self._renewal_problem.recovered("renew", "concurrency slots renewed again")

    def recheck_ms(self) -> int:
        """The fallback delay of a task waiting for a slot, spread so waiters do not all return at once."""
        return int(self.recheck_s * 1000 * random.uniform(0.5, 1.0))

    def _forget(self, holder: str) -> SlotSet | None:
        with self._lock:
            return self._held.pop(holder, None)

    def _wake(self, woken: Sequence[Waiter]) -> None:
        for waiter in woken:
            try:
                self.broker.wake(waiter)
            except RedisError as exc:  # the waiter's fallback due time brings it back anyway
                logger.warning("could not wake a task waiting for a slot on queue %s: %s", waiter.queue, exc)
