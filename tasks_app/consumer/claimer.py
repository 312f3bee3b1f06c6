"""Claiming for a consumer: one claimer thread per queue fills the consumer's bounded room for tasks.

A claimer takes room for a batch claim only; its blocking wait on an empty queue holds none, so a
consumer on more queues than room for tasks still starts a task on any of them as soon as it is pushed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from django.conf import settings
from redis.exceptions import RedisError

from tasks_app.consumer.capacity import Capacity
from tasks_app.consumer.claimed import Claimed
from tasks_app.consumer.held import HeldTasks
from tasks_app.consumer.loops import LeaseClock
from tasks_app.consumer.receipts import with_receipts
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.replies import Claim

logger = logging.getLogger(__name__)

# How soon a claimer waiting on pending looks again for suspects it could not take yet.
SUSPECT_RECHECK_S = 0.1
# How soon a claimer whose lease lapsed tries again (the heartbeat renews it or gives it up).
LEASE_RECHECK_S = 0.1
# How soon a claimer of a paused queue looks again whether it was resumed.
PAUSED_RECHECK_S = 0.25
# How soon a claimer whose consumer never read the task types (the database away) looks again.
SETTINGS_RECHECK_S = 0.25
# How soon a claimer of a queue its consumer is not registered on (yet) looks again.
REGISTERED_RECHECK_S = 0.25


class ClaimerLoop:
    """Claims tasks of one queue while there is room: a batch at once, else one blocking move.

    Every lease (and at once after a claim failed on the wire) it audits its processing list
    against what the consumer holds, returning strays: tasks a claim moved whose reply was lost.
    """

    def __init__(
        self,
        queue: str,
        broker: Broker,
        *,
        room: Capacity,
        held: HeldTasks,
        lease: LeaseClock,
        consumer_id: Callable[[], str],
        registered_on: Callable[[str], bool],
        lease_lost: Callable[[str, list[str]], None],
        types_loaded: Callable[[], bool],
        dispatch: Callable[[Sequence[Claimed]], None],
        block_s: float,
    ) -> None:
        """`consumer_id`: the consumer's current id; `registered_on`: whether it holds a lease on a queue under
        it; `lease_lost`: what to do when a claim finds the lease lapsed; `types_loaded`: whether the task types
        were read once; `dispatch`: hands claimed tasks to the workers."""
        self.queue = queue
        self.broker = broker
        self.room = room
        self.held = held
        self.lease = lease
        self.consumer_id = consumer_id
        self.registered_on = registered_on
        self.lease_lost = lease_lost
        self.types_loaded = types_loaded
        self.dispatch = dispatch
        self.block_s = block_s
        self.name = f"claimer:{queue}"
        self._drop_wake = False
        # Set when a claim failed on the wire: Redis may have moved tasks we never heard of.
        self._uncertain = False
        self._audit_at = time.monotonic() + lease.lease_s
        # Room taken for the claim in progress and not yet handed to a dispatched task.
        self._room_taken = 0
        self._result_ttl_s = int(settings.TASKS_RESULT_TTL)

    def run_once(self) -> float:
        if not self.registered_on(self.queue):
            return REGISTERED_RECHECK_S  # no lease here to claim under: what it claimed could not be recovered
        if self._uncertain or time.monotonic() >= self._audit_at:
            self.reconcile()
        if not self.types_loaded():
            # Its tasks could only be deferred until their settings are known: others may run them.
            # The housekeeping loop reads them again every TASKS_CONFIG_REFRESH_S.
            return SETTINGS_RECHECK_S
        if not self.room.acquire(timeout_s=0.5):
            return 0.0
        self._room_taken = 1 + self.room.acquire_up_to(self.room.limit - 1)
        consumer_id = self.consumer_id()
        try:
            return self._take(self._claim(consumer_id), consumer_id)
        except BaseException as exc:
            self._uncertain = isinstance(exc, RedisError)
            raise
        finally:
            self.room.release(self._room_taken)
            self._room_taken = 0

    def _claim(self, consumer_id: str) -> Claim | None:
        # The consumer's one suspect turn is held for the claim script only, unless it took a
        # suspect: held through a blocking claim, it kept every other queue's suspects waiting.
        may_take_suspect = self.held.take_suspect_turn()
        outcome: Claim | None = None
        try:
            outcome = self.broker.claim_with_suspect(
                self.queue, consumer_id, self._room_taken, drop_wake=self._drop_wake, allow_suspect=may_take_suspect
            )
            self._drop_wake = False
            return outcome
        finally:
            if may_take_suspect and not (outcome is not None and outcome.took_suspect):
                self.held.give_suspect_turn_back()

    def _take(self, outcome: Claim | None, consumer_id: str) -> float:
        # Dispatch what the claim moved; with nothing moved, block on pending for one task.
        # Room not used by a dispatched task is left in self._room_taken for the caller to give back.
        if outcome is None:
            self.lease_lost(consumer_id, [self.queue])
            return 0.0
        if outcome.tasks:
            self._room_taken -= len(outcome.tasks)
            self._dispatch(
                [
                    Claimed(
                        self.queue,
                        consumer_id,
                        raw,
                        suspect=outcome.took_suspect and index == 0,
                        fence=outcome.first_fence + index,
                    )
                    for index, raw in enumerate(outcome.tasks)
                ]
            )
            return 0.0
        if outcome.paused:
            return PAUSED_RECHECK_S
        if outcome.lease_expired or not self.lease.fresh(consumer_id):
            return LEASE_RECHECK_S  # no claim under a lapsed lease: the heartbeat renews it or gives it up
        # A blocking claim holds no room while it waits: with more queues than room for tasks, a claimer
        # holding some kept every other queue's tasks waiting until its wait timed out.
        self.room.release(self._room_taken)
        self._room_taken = 0
        return self._claim_blocking(consumer_id, outcome.suspects_waiting)

    def _claim_blocking(self, consumer_id: str, suspects_waiting: int) -> float:
        """Block on pending for one task; it takes free room, or goes back first in its queue if none is left."""
        # Suspects waiting for this consumer's one suspect turn are claimed soon after it
        # frees; new pending tasks still wake the blocking claim at once.
        block_s = min(self.block_s, SUSPECT_RECHECK_S) if suspects_waiting else self.block_s
        raw, fence = self.broker.claim_blocking(self.queue, consumer_id, block_s)
        self._drop_wake = raw == WAKE_TOKEN
        if raw is None or raw == WAKE_TOKEN:
            return 0.0
        if self.room.acquire_up_to(1):
            self._dispatch([Claimed(self.queue, consumer_id, raw, fence=fence)])
        else:
            # Other queues' claims took the room while this one waited: the task never started
            # here, so it waits first in its queue for this consumer's next claim or another's.
            self.broker.return_unstarted(self.queue, consumer_id, [raw])
        return 0.0

    def _dispatch(self, claimed: list[Claimed]) -> None:
        """Write the claims' receipts to the tasks' records, then hand the tasks to the workers."""
        self.room.claimed(len(claimed))
        self.dispatch(with_receipts(self.broker, claimed, self._result_ttl_s))

    def reconcile(self) -> None:
        """Return tasks that sit in our processing list unbeknown to us (a claim's lost reply).

        Only this thread adds to this queue's processing list and to what the consumer holds of
        it, so taking the held tasks first and listing second can only make us see fewer strays,
        never a held task as one. Left alone a stray would wait, unstarted, until this consumer
        stops.
        """
        consumer_id = self.consumer_id()
        held = self.held.raws(self.queue, consumer_id)
        listed = self.broker.held_by(self.queue, consumer_id)
        strays = list((Counter(raw for raw in listed if raw != WAKE_TOKEN) - held).elements())
        self._drop_wake = self._drop_wake or WAKE_TOKEN in listed
        if strays:
            returned = self.broker.return_unstarted(self.queue, consumer_id, strays)
            logger.warning(
                "returned %d claimed task(s) whose claim reply was lost to the head of %s", returned, self.queue
            )
        self._uncertain = False
        self._audit_at = time.monotonic() + self.lease.lease_s
