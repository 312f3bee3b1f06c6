"""Queue depths, live consumers and what a scaler needs, read from Redis when Prometheus scrapes (no polling thread)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tasks_app import metrics
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.inspection import QueueStats
from tasks_app.protocol.keys import NAME_PATTERN

logger = logging.getLogger(__name__)

STATES = ("pending", "processing", "delayed", "dead")
# More queues than this are not exported: cardinality stays bounded whatever producers do.
MAX_QUEUES = 200

# What one read gives: the stats of each queue, and the server's ms they were read at.
Read = tuple[list[QueueStats], int]
# The scaler's gauges: the QueueStats field each exports, after the family name's suffix.
SCALER_GAUGES = {
    "waiting": (
        "queue_waiting_tasks",
        "Tasks a free worker could start now: pending, prioritized, recovered and due delayed ones.",
    ),
    "in_flight": ("queue_in_flight_tasks", "Tasks claimed by consumers whose lease is alive, running or about to."),
    "oldest_waiting_age_s": (
        "queue_oldest_waiting_age_seconds",
        "How long the longest-waiting of the next tasks of pending, prioritized, recovered and due delayed has waited.",
    ),
    "workers": ("queue_workers", "Worker threads (--concurrency) of the consumers whose lease is alive, summed."),
}


class QueueCollector(Collector):
    """Export per-queue task counts by state and live consumers, read at scrape time."""

    def __init__(self, broker: Callable[[], Broker], queues: Sequence[str] = (), timeout_s: float = 2.0) -> None:
        self.broker = broker
        self.queues = list(queues)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-collector")
        self._pending: Future[Read] | None = None
        self._lock = threading.Lock()
        self._problem: ProblemLog[str] = ProblemLog(logger)  # Redis away at every scrape: said once

    def describe(self) -> list[GaugeMetricFamily]:
        """Name the families without touching Redis (registration must not do I/O)."""
        return list(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Read every known queue from Redis, within the time budget."""
        started = time.monotonic()
        depth, live, paused, up, duration, *scaler = self._families()
        read = self._read()
        stats, now_ms = read if read is not None else ([], 0)
        for item in stats:
            for state in STATES:
                depth.add_metric([item.queue, state], getattr(item, state))
            # A consumer past its deadline is dead even before a reaper has removed it.
            live.add_metric([item.queue], sum(1 for c in item.consumers if c["lease_deadline_ms"] > now_ms))
            paused.add_metric([item.queue], 1 if item.paused else 0)
            for family, field in zip(scaler, SCALER_GAUGES, strict=True):
                family.add_metric([item.queue], getattr(item, field))
        up.add_metric([], 0 if read is None else 1)
        duration.add_metric([], time.monotonic() - started)
        yield from (depth, live, paused, up, duration, *scaler)

    def _read(self) -> Read | None:
        with self._lock:
            if self._pending is None or self._pending.done():
                self._pending = self._pool.submit(self._read_all)
            pending = self._pending
        try:
            read = pending.result(timeout=self.timeout_s)
        except FutureTimeout:
            metrics.QUEUE_STATS_ERRORS.inc()
            self._problem.failed("read", "timeout", "queue stats: Redis did not answer within %.1f s", self.timeout_s)
        except Exception as exc:  # a scrape must never fail because Redis did
            metrics.QUEUE_STATS_ERRORS.inc()
            self._problem.failed("read", "error", "queue stats: cannot read Redis: %s", exc)
        else:
            self._problem.recovered("read", "queue stats read again")
            return read
        return None

    def _read_all(self) -> Read:
        broker = self.broker()
        # A name that breaks the naming rule (a foreign producer's) is no label: no consumer serves it.
        queues = sorted(
            set(self.queues) | {name for name in broker.inspect.known_queues() if NAME_PATTERN.fullmatch(name)}
        )
        now_ms = broker.inspect.server_time_ms()
        return [broker.inspect.queue_stats(queue, now_ms) for queue in queues[:MAX_QUEUES]], now_ms

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        prefix = metrics.PREFIX
        return (
            GaugeMetricFamily(
                f"{prefix}_queue_tasks",
                "Tasks in a queue by state (pending, processing, delayed, dead), read from Redis at scrape time.",
                labels=["queue", "state"],
            ),
            GaugeMetricFamily(
                f"{prefix}_consumers_live", "Consumers holding a live lease on a queue.", labels=["queue"]
            ),
            GaugeMetricFamily(
                f"{prefix}_queue_paused", "1 while a queue is paused (nothing is claimed from it).", labels=["queue"]
            ),
            GaugeMetricFamily(f"{prefix}_queue_stats_up", "1 if this scrape read the queue depths from Redis."),
            GaugeMetricFamily(f"{prefix}_queue_stats_duration_seconds", "Time this scrape spent reading Redis."),
            *(GaugeMetricFamily(f"{prefix}_{name}", text, labels=["queue"]) for name, text in SCALER_GAUGES.values()),
        )
