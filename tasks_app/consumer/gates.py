"""The gates a task passes before it starts: its type's rate limit (GCRA on the server clock), then its concurrency cap.

A run holds one of its type's permits under this consumer's lease; a task that finds none free is
deferred, no attempt used, and queued as a waiter that a freed permit wakes.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from redis.exceptions import RedisError

from tasks_app import metrics
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.loops import GaveUp, until_done
from tasks_app.models import RATE_PERIOD_MAX_S, RATE_PERIOD_MIN_S, TaskType
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task
from tasks_app.protocol.keys import limit_key_token
from tasks_app.protocol.limits import RateDecision, SlotSet, Waiter
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig

logger = logging.getLogger(__name__)

# Slack sigma widens GCRA's emission interval (at most 5% of the rate). Half lets a woken task start
# up to sigma/2 early; the other half is the start margin: an admitted task's handler must begin
# within it or wait again (StartMissed), so the limit holds at the handlers' starts.
SLACK_FRACTION = 0.05
MAX_SLACK_US = 50_000
# CPython's thread switch interval (5 ms): a shorter margin would send back every task whose
# worker waited once for the GIL. Periods under 0.2 s pay for it with a slower steady rate.
MIN_START_MARGIN_US = 5_000
# Of the start margin, what calling the handler may take once its worker checked the time.
CALL_ALLOWANCE_US = 1_000
# How many values of a keyed limit a type notes, so that a change of the limit moves their deferred tasks.
MAX_FOLLOWED_KEY_VALUES = 100


@dataclass(frozen=True)
class RatePolicy:
    """The parameters of one type's limiter, in microseconds."""

    algorithm: str
    limit: int
    period_us: int
    emission_us: int
    tolerance_us: int
    start_margin_us: int  # how long after its admission a task's handler may begin

    @classmethod
    def for_config(cls, config: TaskTypeConfig) -> RatePolicy:
        """Derive the limiter parameters of a rate-limited type."""
        # GCRA admits at most L starts in any window W when L*T - tau >= W. With burst b,
        # tau = (b-1)*T + e and T = (W + e + m) / (L - b + 1) give L*T - tau = W + m, so handlers
        # that begin within the start margin m of their admissions start at most L times per W.
        limit = int(config.rate_limit or 0)
        if limit < 1:
            raise ValueError(f"task type {config.name!r} has no rate limit")
        burst = min(max(1, config.rate_burst), limit)
        period_us = round(_bounded_period_s(config.rate_period_s) * 1_000_000)
        slack_us = min(MAX_SLACK_US, int(period_us * SLACK_FRACTION))
        early_us = slack_us // 2
        margin_us = max(slack_us - early_us, MIN_START_MARGIN_US)
        if config.rate_algorithm == TaskType.RateAlgorithm.FIXED_WINDOW:
            return cls(config.rate_algorithm, limit, period_us, math.ceil(period_us / limit), 0, margin_us)
        emission_us = math.ceil((period_us + early_us + margin_us) / (limit - burst + 1))
        tolerance_us = (burst - 1) * emission_us + early_us
        return cls(TaskType.RateAlgorithm.GCRA, limit, period_us, emission_us, tolerance_us, margin_us)

    @property
    def start_within_s(self) -> float:
        """How long after asking the limiter an admitted task's worker may call its handler (seconds)."""
        return (self.start_margin_us - CALL_ALLOWANCE_US) / 1_000_000


class Admission(NamedTuple):
    """The rate gate's answer: > 0 ms to wait (deferred), or 0 and by when (monotonic s) the handler must begin."""

    wait_ms: int
    start_by: float = math.inf


class StartMissed(Exception):
    """An admitted task's handler could not begin within its start margin: it must wait again, unstarted."""


def check_start(start_by: float) -> None:
    """Raise StartMissed once past `start_by` (monotonic s): a later start could crowd a window of the limit."""
    if start_by != math.inf and time.monotonic() > start_by:
        raise StartMissed("the handler could not begin within the rate limit's start margin of its admission")


def _bounded_period_s(period_s: float) -> float:
    """The period within the admin's bounds (NaN read as the strictest)."""
    if period_s != period_s:
        return RATE_PERIOD_MAX_S
    return min(max(period_s, RATE_PERIOD_MIN_S), RATE_PERIOD_MAX_S)


