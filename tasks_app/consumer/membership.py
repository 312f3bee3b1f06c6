"""A consumer's membership of its queues: its identity, lease and heartbeat, registration, retiring ids, and the reaper.

A restarted `--consumer-id` waits for a live holder of that id (one of this host whose process is
gone is dead now). A consumer that lost its lease on some queues only takes a new id and renews the
old one where it still holds runs, so no reaper re-runs them while they go on.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence, Sized
from pathlib import Path
from typing import Any

from tasks_app import metrics
from tasks_app.consumer.loops import GaveUp, until_done
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.leases import LeaseHolder

logger = logging.getLogger(__name__)

# A renewal's socket timeouts, as a share of the lease: a hung renewal fails and is retried well within it.
HEARTBEAT_TIMEOUT_SHARE = 1 / 6
# Tasks start only while the last renewal is younger than the lease less this share of it.
LEASE_MARGIN_SHARE = 1 / 6


class LeaseClock:
    """When this consumer's lease was last renewed, and under which id, on the monotonic clock."""

    def __init__(self, lease_s: float, on_renewal: Callable[[], None] = lambda: None) -> None:
        self.lease_s = lease_s
        self.on_renewal = on_renewal  # renews what else lives under the lease (concurrency permits)
        # (consumer id, when last renewed), replaced whole: `fresh`, asked several times per task by every
        # worker, reads it without a lock (one held by a thread switched away from stalls every worker).
        self._renewal: tuple[str, float] = ("", float("-inf"))
        self._lock = threading.Lock()  # one renewal at a time

    def renewed(self, consumer_id: str, sent_at: float) -> None:
        """Record a successful renewal whose request left at `sent_at` (the lease runs from then, or later)."""
        with self._lock:
            current_id, renewed_at = self._renewal
            self._renewal = (consumer_id, sent_at if consumer_id != current_id else max(renewed_at, sent_at))
        self.on_renewal()

    def fresh(self, consumer_id: str) -> bool:
        """True while the lease of `consumer_id` surely holds: renewed less than lease - margin ago."""
        return self.fresh_for_s(consumer_id) > 0

    def fresh_for_s(self, consumer_id: str) -> float:
        """How long the lease of `consumer_id` surely holds from now without a renewal (s; 0 or less: not)."""
        current_id, renewed_at = self._renewal
        if consumer_id != current_id:
            return 0.0
        return renewed_at + self.lease_s * (1 - LEASE_MARGIN_SHARE) - time.monotonic()


class ReaperLoop:
    """Moves the tasks of consumers whose lease expired to their queue's suspects; never a live one's.

    On one server it looks at its queues only when the lease index says a deadline passed within the
    last lease, at its start, once a lease among the consumers of the same queues (tasks a late claim
    put in a reaped consumer's list, consumers that keep no index entry), and again after a look that
    left something to do.
    """

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
        self._tombstone_offsets = dict.fromkeys(self.queues, 0)
        self._look_by = float("-inf")  # when a look at every queue is due anyway (monotonic s)
        self._held_off = False  # a reap waited for live consumers to renew after a restart or failover

    def run_once(self) -> float:
        try:
            if self._look_due():
                self.look()
        except BaseException:
            self._look_by = float("-inf")  # Redis away, perhaps restarting: leases lapsed meanwhile are looked for
            raise
        return max(0.05, self.lease_s / 3)

    def _look_due(self) -> bool:
        leases = self.broker.leases
        if not leases.indexed or self._held_off or any(self._tombstone_offsets.values()):
            return True  # no index (Redis Cluster), reaping held off, or pages of tombstones still to go through
        if time.monotonic() >= self._look_by:
            first = self._look_by == float("-inf")
            self._look_by = time.monotonic() + self.lease_s
            # The look once a lease is one consumer's at a time among those of the same queues.
            if first or leases.take_turn("reaper", self.queues, int(self.lease_s * 1000)):
                return True
        return leases.lapsed_recently(int(self.lease_s * 1000)) > 0

    def look(self) -> None:
        """Look at every queue for expired consumers and tombstones with tasks, and reap them."""
        offsets = [self._tombstone_offsets[queue] for queue in self.queues]
        pages = self.broker.leases.reap_candidate_pages(self.queues, offsets)
        self._held_off = False
        for queue, (expired, tombstones, next_offset) in zip(self.queues, pages, strict=True):
            self._tombstone_offsets[queue] = next_offset
            for consumer_id in [*expired, *tombstones]:
                self.reap(queue, consumer_id)

    def reap(self, queue: str, consumer_id: str, *, own_earlier_run: bool = False) -> int:
        """Reap one consumer's list on one queue completely; return how many tasks moved."""
        moved = 0
        while True:
            outcome = self.broker.leases.reap(
                queue, consumer_id, int(self.lease_s * 1000), own_earlier_run=own_earlier_run
            )
            self._held_off = self._held_off or outcome.status == -2
            if outcome.status != 1:
                return moved
            moved += outcome.requeued + len(outcome.dead_lettered)
            if outcome.requeued:
                metrics.TASKS_RECOVERED.labels(queue).inc(outcome.requeued)
                message = "recovered %d task(s) of dead consumer %s on queue %s"
                logger.warning(message, outcome.requeued, consumer_id, queue)
            if outcome.dead_lettered:
                self.on_dead_lettered(queue, outcome.dead_lettered)
            if not outcome.remaining:
                return moved


