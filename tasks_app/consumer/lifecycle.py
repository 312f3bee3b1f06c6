"""A consumer process: claimer threads feed a bounded pool of workers; its start, its graceful stop, its signals."""

from __future__ import annotations

import copy
import logging
import queue as queue_module
import threading
import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import redis
from django.conf import settings
from django.db import close_old_connections
from redis.exceptions import RedisError

from tasks_app import metrics, tracing
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.async_lane import AsyncLane
from tasks_app.consumer.claiming import Capacity, Claimed, ClaimerLoop, HeldTasks, OneClaimer, return_unstarted
from tasks_app.consumer.executor import Executor, RateGate
from tasks_app.consumer.gates import ConcurrencyGate, RateLimiter
from tasks_app.consumer.loops import (
    GaveUp,
    HousekeepingLoop,
    IdleCheck,
    Liveness,
    Loop,
    Misconfigured,
    SchedulerLoop,
    Ticker,
    misconfiguration,
    start_thread,
    until_done,
)
from tasks_app.consumer.membership import (
    HEARTBEAT_TIMEOUT_SHARE,
    LeaseClock,
    Membership,
    ReaperLoop,
    RetiringIds,
    default_consumer_id,
    process_info,
    wait_until_free,
)
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.periodic_loop import scheduler_loops
from tasks_app.consumer.settling import record_reaped
from tasks_app.consumer.supervisor import ProcessGuard, exit_within_s, install_stop_signals
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.queue import WaitConnection
from tasks_app.protocol.tracking import CHANGE_WAIT_S, Changes, ClusterKeyChanges, KeyChanges
from tasks_app.registry import Registry, registry as default_registry
from tasks_app.task_types import TaskTypeCache

logger = logging.getLogger(__name__)

HEALTH_CHECK_S = 10.0
TIME_LIMITS_TICK_S = 0.1
INTERRUPT_AGAIN_S = 0.2  # how often a stop cuts the blocking claims short again
EXIT_MISCONFIGURED = 78  # EX_CONFIG: a key of ours that it starts with is misconfigured
LEASE_WAIT_S = 0.05  # how often a worker holding a task looks again whether the lease was renewed