class RateLimiter:
    """The consumer's rate gate: 0 lets a task start now, else the ms until its reserved turn."""

    def __init__(
        self, broker: Broker, give_up: threading.Event | None = None, follows: TaskTypeCache | None = None
    ) -> None:
        self.broker = broker
        if follows is not None:  # a limit changed in the admin moves the tasks waiting for it at once
            follows.on_change.append(self.follow)
        self.give_up = give_up or threading.Event()  # set: a wait for Redis raises GaveUp, the lease recovers
        # Until when (monotonic s) each (type, key token) of a keyed limit is known noted by `rate_keyed`.
        self._noted_until: dict[tuple[str, str], float] = {}
        self._notes_lock = threading.Lock()
        self._note_problem: ProblemLog[str] = ProblemLog(logger)

    def __call__(self, task: Task, config: TaskTypeConfig, key_token: str | None = None) -> Admission:
        """Take one decision for `task` (on its key value's own limiter if keyed): a wait, or an admission."""
        policy, asked_at = RatePolicy.for_config(config), [0.0]

        def decide() -> RateDecision:
            asked_at[0] = time.monotonic()  # the decision comes after: the start margin counts from here
            return self._decide(config, task.id, task.queue, key_token, policy)

        decision = until_done(decide, what="rate_limit", give_up=self.give_up)
        if decision.rescaled:  # the limit changed: the tasks waiting for turns go to their new ones
            self._start_following(config.name, [key_token])
        if decision.wait_us > 0 and key_token is not None:
            self._note_value(config, key_token, decision.wait_us)
        metrics.RATE_LIMIT_DECISIONS.labels(config.name, "denied" if decision.wait_us > 0 else "allowed").inc()
        if decision.wait_us > 0:
            return Admission(math.ceil(decision.wait_us / 1000))
        return Admission(0, asked_at[0] + policy.start_within_s)

    def follow(self, config: TaskTypeConfig) -> None:
        """Bring a type's limiters (unkeyed, and each value noted of a keyed limit) to its changed settings now."""
        try:
            values = self.broker.limits.rate_keyed_values(config.name)
        except Exception as exc:  # those values follow at their next decisions (removed: run at their turns)
            logger.warning("could not read the rate-limited values of %s: %s", config.name, exc)
            values = []
        # Every consumer that noticed the change follows it up (one at a time): if one dies, another finishes.
        if changed := [key_token for key_token in [None, *values] if self._notice(config, key_token)]:
            self._start_following(config.name, changed)

    def _notice(self, config: TaskTypeConfig, key_token: str | None) -> bool:
        """Tell one limiter of the type that its settings changed; False if it has nothing to follow up."""
        try:
            if config.rate_limit and bool(config.rate_limit_key) == (key_token is not None):
                self._decide(config, "", "", key_token)  # only brings the hash to the new spacing: no decision
                return True
            # Removed, or no longer the type's kind of limiter (keyed or not): what waits for its turns is due now.
            return self.broker.limits.rate_removed(config.name, key_token, config.queue) > 0
        except Exception as exc:  # its next decision does it (a removed one's tasks run at their turns)
            logger.warning("could not bring a rate limiter of %s to its new settings: %s", config.name, exc)
            return False

    def _note_value(self, config: TaskTypeConfig, key_token: str, wait_us: int) -> None:
        """Note a value of a keyed limit holding turns, so that a change of the limit reaches its deferred tasks."""
        policy = RatePolicy.for_config(config)
        lives_us = wait_us + policy.emission_us + policy.period_us  # as long as its limiter's hash lives
        noted, now_s = (config.name, key_token), time.monotonic()
        if self._noted_until.get(noted, 0.0) >= now_s + lives_us / 1e6:
            return  # an earlier note still covers this denial's turn
        # One period of headroom: half for denials, half for this clock running ahead of the server's.
        try:
            noting = self.broker.limits.rate_keyed(
                config.name, key_token, lives_us + policy.period_us, MAX_FOLLOWED_KEY_VALUES
            )
        except Exception as exc:  # after a change, that value's tasks then wait out their turns
            message = "could not note the rate-limited value %s of %s: %s"
            self._note_problem.failed(config.name, str(exc), message, key_token, config.name, exc)
            return
        self._note_problem.recovered(config.name, "the rate-limited values of %s are noted again", config.name)
        if noting:
            with self._notes_lock:
                if len(self._noted_until) >= 4 * MAX_FOLLOWED_KEY_VALUES:  # drop the notes whose time has passed
                    self._noted_until = {key: until for key, until in self._noted_until.items() if until > now_s}
                self._noted_until[noted] = now_s + (lives_us + policy.period_us // 2) / 1e6

    def _decide(
        self, config: TaskTypeConfig, task_id: str, queue: str, key_token: str | None, policy: RatePolicy | None = None
    ) -> RateDecision:
        policy = policy or RatePolicy.for_config(config)
        args = (policy.algorithm, task_id, policy.limit, policy.period_us, policy.emission_us, policy.tolerance_us)
        return self.broker.limits.rate_limit(config.name, *args, key_token, queue=queue, type_queue=config.queue)

    def _start_following(self, task_type: str, key_tokens: list[str | None]) -> None:
        threading.Thread(
            target=self._follow_up, args=(task_type, key_tokens), name="rate-follow-up", daemon=True
        ).start()

    def _follow_up(self, task_type: str, key_tokens: list[str | None]) -> None:
        """Bring the deferred tasks of a type whose limit changed to their new turns, on every queue holding them."""
        moved = 0
        try:
            for key_token in key_tokens:
                moved += self.broker.limits.follow_up(task_type, key_token, self.give_up)
        except Exception as exc:  # they still wake at their old turns, where they take their new ones
            logger.warning("could not move the waiting tasks of %s to its new rate limit: %s", task_type, exc)
            return
        if moved:
            logger.info("rate limit of %s changed: %d waiting task(s) moved to their new turns", task_type, moved)


# Idle permit sets and waiter lists expire after this long (at least), counted from their last write.
MIN_IDLE_KEEP_MS = 60_000


def key_token_of(kwarg: str, arguments: Arguments) -> str | None:
    """The key value token of a keyed limit (None when the limit is not keyed)."""
    return limit_key_token(arguments.kwargs, kwarg) if kwarg else None


class ConcurrencyGate:
    """Takes, renews and gives back the permits of this consumer's runs of capped types."""

    def __init__(
        self, broker: Broker, renew_broker: Broker, lease_s: float, recheck_s: float, give_up: threading.Event
    ) -> None:
        self.broker = broker
        self.renew_broker = renew_broker  # the heartbeat's own connection: never behind a busy worker
        self.lease_ms = int(lease_s * 1000)
        self.recheck_s = recheck_s
        self.idle_ms = max(MIN_IDLE_KEEP_MS, 4 * self.lease_ms, int(4000 * recheck_s))
        self.give_up = give_up
        self._held: dict[str, SlotSet] = {}
        self._lock = threading.Lock()
        self._renewal_problem: ProblemLog[str] = ProblemLog(logger)  # Redis away at every heartbeat

    def acquire(self, claimed: Claimed, task: Task, permits: SlotSet) -> str | None:
        """Take a permit for `task`; its holder token, or None when none is free."""
        holder = uuid.uuid4().hex
        waiter = Waiter.of(claimed.queue, task.priority, claimed.raw)
        taken, woken = until_done(
            lambda: self.broker.limits.acquire_slot(permits, holder, waiter, self.lease_ms, self.idle_ms),
            what="acquire_slot",
            give_up=self.give_up,
        )
        metrics.CONCURRENCY_DECISIONS.labels(task.type, "allowed" if taken else "denied").inc()
        self._wake(woken)
        if taken:  # renewed only now: a renewal after a Redis restart puts back a permit, never makes one
            with self._lock:
                self._held[holder] = permits
        return holder if taken else None

    def wait(self, claimed: Claimed, task: Task, permits: SlotSet) -> None:
        """Queue a deferred task for the next free permit of `permits` (wakes it at once if one is free)."""
        waiter = Waiter.of(claimed.queue, task.priority, claimed.raw)
        order_ms = task.enqueued_at_ms or 0
        woken = until_done(
            lambda: self.broker.limits.wait_for_slot(permits, waiter, order_ms, self.idle_ms, self.lease_ms),
            what="wait_for_slot",
            give_up=self.give_up,
        )
        self._wake(woken)

    def release(self, holder: str) -> None:
        """Give a run's permit back and wake one waiter per free permit; if Redis is away, the permit lapses."""
        with self._lock:
            permits = self._held.pop(holder, None)
        if permits is None:
            return
        try:
            woken = until_done(
                lambda: self.broker.limits.release_slot(permits, holder, self.idle_ms, self.lease_ms),
                what="release_slot",
                give_up=self.give_up,
            )
        except GaveUp:  # stopping without Redis: no longer renewed, the permit lapses with the lease
            logger.warning(
                "could not release a permit of %s; it frees when this consumer's lease lapses", permits.task_type
            )
            return
        self._wake(woken)

    def renew(self) -> None:
        """Extend every permit held by this consumer's runs (called after each lease renewal)."""
        with self._lock:
            held: dict[tuple[str, str | None], list[str]] = defaultdict(list)
            for holder, permits in self._held.items():
                held[(permits.task_type, permits.key_token)].append(holder)
        try:
            self.renew_broker.limits.renew_slots(held, self.lease_ms, self.idle_ms)
        except RedisError as exc:  # the next heartbeat tries again, well within the lease
            metrics.REDIS_ERRORS.labels("renew_slots").inc()
            message = "could not renew %d concurrency permit(s): %s"
            self._renewal_problem.failed("renew", "redis", message, sum(map(len, held.values())), exc)
            return
        self._renewal_problem.recovered("renew", "concurrency permits renewed again")

    def recheck_ms(self) -> int:
        """The fallback delay of a task waiting for a permit, spread so waiters do not all return at once."""
        return int(self.recheck_s * 1000 * random.uniform(0.5, 1.0))

    def _wake(self, woken: Sequence[Waiter]) -> None:
        for waiter in woken:
            try:
                self.broker.limits.wake(waiter)
            except RedisError as exc:  # the waiter's fallback due time brings it back anyway
                logger.warning("could not wake a task waiting for a permit on queue %s: %s", waiter.queue, exc)