# How often a consumer waiting for its id looks again whether the holder let go.
HOLDER_RECHECK_S = 0.25


def pid_namespace() -> str:
    """This process's pid namespace ("" where /proc does not say): pids compare only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def default_consumer_id() -> str:
    """`<host>-<pid>-<6 hex>`, the host's name cut to the characters an id may hold."""
    host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:120] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def process_info(options: ConsumerOptions, prefetch_max: int, instance: str) -> dict[str, Any]:
    """What a consumer registers beside its lease: who it is, and how it runs."""
    return {
        "instance": instance,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_ns": pid_namespace(),
        "started_at_ms": int(time.time() * 1000),
        "lease_ms": int(options.lease_s * 1000),
        "concurrency": options.concurrency,
        "prefetch": prefetch_max,
        "queues": options.queues,
    }


def holder_is_gone(info: dict[str, Any]) -> bool:
    """True if the holder registered from this host and pid namespace and its process no longer runs."""
    if info.get("host") != socket.gethostname() or info.get("pid_ns", "") != pid_namespace():
        return False
    pid: int = info["pid"]
    if pid == os.getpid():
        return True  # an earlier process that had this pid (a restarted container): it is not running now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    try:  # a zombie: killed, but not yet reaped by its parent
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def live_holders(broker: Broker, queues: Sequence[str], consumer_id: str) -> list[LeaseHolder]:
    """The lease entries of `consumer_id` that another process may still hold: fresh, and not known dead."""
    holders = broker.leases.lease_holders(queues, consumer_id)
    return [holder for holder in holders if holder.ms_left > 0 and not holder_is_gone(holder.info)]


def wait_until_free(
    broker: Broker, queues: Sequence[str], consumer_id: str, stop: threading.Event, reached: Callable[[], None]
) -> None:
    """Wait while another live process holds `consumer_id` on any of `queues`; raise GaveUp if `stop` is set."""
    waited = False
    while held := until_done(lambda: live_holders(broker, queues, consumer_id), what="register", give_up=stop):
        reached()
        if not waited:
            holder = held[0]
            logger.warning(
                "consumer id %s is held by a live process (pid %s on %s) with %.1f s of lease left on queue %s: "
                "waiting until it exits or its lease lapses",
                consumer_id,
                holder.info.get("pid", "?"),
                holder.info.get("host", "?"),
                holder.ms_left / 1000,
                holder.queue,
            )
            waited = True
        if stop.wait(HOLDER_RECHECK_S):
            raise GaveUp
    if waited:
        logger.warning("consumer id %s is free: starting", consumer_id)


