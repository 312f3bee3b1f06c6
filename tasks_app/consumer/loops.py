"""Background loops of a consumer; each has a `run_once()` that tests can call directly."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Protocol

from redis.exceptions import RedisError, ResponseError

from tasks_app import metrics
from tasks_app.consumer.retrying import next_backoff_s, redis_away
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.protocol.replies import Promotion
from tasks_app.protocol.scripts import is_transient

logger = logging.getLogger(__name__)


class Loop(Protocol):
    """One duty of a consumer: `run_once()` does a bit of it and says how long to sleep."""

    name: str

    def run_once(self) -> float: ...


class Misconfigured:
    """The loops whose last pass failed on a key of ours that Redis refuses (another type): readiness is red meanwhile.

    Only this system writes those keys, so such an error is a misconfiguration (another program writing
    under our prefix), not a state to work around: the loop says it once and goes on at its pace.
    """

    def __init__(self) -> None:
        self._loops: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, loop: str) -> None:
        """Note that `loop`'s last pass failed on a misconfigured key."""
        with self._lock:
            self._loops.add(loop)

    def passed(self, loop: str) -> None:
        """Note that `loop`'s last pass went through."""
        if loop in self._loops:
            with self._lock:
                self._loops.discard(loop)

    def loops(self) -> list[str]:
        """The loops whose last pass failed on a misconfigured key."""
        with self._lock:
            return sorted(self._loops)


