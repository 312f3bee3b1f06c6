"""Claiming: claimers fill the consumer's bounded room (concurrency + prefetch) with tasks of its queues.

A blocking wait on an empty queue holds no room, so a task pushed on any queue starts at once.
Right after a claim one round trip writes a receipt to each task's record: a task cancelled before
is dropped unrun, a cancel after is a request to this consumer, so a receipted task starts without
waiting for its RUNNING write.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from django.conf import settings
from redis.exceptions import RedisError

from tasks_app import metrics
from tasks_app.consumer.loops import Misconfigured, misconfiguration, until_done
from tasks_app.consumer.membership import Membership
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, UndecodableTask, decode_task
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.queue import LONGEST_WAIT_S, Claim, WaitConnection
from tasks_app.protocol.records import ResultUpdate
from tasks_app.protocol.tracking import CHANGE_WAIT_S, Changes

logger = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: one per task, and frozen costs four times as much to build
class Claimed:
    """A task as claimed: the exact bytes in `consumer_id`'s processing list of `queue`."""

    queue: str
    consumer_id: str
    raw: bytes
    suspect: bool = False  # recovered from a dead consumer: its start is recorded before it runs
    fence: int = 0  # this claim's fencing token: result writes of older runs are ignored
    task: Task | None = field(default=None, compare=False)  # decoded as its receipt was written
    receipt: int | None = field(default=None, compare=False)  # the record's answer (START_REFUSED: cancelled)
    claimed_at_s: float = field(default_factory=time.monotonic, compare=False)
    open_at_s: float = field(default=-math.inf, compare=False)  # when its claim saw its queue not paused
    # By when (monotonic s) its handler must begin, once its rate limit admits it.
    start_by: float = field(default=math.inf, compare=False)


# What claim_receipts answers where there is no record: no receipt (the RUNNING write decides).
NOT_A_RECORD = -1


def decoded(raw: bytes) -> Task | None:
    """The task `raw` holds; None if it is undecodable (its run dead-letters it)."""
    try:
        return decode_task(raw)
    except UndecodableTask:
        return None


def write_receipts(broker: Broker, claimed: Sequence[Claimed], result_ttl_s: int) -> None:
    """Write the receipts of freshly claimed tasks: each is decoded and given its record's answer."""
    for item in claimed:
        item.task = decoded(item.raw)
    decoded_items = [(item, item.task) for item in claimed if item.task is not None]
    claims = [(task.id, item.fence) for item, task in decoded_items]
    named = [(item.queue, task.type) for item, task in decoded_items]
    try:
        replies = broker.queue.claim_receipts(claims, result_ttl_s, named) if claims else []
    except RedisError as exc:
        logger.warning(
            "could not write the claim receipts of %d task(s) (%s); they start unreceipted", len(claims), exc
        )
        replies = [NOT_A_RECORD] * len(claims)
    for (item, _), reply in zip(decoded_items, replies, strict=True):
        item.receipt = None if reply == NOT_A_RECORD else reply


def withdrawal(claimed: Claimed, task: Task, ttl_s: int) -> ResultUpdate | None:
    """The write that withdraws the receipt of one claimed task (`task`, decoded) going back unstarted; None if none."""
    return records.receipt_withdrawn(task, claimed.fence, ttl_s) if claimed.receipt is not None else None


# An automatic prefetch holds what the consumer starts in about this long at its recent pace, at most 64,
# the pace measured over windows at least PACE_WINDOW_S long and smoothed over PACE_SMOOTHING_S.
PREFETCH_HORIZON_S = 0.02
AUTO_PREFETCH_MAX = 64
PACE_WINDOW_S = 0.1
PACE_SMOOTHING_S = 0.3