class Membership:
    """A consumer's id, the queues it is registered on, and its lease there; `run_once` is the heartbeat."""

    name = "heartbeat"

    def __init__(
        self,
        broker: Broker,
        heartbeat_broker: Broker,
        queues: Sequence[str],
        lease: LeaseClock,
        base_id: str,
        *,
        reaper: ReaperLoop,
        retiring: RetiringIds,
        info: Callable[[], dict[str, Any]],
        instance: str,
        give_up: threading.Event,
        on_new_id: Callable[[str], None] = lambda new_id: None,
    ) -> None:
        self.broker = broker
        self.heartbeat_broker = heartbeat_broker
        self.queues = list(queues)
        self.lease = lease
        self.lease_ms = int(lease.lease_s * 1000)
        self.max_backoff_s = lease.lease_s / 6  # renewals are retried at twice their pace while Redis is away
        self.base_id = base_id
        self.reaper = reaper  # it recovers an earlier run's tasks too, as an id is registered
        self.retiring = retiring
        self.info = info
        self.instance = instance  # the token sent with each renewal (see heartbeat.lua)
        self.give_up = give_up
        self.on_new_id = on_new_id
        self._generation = 0  # of the ids taken after a lost lease
        self.lock = threading.RLock()
        self._current: tuple[str, tuple[str, ...]] = (base_id, ())  # replaced whole: read without the lock
        self._listed_at = float("-inf")  # when the queues were last added to the queue set (monotonic s)
        self._left = False  # once it left, a lease lost meanwhile registers no new id

    @property
    def consumer_id(self) -> str:
        """The id registered last (before the first registration: the one to register)."""
        return self._current[0]

    def current(self) -> tuple[str, list[str]]:
        """The id registered last, and the queues it is registered on."""
        consumer_id, queues = self._current
        return consumer_id, list(queues)

    def registered_on(self, queue: str) -> bool:
        """Whether the consumer holds a lease on `queue` under its id: claims there are recoverable."""
        return queue in self._current[1]

    def register(self, consumer_id: str | None = None) -> None:
        """Recover what an earlier run under `consumer_id` (default: the current) left, then register it everywhere."""
        with self.lock:
            consumer_id = consumer_id or self.consumer_id
            for queue in self.queues:
                if recovered := self.reaper.reap(queue, consumer_id, own_earlier_run=True):
                    message = "recovered %d task(s) left by an earlier run of %s on %s, which did not exit cleanly"
                    logger.warning(message, recovered, consumer_id, queue)
            sent_at = time.monotonic()
            self.broker.leases.register_leases(self.queues, consumer_id, self.lease_ms, self.info())
            self.lease.renewed(consumer_id, sent_at)
            self._current = (consumer_id, tuple(self.queues))
            self._listed_at = time.monotonic()

    def run_once(self) -> float:
        consumer_id, queues = self._current
        sent_at = time.monotonic()
        lost = self.heartbeat_broker.leases.renew_leases(queues, consumer_id, self.lease_ms, instance=self.instance)
        if not lost:
            self.lease.renewed(consumer_id, sent_at)
            metrics.LEASE_RENEWALS.inc()
        else:
            metrics.LEASES_LOST.inc()
            self.lease_lost(consumer_id, lost)
        return self.lease.lease_s / 3

    def list_again(self) -> None:
        """List the registered queues in the queue set again, once a lease."""
        registered = self._current[1]
        if registered and time.monotonic() - self._listed_at >= self.lease.lease_s:
            self.broker.leases.list_queues(registered)
            self._listed_at = time.monotonic()

    def lease_lost(self, lost_id: str, queues: Sequence[str] | None = None) -> None:
        """Our lease expired (or we were reaped) on `queues` (None: all): tombstone that id, register a new one."""
        with self.lock:
            registered_id, registered = self.current()
            lost_on = [queue for queue in registered if queues is None or queue in queues]
            if self._left or lost_id != registered_id or not lost_on:
                return  # another thread already moved on, or a claim raced its registration there
            self.retiring.retire(lost_id, [queue for queue in registered if queues and queue not in lost_on])
            self._generation += 1
            new_id = f"{self.base_id}.{self._generation}"
            message = "consumer %s lost its lease on %s (presumed dead there, or its renewal refused); continuing as %s"
            logger.error(message, lost_id, ",".join(lost_on), new_id)
            until_done(lambda: self.broker.leases.abandon(registered, lost_id), what="abandon", give_up=self.give_up)
            # Registered before it is the current id: a claim under it unregistered would be refused (and the id lost).
            until_done(lambda: self.register(new_id), what="register", give_up=self.give_up)
            self.on_new_id(new_id)

    def leave(self) -> None:
        """Leave every queue cleanly, where this run (`instance`) still holds the id; elsewhere the lease expires."""
        with self.lock:  # after a new id a lost lease is taking: registered after this, it would outlive the process
            self._left = True
            consumer_id, queues = self._current
        left_all = True
        for queue in queues:
            try:
                if self.broker.leases.deregister(queue, consumer_id, self.instance) < 0:
                    logger.warning("consumer id %s on %s is another process's now: left to it", consumer_id, queue)
                    left_all = False
            except Exception as exc:
                logger.error("could not deregister from %s (the lease will expire): %s", queue, exc)
                left_all = False
        if not left_all:
            return  # its lease index entry lapses, and reapers look at its queues
        try:
            self.broker.leases.unlist(consumer_id)
        except Exception as exc:
            logger.error("could not leave the lease index (reapers will look once its lease lapses): %s", exc)


class RetiringIds:
    """Renews a lost id's leases on the queues where it still holds tasks, and deregisters it once it holds none."""

    name = "retiring"

    def __init__(self, broker: Broker, lease_s: float, held: Callable[[str, str], Sized], instance: str = "") -> None:
        self.broker = broker
        self.lease_s = lease_s
        self.instance = instance
        self.held = held  # (queue, consumer id) -> the tasks this consumer holds, claimed under it there
        self.max_backoff_s = lease_s / 6  # renewals are retried at twice their pace while Redis is away
        self._queues: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def retire(self, consumer_id: str, queues: Sequence[str]) -> None:
        """Keep `consumer_id`'s lease on `queues` (where it was not lost) until its tasks there are settled."""
        if queues:
            with self._lock:
                self._queues[consumer_id] = list(queues)

    def run_once(self) -> float:
        self.renew()
        return self.lease_s / 3

    def renew(self, *, leaving: bool = False) -> None:
        """Deregister each retiring id where it holds nothing (everywhere, if `leaving`), renew it elsewhere."""
        with self._lock:
            retiring = {consumer_id: list(queues) for consumer_id, queues in self._queues.items()}
        for consumer_id, queues in retiring.items():
            held = [queue for queue in queues if not leaving and len(self.held(queue, consumer_id))]
            left = [queue for queue in queues if queue not in held]
            for queue in left:
                self.broker.leases.deregister(queue, consumer_id, self.instance)
            lease_ms = int(self.lease_s * 1000)
            lost = self.broker.leases.renew_leases(held, consumer_id, lease_ms, self.instance) if held else []
            if lost:
                logger.error("retiring id %s lost its lease on %s too: its runs there may run again", consumer_id, lost)
            with self._lock:
                self._queues[consumer_id] = [queue for queue in queues if queue not in left and queue not in lost]
                if not self._queues[consumer_id]:
                    del self._queues[consumer_id]