def misconfiguration(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command for what a key holds: retrying cannot help, fixing the key does."""
    return isinstance(exc, ResponseError) and not is_transient(exc)


def raise_key_errors(errors: Mapping[str, str], what: str) -> None:
    """Raise Redis's errors of a call made queue by queue (`errors`, by queue) as one ResponseError."""
    if errors:
        said = "; ".join(f"queue {queue}: {error}" for queue, error in errors.items())
        raise ResponseError(f"{what}: {said}")


# A loop whose pass failed on a misconfigured key, and whose last pass asked for no sleep, waits this long.
MISCONFIGURED_PACE_S = 1.0


def run_forever(loop: Loop, stop: threading.Event, misconfigured: Misconfigured | None = None) -> None:
    """Call `loop.run_once()` until `stop` is set, backing off through Redis outages.

    A misconfigured key (see `Misconfigured`) is said once per distinct error, and the loop goes on at the
    pace its last pass asked for; a bug is said once, and the loop goes on each second.
    """
    backoff_s, pace_s = 0.0, MISCONFIGURED_PACE_S
    problems: ProblemLog[str] = ProblemLog(logger)  # an outage or a bug is met at every pass: said once
    misconfigured = misconfigured or Misconfigured()
    while not stop.is_set():
        try:
            sleep_s = loop.run_once()
            backoff_s, pace_s = 0.0, sleep_s or MISCONFIGURED_PACE_S
            problems.recovered(loop.name, "%s: works again", loop.name)
            misconfigured.passed(loop.name)
        except RedisError as exc:
            if misconfiguration(exc):
                message = "%s: a key of ours holds what Redis refuses (misconfigured): %s"
                problems.failed(loop.name, str(exc), message, loop.name, exc, level=logging.ERROR)
                misconfigured.failed(loop.name)
                sleep_s = pace_s
            else:
                sleep_s = backoff_s = redis_away(problems, loop.name, exc, next_backoff_s(backoff_s))
        except Exception as exc:  # a bug in one loop must not silently end it
            problem = f"{type(exc).__name__}: {exc}"
            problems.failed(loop.name, problem, "%s: unexpected error", loop.name, exc_info=True)
            sleep_s = 1.0
        if sleep_s > 0:
            stop.wait(sleep_s)


def start_thread(loop: Loop, stop: threading.Event, misconfigured: Misconfigured | None = None) -> threading.Thread:
    """Run a loop in a daemon thread named after it."""
    thread = threading.Thread(target=run_forever, args=(loop, stop, misconfigured), name=loop.name, daemon=True)
    thread.start()
    return thread


# A renewal's socket and connect timeouts, as a share of the lease: a hung renewal fails fast
# and is retried (at the same pace) well before the lease runs out.
HEARTBEAT_TIMEOUT_SHARE = 1 / 6
# Tasks start only while the last renewal is younger than the lease less this share of it.
LEASE_MARGIN_SHARE = 1 / 6


class LeaseClock:
    """When this consumer's lease was last renewed, and under which id, on the monotonic clock."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        # (consumer id, when its lease was last renewed), replaced whole: `fresh`, asked several
        # times per task by every worker, reads it without a lock (a lock held by a thread the
        # interpreter switches away from stalls every worker until that thread runs again).
        self._renewal: tuple[str, float] = ("", float("-inf"))
        self._lock = threading.Lock()  # one renewal at a time
        self._on_renewal: list[Callable[[], None]] = []

    def on_renewal(self, renew: Callable[[], None]) -> None:
        """Call `renew` after each renewal: what else lives under the lease (concurrency slots) is renewed with it."""
        self._on_renewal.append(renew)

    def renewed(self, consumer_id: str, sent_at: float) -> None:
        """Record a successful renewal whose request left at `sent_at` (the lease runs from then, or later)."""
        with self._lock:
            current_id, renewed_at = self._renewal
            self._renewal = (consumer_id, sent_at if consumer_id != current_id else max(renewed_at, sent_at))
        for renew in self._on_renewal:
            renew()

    def fresh(self, consumer_id: str) -> bool:
        """True while the lease of `consumer_id` surely holds: renewed less than lease - margin ago."""
        current_id, renewed_at = self._renewal
        return consumer_id == current_id and time.monotonic() - renewed_at < self.lease_s * (1 - LEASE_MARGIN_SHARE)


class HeartbeatLoop:
    """Renews this consumer's lease every third of the lease, on its own connection."""

    name = "heartbeat"

    def __init__(
        self,
        broker: Broker,
        registered: Callable[[], tuple[str, list[str]]],
        lease: LeaseClock,
        on_lost: Callable[[str, list[str]], None],
        instance: str = "",
    ) -> None:
        self.broker = broker
        self.registered = registered  # the consumer's id, and the queues it is registered on under it
        self.instance = instance  # the token registered in the consumer's info (see heartbeat.lua)
        self.lease = lease
        self.lease_ms = int(lease.lease_s * 1000)
        self.on_lost = on_lost
        self._problems: ProblemLog[str] = ProblemLog(logger)

    def run_once(self) -> float:
        consumer_id, queues = self.registered()
        sent_at = time.monotonic()
        try:
            lost, errors = self.broker.renew_leases(queues, consumer_id, self.lease_ms, instance=self.instance)
        except RedisError as exc:
            if misconfiguration(exc):
                raise
            # Retry at twice the renewal pace instead of run_forever's backoff (up to 5 s):
            # after a Redis restart reapers wait only one lease of uptime, and a heartbeat
            # still backing off past that would get this live consumer reaped.
            return redis_away(self._problems, self.name, exc, self.lease_ms / 6000)
        self._problems.recovered(self.name, "%s: works again", self.name)
        # Not renewed where a key of ours is misconfigured: lost there, so none of the tasks held there starts.
        lost += [queue for queue in queues if queue in errors]
        if not lost:
            self.lease.renewed(consumer_id, sent_at)
            metrics.LEASE_RENEWALS.inc()
        else:
            metrics.LEASES_LOST.inc()
            self.on_lost(consumer_id, lost)
        raise_key_errors(errors, "renewing the lease")
        return self.lease_ms / 3000


class SchedulerLoop:
    """Moves due delayed tasks into pending, waking when the next one is due; trims dead letters, samples backlogs."""

    name = "scheduler"
    MAX_SLEEP_S = 0.25
    BATCH = 1000
    # Dead letters are trimmed this often (a dead-letter set may exceed its caps by what dies meanwhile).
    TRIM_EVERY_S = 5.0

    def __init__(
        self,
        broker: Broker,
        queues: Sequence[str],
        *,
        dead_letter_max: int | None = None,
        dead_letter_max_age_s: int | None = None,
        disabled: Callable[[str], bool] = lambda task_type: True,
    ) -> None:
        from django.conf import settings

        self.broker = broker
        self.queues = list(queues)
        self.disabled = disabled  # whether a task type is disabled (its deferred tasks wait)
        self.dead_letter_max = settings.TASKS_DEAD_LETTER_MAX if dead_letter_max is None else dead_letter_max
        self.dead_letter_max_age_s = (
            settings.TASKS_DEAD_LETTER_MAX_AGE_S if dead_letter_max_age_s is None else dead_letter_max_age_s
        )
        self._trimmed_at = float("-inf")
        self.result_ttl_s = int(settings.TASKS_RESULT_TTL)

    def run_once(self) -> float:
        sleep_s = self.MAX_SLEEP_S
        for promotion in map(self._promote, self.queues):
            if promotion.moved + promotion.malformed >= self.BATCH:
                sleep_s = 0.0
            elif promotion.next_due_ms >= 0:
                sleep_s = min(sleep_s, max(0.0, (promotion.next_due_ms - promotion.now_ms) / 1000))
        if time.monotonic() - self._trimmed_at >= self.TRIM_EVERY_S:
            self.trim_dead_letters()
            for queue in self.queues:
                self.broker.sample_backlog(queue)  # the backlog chart's samples
                self.broker.refresh_history_ttl(queue, ttl_s=self.result_ttl_s)
                self.broker.wake_enabled(queue, disabled=self.disabled)
        return sleep_s

    def _promote(self, queue: str) -> Promotion:
        promotion = self.broker.promote_due(queue, self.BATCH)
        if promotion.malformed:
            metrics.TASKS_DEAD_LETTERED.labels(UNDECODABLE_TYPE, queue).inc(promotion.malformed)
            logger.warning("%d malformed delayed member(s) of queue %s dead-lettered", promotion.malformed, queue)
        return promotion

    def trim_dead_letters(self) -> int:
        """Apply the dead-letter caps (count and age) to every queue; return how many were dropped."""
        self._trimmed_at = time.monotonic()
        trim = partial(self.broker.trim_dead, max_count=self.dead_letter_max, max_age_s=self.dead_letter_max_age_s)
        return sum(map(trim, self.queues))


class ReaperLoop:
    """Moves the tasks of consumers whose lease expired to their queue's suspects; never a live one's."""

    name = "reaper"

    def __init__(
        self,
        broker: Broker,
        queues: Sequence[str],
        lease_s: float,
        on_dead_lettered: Callable[[str, list[bytes]], None],
    ) -> None:
        self.broker = broker
        self.queues = list(queues)
        self.lease_s = lease_s
        self.on_dead_lettered = on_dead_lettered
        # Per queue, the page of tombstones to examine next (besides the newest, every time).
        self._tombstone_offsets = dict.fromkeys(self.queues, 0)

    def run_once(self) -> float:
        for queue in self.queues:
            self._reap_queue(queue)
        return max(0.05, self.lease_s / 4)

    def _reap_queue(self, queue: str) -> None:
        """Reap the dead consumers of `queue` on this page."""
        expired, tombstones, self._tombstone_offsets[queue] = self.broker.reap_candidate_page(
            queue, self._tombstone_offsets[queue]
        )
        for consumer_id in [*expired, *tombstones]:
            self.reap(queue, consumer_id)

    def reap(self, queue: str, consumer_id: str, *, own_earlier_run: bool = False) -> int:
        """Reap one consumer's list on one queue completely; return how many tasks moved.

        With `own_earlier_run`, recover what an earlier run of this process's id left behind.
        """
        moved = 0
        while True:
            outcome = self.broker.reap(queue, consumer_id, int(self.lease_s * 1000), own_earlier_run=own_earlier_run)
            if outcome.status != 1:
                return moved
            moved += outcome.requeued + len(outcome.dead_lettered)
            if outcome.requeued:
                metrics.TASKS_RECOVERED.labels(queue).inc(outcome.requeued)
                logger.warning(
                    "recovered %d task(s) of dead consumer %s on queue %s", outcome.requeued, consumer_id, queue
                )
            if outcome.dead_lettered:
                self.on_dead_lettered(queue, outcome.dead_lettered)
            if not outcome.remaining:
                return moved


class HousekeepingLoop:
    """Reloads task type settings and watches running tasks (cancel requests, progress)."""

    name = "housekeeping"
    TICK_S = 0.1

    def __init__(self, refresh: Callable[[], None], refresh_every_s: float, watch: Callable[[], object]) -> None:
        self.refresh = refresh
        self.refresh_every_s = refresh_every_s
        self.watch = watch
        self._refreshed_at = float("-inf")

    def run_once(self) -> float:
        if time.monotonic() - self._refreshed_at >= self.refresh_every_s:
            self.refresh()
            self._refreshed_at = time.monotonic()
        self.watch()
        return self.TICK_S


class TimeLimitLoop:
    """Enforces the running tasks' time limits every tick, on a thread that waits on no Redis reply:
    a Redis outage (or a frozen server) delays neither a TaskTimeout nor a hard limit."""

    name = "time-limits"
    TICK_S = 0.1

    def __init__(self, enforce: Callable[[], object]) -> None:
        self.enforce = enforce

    def run_once(self) -> float:
        self.enforce()
        return self.TICK_S