class Consumer:
    """One consumer process: claims, runs, acknowledges, heartbeats, reaps and schedules."""

    def __init__(
        self,
        options: ConsumerOptions,
        *,
        registry: Registry = default_registry,
        broker: Broker | None = None,
        heartbeat_broker: Broker | None = None,
        rate_gate: RateGate | None = None,
    ) -> None:
        options.validate()
        self.options = options
        broker = broker or Broker.from_settings(resend=False)  # a lost claim reply is ours to reconcile
        # A broker carries its consumer's instance token with every settle: never shared by two consumers.
        self.broker = copy.copy(broker) if broker.queue.instance else broker
        # Its own connection, so busy workers never delay it; a hung renewal fails well within the lease.
        self.heartbeat_broker = heartbeat_broker or Broker.from_settings(
            prefix=self.broker.keys.prefix, timeout_s=options.lease_s * HEARTBEAT_TIMEOUT_SHARE, resend=False
        )
        # Sent with the lease, each renewal and each settle: another process registering this id refuses ours.
        self.instance = self.broker.queue.instance = uuid.uuid4().hex
        base_id = options.consumer_id or default_consumer_id()  # a lost lease moves it on to <base>.<n>
        self.capacity = Capacity(options.concurrency, options.prefetch)
        self.held = HeldTasks(self.capacity)
        self.task_types = TaskTypeCache(age_gauge=metrics.TASK_TYPES_AGE)
        self.work: queue_module.SimpleQueue[Claimed] = queue_module.SimpleQueue()
        self.stop_requested, self.claiming_stopped = threading.Event(), threading.Event()
        self.loops_stopped, self.workers_stop, self.give_up = threading.Event(), threading.Event(), threading.Event()
        self._claimers: list[threading.Thread] = []
        self._blocking: list[ClaimerLoop] = []  # the claimers whose blocking waits a stop cuts short
        self._changes: list[Changes] = []  # tracked connections
        self._loops: list[threading.Thread] = []
        self._busy, self._busy_lock = 0, threading.Lock()
        self.exit_code = 0  # what `leave` asks for (process mode)
        self.acks = AckBatcher(self.broker, self.give_up, together=self.held.together)
        concurrency = ConcurrencyGate(
            self.broker, self.heartbeat_broker, options.lease_s, settings.TASKS_THROTTLE_RECHECK_S, self.give_up
        )
        self.lease = LeaseClock(options.lease_s, on_renewal=concurrency.renew)
        self.executor = Executor(
            self.broker,
            registry,
            self.task_types,
            base_id,
            settings.TASKS_RESULT_TTL,
            rate_gate=rate_gate or RateLimiter(self.broker, self.give_up, follows=self.task_types),
            give_up=self.give_up,
            acks=self.acks,
            concurrency=concurrency,
            async_lane=AsyncLane(options.async_concurrency, self.capacity, self.claiming_stopped.is_set),
            lease_check=self._lease_holds,  # again after the gates, just before the start
            trace_links=settings.TASKS_TRACE_PROPAGATION == tracing.LINK,
        )
        self.time_limits = self.executor.time_limits
        self.guard = ProcessGuard(options, self.time_limits.fail_hung, self.leave)
        self.misconfigured = Misconfigured()
        stale_after_s = max(2 * HEALTH_CHECK_S, options.lease_s)
        self.liveness = Liveness(options.health_file, stale_after_s, self.task_types.age_s, self.misconfigured.loops)
        recorder = partial(record_reaped, self.broker, self.task_types, give_up=self.stop_requested)
        self.reaper = ReaperLoop(self.broker, options.queues, options.lease_s, recorder)
        self.retiring = RetiringIds(self.heartbeat_broker, options.lease_s, self.held.raws, self.instance)
        self.membership = Membership(
            self.broker,
            self.heartbeat_broker,
            options.queues,
            self.lease,
            base_id,
            reaper=self.reaper,
            retiring=self.retiring,
            info=partial(process_info, options, self.capacity.prefetch_max, self.instance),
            instance=self.instance,
            give_up=self.give_up,
            on_new_id=partial(setattr, self.executor, "worker_id"),  # its settles name the new id
        )
        self._queues_idle = IdleCheck(self.broker, options.queues, lambda: self.membership.current()[1])

    def claimer(self, queue: str, claims: Broker | None = None, waits: WaitConnection | None = None) -> ClaimerLoop:
        """The claimer of one of its queues (see ClaimerLoop)."""
        return ClaimerLoop(
            queue,
            self.broker,
            held=self.held,
            membership=self.membership,
            types_loaded=lambda: self.task_types.loaded,
            dispatch=self.dispatch,
            block_s=self.options.block_s,
            claims=claims,
            waits=waits,
        )

    def _key_changes(self, *names: str) -> Changes | None:
        """What tells a loop of changes to the keys `names` of its queues; None where Redis cannot tell (a fake)."""
        client: Any = self.broker.client
        changes: Changes
        if isinstance(client, redis.RedisCluster):
            keys = self.broker.keys
            changes = ClusterKeyChanges(
                client, [getattr(keys, name)(queue) for queue in self.options.queues for name in names]
            )
        elif KeyChanges.trackable(client):
            changes = KeyChanges(client)
        else:
            return None
        self._changes.append(changes)
        return changes

    def _start_claiming(self) -> None:
        """One claimer thread for every queue, told of changes by Redis; on one queue, a blocking claimer."""
        queues = self.options.queues
        # Tracking tells every idle consumer of a push, where a blocking move wakes only one: on one queue it wins.
        changes = self._key_changes("pending", "prioritized", "suspects", "paused") if len(queues) > 1 else None
        if changes is None:
            if self.options.weights:
                logger.warning("--weight has no effect here: each queue has a claimer of its own")
            # On one server a stop cuts a blocking claim short, so an idle claimer may wait long.
            one_server = KeyChanges.trackable(self.broker.client)
            claimers = [
                self.claimer(queue, waits=WaitConnection(self.broker.client) if one_server else None)
                for queue in queues
            ]
            self._blocking = [claimer for claimer in claimers if claimer.waits is not None]
            self._claimers = [start_thread(loop, self.claiming_stopped, self.misconfigured) for loop in claimers]
            return
        claims = self.broker.over(changes.client)
        claimers = [self.claimer(queue, claims) for queue in queues]
        one = OneClaimer(claimers, changes, self.capacity, self.misconfigured, self.options.weights)
        self._claimers = [start_thread(one, self.claiming_stopped, self.misconfigured)]

    @property
    def consumer_id(self) -> str:
        """The id it claims under: the one registered last."""
        return self.membership.consumer_id

    def dispatch(self, claimed: Sequence[Claimed]) -> None:
        """Hand claimed tasks to the workers (or straight back, if we are stopping)."""
        self.held.took(claimed)
        if self.claiming_stopped.is_set():
            self._return_unstarted(list(claimed))
            return
        for item in claimed:
            self.work.put(item)

    def _work(self) -> None:
        while not self.workers_stop.is_set():
            try:
                claimed = self.work.get(timeout=0.2)
            except queue_module.Empty:
                continue
            if not self._lease_holds(claimed):  # claimed under an id whose lease was lost: the reaper's now
                self.held.finished([claimed])
                continue
            with self._busy_lock:  # read where the stop counts the running: it waits for this run, or we see it
                stopping = self.claiming_stopped.is_set()
                self._busy += not stopping
            if stopping:
                self._return_unstarted([claimed])
                continue
            # A task whose ack the batcher writes keeps its room until then (see ack_batcher).
            left_to_batcher = False
            try:
                left_to_batcher = self.executor.execute(claimed, on_settled=partial(self.held.finished, [claimed]))
            except GaveUp:
                logger.error("gave up settling a task while stopping; its lease will recover it")
            except BaseException:  # a bug must not kill the worker: the task stays held until reaped
                logger.exception("unexpected error running a task")
            finally:
                with self._busy_lock:
                    self._busy -= 1
                if not left_to_batcher:
                    self.held.finished([claimed])
                close_old_connections()
                self.guard.ran_one()

    def _lease_holds(self, claimed: Claimed) -> bool:
        """Wait while the lease may have lapsed; True once it surely holds for `claimed`'s identity."""
        while (
            not self.lease.fresh(claimed.consumer_id)
            and claimed.consumer_id == self.consumer_id
            and not self.claiming_stopped.is_set()
            and not self.workers_stop.is_set()
        ):
            self.workers_stop.wait(LEASE_WAIT_S)
        return claimed.consumer_id == self.consumer_id and self.lease.fresh(claimed.consumer_id)

    def _return_unstarted(self, claimed: list[Claimed], give_up: threading.Event | None = None) -> None:
        try:
            return_unstarted(self.broker, claimed, settings.TASKS_RESULT_TTL, give_up or self.give_up)
        except GaveUp:
            logger.error("could not return %d unstarted task(s); the lease will recover them", len(claimed))
        self.held.finished(claimed)

    def start(self) -> None:
        """Register and start every thread."""
        self.task_types.refresh()
        self.guard.start()  # beating already: a child waiting for Redis is not wedged
        # A stop asked for while Redis is away, or the id is another live process's, ends the wait.
        wait_until_free(self.broker, self.options.queues, self.consumer_id, self.stop_requested, self.liveness.beat)
        until_done(self.membership.register, what="register", give_up=self.stop_requested)
        opts = self.options
        loops: list[Loop] = [
            self.membership,  # the heartbeat
            Ticker("registering", opts.lease_s / 3, self.membership.list_again),
            SchedulerLoop(self.broker, opts.queues, types=self.task_types, changes=self._key_changes("delayed")),
            self.reaper,
            self.retiring,
            HousekeepingLoop(self.task_types.refresh, settings.TASKS_CONFIG_REFRESH_S, self.time_limits.tick),
            # On a thread that waits on no Redis reply: an outage delays neither a TaskTimeout nor a hard limit.
            Ticker("time-limits", TIME_LIMITS_TICK_S, self.time_limits.expire_overdue, self.guard.enforce_hard_limits),
            Ticker("health", HEALTH_CHECK_S, self.broker.inspect.ping, self.liveness.beat),  # alive once Redis answers
            *scheduler_loops(self.broker, opts),
        ]
        self._loops = [start_thread(loop, self.loops_stopped, self.misconfigured) for loop in loops]
        self.acks.start()
        self._start_claiming()
        for i in range(opts.concurrency):
            threading.Thread(target=self._work, name=f"worker-{i}", daemon=True).start()
        logger.info(
            "consumer %s started: queues=%s concurrency=%d prefetch=%s lease=%gs",
            self.consumer_id,
            ",".join(opts.queues),
            opts.concurrency,
            opts.prefetch if opts.prefetch is not None else f"auto (up to {self.capacity.prefetch_max})",
            opts.lease_s,
        )

    def run(self) -> int:
        """Run until stopped (or, in burst mode, until the queues are idle); return the exit code."""
        try:
            self.start()
        except GaveUp:
            logger.warning("consumer %s stopped before it could register", self.consumer_id)
            exit_code = self.exit_code
        except RedisError as exc:
            if not misconfiguration(exc):
                raise
            message = "consumer %s cannot start: a key of ours holds what Redis refuses (misconfigured): %s"
            logger.error(message, self.consumer_id, exc)
            exit_code = EXIT_MISCONFIGURED
        else:
            while not self.stop_requested.wait(0.2):
                if self.options.burst and self._idle():
                    logger.info("burst: nothing left to claim on queues %s; stopping", ",".join(self.options.queues))
                    break
            return self.shutdown()
        self.guard.stop()
        return exit_code

    def _idle(self) -> bool:
        with self._busy_lock:
            busy = self._busy
        return not busy and self.work.empty() and self._queues_idle()

    def request_stop(self) -> None:
        """Ask for a graceful stop (what SIGTERM and SIGINT do)."""
        self.stop_requested.set()

    def leave(self, exit_code: int, reason: str) -> None:
        """Stop claiming now and stop gracefully, exiting with `exit_code` (process mode: see supervisor.py)."""
        if self.stop_requested.is_set():
            return  # already stopping: the first reason (or a signal's graceful stop) stands
        self.exit_code = exit_code
        self.claiming_stopped.set()
        self.stop_requested.set()
        logger.warning("consumer %s stopping (exit code %d): %s", self.consumer_id, exit_code, reason)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop gracefully; a second signal exits at once (in process mode: its supervisor kills it)."""
        install_stop_signals(
            self.request_stop, self.options.grace_s, supervised=self.options.supervisor_beat is not None
        )

    def shutdown(self) -> int:
        """Stop claiming, return unstarted tasks, let running ones finish within the grace period, then give up on
        those still running (each uses an attempt). With Redis away, the lease recovers what could not be returned."""
        grace_over = threading.Event()
        timer = threading.Timer(self.options.grace_s, grace_over.set)
        timer.daemon = True
        timer.start()
        self.claiming_stopped.set()
        self._interrupt_claims()
        self._return_queued(grace_over)
        while self._running() > 0 and not grace_over.wait(0.05):
            pass
        if still_running := self._running():
            # No retry of theirs is due before this process is surely gone (as after a hard limit).
            interrupted = self.time_limits.interrupt_running(self.options.grace_s, exit_within_s(self.options))
            message = (
                "grace period over with %d task(s) still running: %d run(s) given up on, each failed with "
                "TaskInterrupted (an attempt used)"
            )
            logger.warning(message, still_running, interrupted)
        joined_by = time.monotonic() + self.options.block_s + 1
        for thread in self._claimers:  # a claim landing meanwhile is returned by `dispatch`
            while thread.is_alive() and time.monotonic() < joined_by:
                self._interrupt_claims()  # again: a wait may have begun after the last interrupt
                thread.join(timeout=INTERRUPT_AGAIN_S)
        self._return_queued(grace_over)  # dispatched as the stop began
        timer.cancel()
        # The runs given up on are settled, then finished tasks acked (not returned), within one wait for Redis.
        writes_by = time.monotonic() + self.options.grace_s + 5
        self.time_limits.wait_hung_settled(timeout_s=self.options.grace_s + 5)  # their failures go before deregistering
        self.workers_stop.set()
        self.acks.close(timeout_s=max(0.0, writes_by - time.monotonic()))
        self.loops_stopped.set()
        self.give_up.set()
        self.membership.leave()
        try:
            self.retiring.renew(leaving=True)
        except Exception as exc:
            logger.error("could not deregister the ids left after a lost lease (their leases will expire): %s", exc)
        self.guard.stop()
        self.executor.async_lane.close()
        # The tracked connections are closed once no loop waits on them (one held by Redis is left to the exit).
        joined_by = time.monotonic() + 2 * CHANGE_WAIT_S
        for thread in self._loops:
            thread.join(timeout=max(0.0, joined_by - time.monotonic()))
        if not any(thread.is_alive() for thread in self._loops):
            for changes in self._changes:
                changes.close()
        for claimer in self._blocking:
            if claimer.waits is not None:
                claimer.waits.close()
        logger.info("consumer %s stopped", self.consumer_id)
        return self.exit_code

    def _interrupt_claims(self) -> None:
        for claimer in self._blocking:
            claimer.interrupt()

    def _running(self) -> int:
        """The runs still going, those of hung handlers aside (given up on already)."""
        with self._busy_lock:
            return self._busy + self.executor.async_lane.running - self.time_limits.hung()

    def _return_queued(self, grace_over: threading.Event) -> None:
        """Return the tasks handed to the workers that none has taken yet."""
        unstarted: list[Claimed] = []
        while True:
            try:
                unstarted.append(self.work.get_nowait())
            except queue_module.Empty:
                break
        if unstarted:
            self._return_unstarted(unstarted, grace_over)