class Capacity:
    """Counts the tasks this consumer holds; claiming waits while it is full (backpressure)."""

    def __init__(self, concurrency: int, prefetch: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        """`prefetch` None: automatic, following the pace, up to AUTO_PREFETCH_MAX."""
        self.concurrency = concurrency
        self.prefetch_max = AUTO_PREFETCH_MAX if prefetch is None else prefetch
        self.auto = prefetch is None
        self.limit = concurrency + (0 if self.auto else self.prefetch_max)
        metrics.PREFETCH.set(self.limit - concurrency)
        self.in_use = 0
        self._cond = threading.Condition()
        self._clock = clock
        self._window_start, self._window_count, self._per_s = clock(), 0, 0.0

    def acquire(self, timeout_s: float) -> bool:
        """Take room for one task, waiting up to `timeout_s` for it to free up."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.in_use < self.limit, timeout_s):
                return False
            self.in_use += 1
            return True

    def acquire_up_to(self, count: int) -> int:
        """Take room for as many tasks as there is, up to `count`, without waiting."""
        with self._cond:
            self._follow_pace()
            taken = max(0, min(count, self.limit - self.in_use))
            self.in_use += taken
            return taken

    def claimed(self, count: int) -> None:
        """Count tasks just claimed into the room taken for them (the pace of an automatic prefetch)."""
        if self.auto:
            with self._cond:
                self._window_count += count

    def take_back(self) -> None:
        """Count such a task again, at once, just before its room is given back as it leaves the consumer."""
        with self._cond:
            self.in_use += 1

    def release(self, count: int = 1) -> None:
        """Give room back."""
        if count > 0:
            with self._cond:
                self.in_use -= count
                self._cond.notify_all()

    def _follow_pace(self) -> None:
        now = self._clock()
        elapsed = now - self._window_start
        if not self.auto or elapsed < PACE_WINDOW_S:
            return
        self._per_s += min(1.0, elapsed / PACE_SMOOTHING_S) * (self._window_count / elapsed - self._per_s)
        self._window_start, self._window_count = now, 0
        prefetch = min(self.prefetch_max, int(self._per_s * PREFETCH_HORIZON_S))
        self.limit = self.concurrency + prefetch
        metrics.PREFETCH.set(prefetch)
        self._cond.notify_all()


class HeldTasks:
    """Claimed tasks not yet let go of, counted per processing list (twins can be claimed at once)."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self._counts: Counter[tuple[str, str, bytes]] = Counter()  # (queue, consumer id, task)
        self._lock = threading.Lock()
        self._suspect_turn_taken = False
        self._together = threading.local()  # room of tasks a thread finishes in a `together` block

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Give back the room of the tasks this thread finishes in the block at once, when it ends."""
        if getattr(self._together, "room", None) is not None:  # nested: the outer block gives them back
            yield
            return
        self._together.room = 0
        try:
            yield
        finally:
            room, self._together.room = self._together.room, None
            self._give_back(room)

    def took(self, claimed: Sequence[Claimed]) -> None:
        """Count tasks just claimed (their room in the consumer was taken by the claim)."""
        metrics.IN_FLIGHT.inc(len(claimed))
        with self._lock:
            self._counts.update((item.queue, item.consumer_id, item.raw) for item in claimed)

    def finished(self, claimed: Sequence[Claimed]) -> None:
        """Give back the room of tasks that left this consumer's hands."""
        if any(item.suspect for item in claimed):
            self.give_suspect_turn_back()
        with self._lock:
            for item in claimed:
                key = (item.queue, item.consumer_id, item.raw)
                self._counts[key] -= 1
                if self._counts[key] <= 0:
                    del self._counts[key]
        together = getattr(self._together, "room", None)
        if together is not None:
            self._together.room = together + len(claimed)
        else:
            self._give_back(len(claimed))

    def _give_back(self, tasks: int) -> None:
        if tasks:
            metrics.IN_FLIGHT.dec(tasks)
            self.capacity.release(tasks)

    def raws(self, queue: str, consumer_id: str) -> Counter[bytes]:
        """The tasks of one processing list held, each with how many times."""
        with self._lock:
            return Counter({raw: n for (q, c, raw), n in self._counts.items() if q == queue and c == consumer_id})

    def take_suspect_turn(self) -> bool:
        """Take the turn to hold a suspect; False if it is taken."""
        with self._lock:
            taken, self._suspect_turn_taken = self._suspect_turn_taken, True
            return not taken

    def give_suspect_turn_back(self) -> None:
        """Give the turn to hold a suspect back."""
        self._suspect_turn_taken = False


# How old the pause state of a queue a worker acts on may be.
PAUSE_STATE_MAX_AGE_S = 0.25


class PauseWatch:
    """Whether a claimed task's queue was paused since, read from Redis at most every PAUSE_STATE_MAX_AGE_S."""

    def __init__(self, broker: Broker, give_up: threading.Event, result_ttl_s: int) -> None:
        self.broker = broker
        self.give_up = give_up
        self.result_ttl_s = result_ttl_s
        self._seen: dict[str, tuple[bool, float]] = {}

    def paused(self, queue: str) -> bool:
        """True if `queue` is paused, as of PAUSE_STATE_MAX_AGE_S ago at most (while Redis is away: as last seen)."""
        now = time.monotonic()
        seen = self._seen.get(queue)
        if seen is not None and now - seen[1] < PAUSE_STATE_MAX_AGE_S:
            return seen[0]
        try:
            paused = self.broker.control.is_paused(queue)
        except RedisError:
            paused = seen[0] if seen is not None else False
        self._seen[queue] = (paused, now)
        return paused

    def return_if_paused(self, claimed: Claimed) -> bool:
        """Put a claimed task of a paused queue back at the head of pending, unstarted; False if it runs."""
        if time.monotonic() - claimed.open_at_s < PAUSE_STATE_MAX_AGE_S or not self.paused(claimed.queue):
            return False
        return_unstarted(self.broker, [claimed], self.result_ttl_s, self.give_up)
        logger.info("queue %s is paused: a claimed task went back to pending unstarted", claimed.queue)
        return True


def return_unstarted(broker: Broker, claimed: Sequence[Claimed], ttl_s: int, give_up: threading.Event) -> None:
    """Put claimed tasks back at the head of pending, unstarted, their receipts withdrawn."""
    by_owner: dict[tuple[str, str], list[Claimed]] = {}
    for item in claimed:
        by_owner.setdefault((item.queue, item.consumer_id), []).append(item)
    for (queue, consumer_id), items in by_owner.items():
        raws = [item.raw for item in items]
        withdrawn = [w for item in items if item.task is not None and (w := withdrawal(item, item.task, ttl_s))]
        until_done(
            partial(broker.queue.return_unstarted, queue, consumer_id, raws, withdrawn),
            what="return_unstarted",
            give_up=give_up,
        )


# How soon a claimer looks again for suspects it could not take yet, or under a lease that lapsed.
RETRY_SOON_S = 0.1
# How soon a claimer that may not claim looks again: queue paused, not registered there, no task types yet.
RECHECK_S = 0.25


class ClaimerLoop:
    """Claims tasks of one queue while there is room: a batch at once, else one blocking move (none if tracked)."""

    def __init__(
        self,
        queue: str,
        broker: Broker,
        *,
        held: HeldTasks,
        membership: Membership,
        types_loaded: Callable[[], bool],
        dispatch: Callable[[Sequence[Claimed]], None],
        block_s: float,
        claims: Broker | None = None,
        waits: WaitConnection | None = None,
    ) -> None:
        """`claims`: a tracked connection's broker; `waits`: a connection for blocking claims a stop cuts short."""
        self.queue = queue
        self.broker = broker
        self.claims = claims or broker
        self.blocking = claims is None
        self.waits = waits
        self._blocking_claims = broker if waits is None else broker.over(waits.client)
        self.held = held
        self.room = held.capacity
        self.membership = membership
        self.types_loaded = types_loaded
        self.dispatch = dispatch
        self.block_s = block_s
        self.name = f"claimer:{queue}"
        self._drop_wake = False
        # While blocking waits time out empty, it waits again with no claim script between until then (monotonic s).
        self._quiet_until = 0.0
        self._uncertain = False  # a claim failed on the wire: Redis may have moved tasks we never heard of
        self._audit_at = time.monotonic() + membership.lease.lease_s
        # Only a claim adds to our processing list, and a claim script answered "nothing" added nothing.
        self._claimed_since_audit = False
        self._room_taken = 0  # for the claim in progress, not yet handed to a dispatched task
        self._result_ttl_s = int(settings.TASKS_RESULT_TTL)

    def run_once(self, room_wait_s: float = 0.5) -> float:
        if not self.membership.registered_on(self.queue):
            return RECHECK_S  # no lease here to claim under: what it claimed could not be recovered
        if self._uncertain or time.monotonic() >= self.audit_at:
            self.reconcile()
        if not self.types_loaded():  # its tasks could only be deferred: others may run them
            return RECHECK_S
        consumer_id = self.membership.consumer_id
        if time.monotonic() < self._quiet_until and self.membership.lease.fresh(consumer_id):
            try:
                return self._claim_blocking(consumer_id, 0, after_claim=False)  # a push, suspect or priority wakes it
            except RedisError:
                self._uncertain = True  # its move may have happened unheard of: the next turn audits first
                raise
        if not self.room.acquire(timeout_s=room_wait_s):
            return 0.0
        self._room_taken = 1 + self.room.acquire_up_to(self.room.limit - 1)
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
            outcome = self.claims.queue.claim_with_suspect(
                self.queue, consumer_id, self._room_taken, drop_wake=self._drop_wake, allow_suspect=may_take_suspect
            )
            self._drop_wake = False
            return outcome
        finally:
            if may_take_suspect and not (outcome is not None and outcome.took_suspect):
                self.held.give_suspect_turn_back()
            self._claimed_since_audit = self._claimed_since_audit or outcome is None or bool(outcome.tasks)

    def _take(self, outcome: Claim | None, consumer_id: str) -> float:
        """Dispatch what the claim moved; with nothing moved, block on pending for one task."""
        if outcome is None:
            self.membership.lease_lost(consumer_id, [self.queue])
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
            return RECHECK_S if self.blocking else math.inf  # the claim read the pause marker: its removal is told
        if outcome.lease_expired or not self.membership.lease.fresh(consumer_id):
            return RETRY_SOON_S  # no claim under a lapsed lease: the heartbeat renews it or gives it up
        if not self.blocking:  # the claim read what it found empty: a task pushed there is told
            return RETRY_SOON_S if outcome.suspects_waiting else math.inf
        # A blocking claim holds no room while it waits: with more queues than room for tasks, a claimer
        # holding some kept every other queue's tasks waiting until its wait timed out.
        self.room.release(self._room_taken)
        self._room_taken = 0
        return self._claim_blocking(consumer_id, outcome.suspects_waiting, after_claim=True)

    def _claim_blocking(self, consumer_id: str, suspects_waiting: int, *, after_claim: bool) -> float:
        """Block on pending for one task; it takes free room, or goes back first in its queue if none is left."""
        # Suspects waiting for this consumer's one suspect turn are claimed soon after it frees.
        block_s = min(self.block_s, RETRY_SOON_S) if suspects_waiting else self.block_s
        if self.waits is not None and not suspects_waiting:  # a stop cuts the wait short: it may be long
            if after_claim:  # a push, a suspect or a priority wakes it: the next full claim is a lease away
                self._quiet_until = time.monotonic() + self.membership.lease.lease_s
            quiet_s = min(self._quiet_until - time.monotonic(), self.membership.lease.fresh_for_s(consumer_id))
            block_s = max(block_s, round(min(quiet_s, LONGEST_WAIT_S), 3))
        # A blocking claim's reply can be lost with no error told (a wait cut short): it always makes the audit due.
        self._claimed_since_audit = True
        claim = self._blocking_claims.queue.claim_blocking(self.queue, consumer_id, block_s, self._result_ttl_s)
        raw = claim.raw
        self._drop_wake = raw == WAKE_TOKEN
        if raw is None and not suspects_waiting:  # nothing came: the next waits need no claim before them
            if after_claim and self.waits is None:
                self._quiet_until = time.monotonic() + self.membership.lease.lease_s / 3
            return 0.0
        self._quiet_until = 0.0
        if raw is None or raw == WAKE_TOKEN:
            return 0.0
        item = Claimed(self.queue, consumer_id, raw, fence=claim.fence)
        if claim.queue_open:  # its start needs no look at the pause marker for a while
            item.open_at_s = item.claimed_at_s
        if claim.receipt is not None:  # the claim wrote it (one server): the task is only decoded
            item.task = decoded(raw)
            item.receipt = None if claim.receipt == NOT_A_RECORD else claim.receipt
        if self.room.acquire_up_to(1):
            self._dispatch([item], receipted=claim.receipt is not None)
            time.sleep(0)  # a worker takes it at once, not when this thread next waits on Redis
        else:
            # Other queues' claims took the room while this one waited: it goes back first in its queue.
            withdrawn = withdrawal(item, item.task, self._result_ttl_s) if item.task is not None else None
            self.broker.queue.return_unstarted(self.queue, consumer_id, [raw], [withdrawn] if withdrawn else [])
        return 0.0

    def interrupt(self) -> None:
        """Cut a blocking claim short (the consumer stops)."""
        if self.waits is not None:
            self.waits.interrupt()

    def _dispatch(self, claimed: list[Claimed], *, receipted: bool = False) -> None:
        """Write the claims' receipts (unless the claim did), then hand the tasks to the workers."""
        self.room.claimed(len(claimed))
        if not receipted:
            write_receipts(self.broker, claimed, self._result_ttl_s)
        self.dispatch(claimed)

    @property
    def audit_at(self) -> float:
        """When its audit of strays is due (monotonic s): once a lease, and only after a claim."""
        return self._audit_at if self._claimed_since_audit else math.inf

    def reconcile(self) -> None:
        """Return tasks that sit in our processing or staging list unbeknown to us (a claim's lost reply)."""
        # Only this thread adds to this list: held first, listed second can miss strays, never take a held task.
        consumer_id = self.membership.consumer_id
        held = self.held.raws(self.queue, consumer_id)
        listed, staged = self.broker.queue.held_and_staged(self.queue, consumer_id)
        strays = list((Counter(raw for raw in listed if raw != WAKE_TOKEN) - held).elements())
        self._drop_wake = self._drop_wake or WAKE_TOKEN in listed
        # A task a blocking move staged without the script behind it (see claim_blocking): never receipted.
        returned = self.broker.queue.return_unstarted(self.queue, consumer_id, staged, staged=True)
        if strays:
            returned += self.broker.queue.return_unstarted(self.queue, consumer_id, strays)
        if returned:
            logger.warning(
                "returned %d claimed task(s) whose claim reply was lost to the head of %s", returned, self.queue
            )
        self._uncertain = False
        self._claimed_since_audit = False
        self._audit_at = time.monotonic() + self.membership.lease.lease_s


class OneClaimer:
    """Claims for every queue on one thread and one tracked connection, whatever the number of queues.

    A queue is claimed from again only when Redis says a key its last claim read changed, or when its
    claimer asked to. After each claim that moved tasks the first queue comes first again (with weights,
    a queue comes first with odds proportional to its weight).
    """

    name = "claimer"

    def __init__(
        self,
        claimers: Sequence[ClaimerLoop],
        changes: Changes,
        room: Capacity,
        misconfigured: Misconfigured,
        weights: Mapping[str, int] | None = None,
    ) -> None:
        self.claimers = list(claimers)
        self.weights = {claimer: (weights or {}).get(claimer.queue, 1) for claimer in claimers} if weights else None
        self.changes = changes
        self.room = room
        self.misconfigured = misconfigured
        keys = self.claimers[0].broker.keys
        self._claimer_of = {
            key.encode(): claimer
            for claimer in self.claimers
            for key in (
                keys.pending(claimer.queue),
                keys.prioritized(claimer.queue),
                keys.suspects(claimer.queue),
                keys.paused(claimer.queue),
            )
        }
        self._due = dict.fromkeys(self.claimers, 0.0)  # when each claims next (monotonic s; inf: when told)
        self._problems: ProblemLog[str] = ProblemLog(logger)

    def run_once(self) -> float:
        self._told(self.changes.changed(0))
        if not self.room.acquire(timeout_s=CHANGE_WAIT_S):
            return 0.0
        self.room.release()
        for claimer in self._order():
            now = time.monotonic()
            if self._due[claimer] > now:
                if claimer.audit_at <= now:  # its audit of strays: Redis tells of pushes meanwhile
                    self._guarded(claimer, claimer.reconcile)
                continue
            wait_s = self._guarded(claimer, partial(claimer.run_once, room_wait_s=0.0))
            self._due[claimer] = now + wait_s
            if wait_s == 0.0:  # it moved tasks (or found no room): the first queue first again
                return 0.0
        wait_s = min(min(self._due[c], c.audit_at) for c in self.claimers) - time.monotonic()
        if wait_s > 0:
            self._told(self.changes.changed(min(wait_s, CHANGE_WAIT_S)))
        return 0.0

    def _order(self) -> list[ClaimerLoop]:
        """The claimers in this round's order: as given, or by a random key u ** (1 / weight), highest first."""
        if self.weights is None:
            return self.claimers
        weights = self.weights
        return sorted(self.claimers, key=lambda claimer: random.random() ** (1 / weights[claimer]), reverse=True)

    def _guarded(self, claimer: ClaimerLoop, call: Callable[[], float | None]) -> float:
        """`call` of `claimer` (its claim, or its audit); a key of ours of another type is noted, not raised."""
        try:
            wait_s = call() or 0.0
        except RedisError as exc:
            if not misconfiguration(exc):
                raise
            self.misconfigured.failed(claimer.name, exc, self._problems)
            return CHANGE_WAIT_S
        self._problems.recovered(claimer.name, "%s: works again", claimer.name)
        self.misconfigured.note(claimer.name, failed=False)
        return wait_s

    def _told(self, changed: set[bytes] | None) -> None:
        if changed is None:
            self._due = dict.fromkeys(self.claimers, 0.0)
            return
        for key in changed:
            claimer = self._claimer_of.get(key)
            if claimer is not None:
                self._due[claimer] = 0.0
