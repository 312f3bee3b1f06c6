"""A consumer's background loops, how they ride out Redis outages, its liveness and readiness, and its HTTP endpoint.

A pass failing on a misconfigured key is said once and makes `/readyz` red until one passes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, ClassVar, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.conf import settings
from django.db import close_old_connections
from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.registry import CollectorRegistry
from redis.exceptions import RedisError, ResponseError

from tasks_app import metrics
from tasks_app.collectors import QueueCollector
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import finite
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.protocol.scripts import is_transient
from tasks_app.protocol.tracking import CHANGE_WAIT_S, Changes
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig

logger = logging.getLogger(__name__)


# --- the loops -------------------------------------------------------------------------------------
class Loop(Protocol):
    """One duty of a consumer: `run_once()` does a bit of it and says how long to sleep."""

    # One that renews a lease sets `max_backoff_s`: backing off past a lease would get a live consumer reaped.
    name: str

    def run_once(self) -> float: ...


class Misconfigured:
    """The loops whose last pass failed on a key of ours that Redis refuses (another type): not ready meanwhile."""

    def __init__(self) -> None:
        self._loops: set[str] = set()
        self._lock = threading.Lock()

    def note(self, loop: str, *, failed: bool) -> None:
        """Note whether `loop`'s last pass failed on a misconfigured key."""
        if failed or loop in self._loops:  # (no lock taken on the common path)
            with self._lock:
                (self._loops.add if failed else self._loops.discard)(loop)

    def failed(self, loop: str, exc: BaseException, problems: ProblemLog[str]) -> None:
        """Note that `loop`'s pass failed on a misconfigured key, said once through `problems`."""
        message = "%s: a key of ours holds what Redis refuses (misconfigured): %s"
        problems.failed(loop, str(exc), message, loop, exc, level=logging.ERROR)
        self.note(loop, failed=True)

    def loops(self) -> list[str]:
        """The loops whose last pass failed on a misconfigured key."""
        with self._lock:
            return sorted(self._loops)


def misconfiguration(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command for what a key holds: retrying cannot help, fixing the key does."""
    return isinstance(exc, ResponseError) and not is_transient(exc)


# A loop whose pass failed on a misconfigured key, and whose last pass asked for no sleep, waits this long.
MISCONFIGURED_PACE_S = 1.0


def run_forever(loop: Loop, stop: threading.Event, misconfigured: Misconfigured | None = None) -> None:
    """Call `loop.run_once()` until `stop` is set, backing off through Redis outages."""
    backoff_s, pace_s = 0.0, MISCONFIGURED_PACE_S
    max_backoff_s = getattr(loop, "max_backoff_s", MAX_BACKOFF_S)
    problems: ProblemLog[str] = ProblemLog(logger)  # an outage or a bug is met at every pass: said once
    misconfigured = misconfigured or Misconfigured()
    while not stop.is_set():
        try:
            sleep_s = loop.run_once()
            backoff_s, pace_s = 0.0, sleep_s or MISCONFIGURED_PACE_S
            problems.recovered(loop.name, "%s: works again", loop.name)
            misconfigured.note(loop.name, failed=False)
        except RedisError as exc:
            if misconfiguration(exc):
                misconfigured.failed(loop.name, exc, problems)
                sleep_s = pace_s
            else:
                sleep_s = backoff_s = next_backoff_s(backoff_s, max_backoff_s)
                metrics.REDIS_ERRORS.labels(loop.name).inc()
                message = "%s: redis error: %s; retrying in %.1f s"
                problems.failed(loop.name, "redis", message, loop.name, exc, sleep_s)
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


class SchedulerLoop:
    """Moves due delayed tasks into pending, trims dead letters, samples backlogs; idle and tracked, it is silent."""

    name = "scheduler"
    MAX_SLEEP_S = 0.25
    BATCH = 1000
    # Its chores, each this often (s): backlog samples (the chart has a point a minute), dead-letter trims, and
    # the history index keys' time to live (a key a result write made without one gets it within ten minutes).
    # Each period one consumer of the same queues does a chore: the first to take its turn.
    CHORES_EVERY_S: ClassVar[dict[str, float]] = {"backlog": 45.0, "dead-letters": 60.0, "history-ttl": 600.0}

    def __init__(
        self,
        broker: Broker,
        queues: Sequence[str],
        *,
        types: TaskTypeCache | None = None,
        changes: Changes | None = None,
    ) -> None:
        self.broker = broker
        self.queues = list(queues)
        # Tasks deferred while their type was disabled wake once the settings are read, then as a type is enabled.
        self.types = types
        self._wake = types is not None
        if types is not None:
            types.on_change.append(self._type_changed)
        self.dead_letter_max = settings.TASKS_DEAD_LETTER_MAX
        self.dead_letter_max_age_s = settings.TASKS_DEAD_LETTER_MAX_AGE_S
        self._chores_at = dict.fromkeys(self.CHORES_EVERY_S, float("-inf"))
        self.result_ttl_s = int(settings.TASKS_RESULT_TTL)
        self.changes = changes
        self._promotions = broker if changes is None else broker.over(changes.client)
        self._queue_of = {broker.keys.delayed(queue).encode(): queue for queue in self.queues}
        self._due = dict.fromkeys(self.queues, 0.0)  # when each queue is looked at next (monotonic s)

    def run_once(self) -> float:
        now = time.monotonic()
        sleep_s = self.MAX_SLEEP_S
        for queue in self.queues:
            if self._due[queue] > now:
                continue
            promotion = self._promotions.queue.promote_due(queue, self.BATCH)
            if promotion.malformed:
                metrics.TASKS_DEAD_LETTERED.labels(UNDECODABLE_TYPE, queue).inc(promotion.malformed)
                logger.warning("%d malformed delayed member(s) of queue %s dead-lettered", promotion.malformed, queue)
            if promotion.moved + promotion.malformed >= self.BATCH:
                wait_s = 0.0
            elif promotion.next_due_ms >= 0:
                wait_s = max(0.0, (promotion.next_due_ms - promotion.now_ms) / 1000)
            else:
                wait_s = math.inf  # nothing delayed: told when a task is (tracked), else looked at within MAX_SLEEP_S
            sleep_s = min(sleep_s, wait_s)
            if self.changes is not None:
                self._due[queue] = now + wait_s
        if self._wake and self.types is not None and self.types.loaded:
            self._wake = False  # a change seen while it wakes sets it again
            try:
                for queue in self.queues:
                    self.broker.limits.wake_enabled(queue, disabled=self.types.disabled)
            except BaseException:
                self._wake = True
                raise
        if self._chore_due("backlog"):
            for queue in self.queues:
                self.broker.inspect.sample_backlog(queue)
        if self._chore_due("dead-letters"):
            self.trim_dead_letters()
        if self._chore_due("history-ttl"):
            for queue in self.queues:
                self.broker.records.refresh_history_ttl(queue, ttl_s=self.result_ttl_s)
        if self.changes is None:
            return sleep_s
        next_chore_at = min(at + self.CHORES_EVERY_S[chore] for chore, at in self._chores_at.items())
        wait_s = min(min(self._due.values()), next_chore_at) - time.monotonic()
        if wait_s > 0:
            changed = self.changes.changed(min(wait_s, CHANGE_WAIT_S))
            told = self.queues if changed is None else [self._queue_of[key] for key in changed if key in self._queue_of]
            self._due.update(dict.fromkeys(told, 0.0))
        return 0.0

    def _type_changed(self, config: TaskTypeConfig) -> None:
        """Enabled again, or its row deleted (its tasks then run or are dead-lettered): wake what it deferred."""
        if config.enabled or (self.types is not None and self.types.get(config.name) is None):
            self._wake = True

    def _chore_due(self, chore: str) -> bool:
        """Whether `chore` is due and this consumer's turn; once due, it counts as done now (by us or another)."""
        now = time.monotonic()
        every_s = self.CHORES_EVERY_S[chore]
        if now - self._chores_at[chore] < every_s:
            return False
        self._chores_at[chore] = now
        return self.broker.leases.take_turn(chore, self.queues, int(every_s * 1000))

    def trim_dead_letters(self) -> int:
        """Apply the dead-letter caps (count and age) to every queue; return how many were dropped."""
        trim = self.broker.inspect.trim_dead
        return sum(trim(q, max_count=self.dead_letter_max, max_age_s=self.dead_letter_max_age_s) for q in self.queues)


class HousekeepingLoop:
    """Reloads task type settings (then lets go of a stale database connection) and watches running tasks."""

    name = "housekeeping"
    TICK_S = 0.1

    def __init__(self, refresh: Callable[[], object], refresh_every_s: float, watch: Callable[[], object]) -> None:
        self.refresh = refresh
        self.refresh_every_s = refresh_every_s
        self.watch = watch
        self._refreshed_at = float("-inf")

    def run_once(self) -> float:
        if time.monotonic() - self._refreshed_at >= self.refresh_every_s:
            self.refresh()
            close_old_connections()
            self._refreshed_at = time.monotonic()
        self.watch()
        return self.TICK_S


class Ticker:
    """A loop that makes its calls, in order, every `every_s`."""

    def __init__(self, name: str, every_s: float, *calls: Callable[[], object]) -> None:
        self.name = name
        self.every_s = every_s
        self.calls = calls

    def run_once(self) -> float:
        for call in self.calls:
            call()
        return self.every_s


# --- Redis outages ---------------------------------------------------------------------------------
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Failures in a row, with Redis answering PING, after which a write is taken as refused (not 1: a cluster
# failing over answers PING yet refuses writes for seconds).
REFUSED_AFTER = 3
# Per `what`, the outage a retried call met, said once.
_OUTAGES: ProblemLog[str] = ProblemLog(logger)


class GaveUp(Exception):
    """Redis stayed away until the caller was told to stop."""


class WriteRefused(Exception):
    """A write kept failing on the wire while Redis answered other commands: it is the write."""


def next_backoff_s(previous_s: float, max_s: float = MAX_BACKOFF_S) -> float:
    """Double the previous wait, with jitter, capped at `max_s`."""
    return min(max_s, max(FIRST_BACKOFF_S, previous_s * 2)) * random.uniform(0.8, 1.2)


def until_done[T](
    call: Callable[[], T],
    *,
    what: str,
    give_up: threading.Event,
    refused_after: int = 0,
    redis_answers: Callable[[], bool] = lambda: False,
) -> T:
    """Run `call` until Redis accepts it; raise GaveUp once `give_up` is set."""
    backoff_s = 0.0
    failures = 0
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            if refused_after and failures >= refused_after and redis_answers():
                raise WriteRefused(f"{what} failed {failures} times while Redis answered: {exc}") from exc
            metrics.REDIS_ERRORS.labels(what).inc()
            backoff_s = next_backoff_s(backoff_s)
            _OUTAGES.failed(what, "redis", "redis error during %s: %s; retrying in %.1f s", what, exc, backoff_s)
            if give_up.wait(backoff_s):
                raise GaveUp(what) from exc
        else:
            if failures:
                _OUTAGES.recovered(what, "%s works again", what)
            return result


# --- liveness and readiness ------------------------------------------------------------------------
def touch(path: Path, problems: ProblemLog[str], what: str) -> None:
    """Give `path` a fresh mtime, saying once (as an error) while it cannot be touched."""
    try:
        path.touch()
    except OSError as exc:
        problems.failed(what, repr(exc), "cannot touch the %s %s: %s", what, path, exc, level=logging.ERROR)
        return
    problems.recovered(what, "%s %s touched again", what, path)


class Liveness:
    """When a consumer last reached Redis (mirrored to a file's mtime if asked), and whether it may claim."""

    def __init__(
        self,
        path: str | None,
        stale_after_s: float,
        task_types_age_s: Callable[[], float] | None = None,
        misconfigured: Callable[[], list[str]] | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.stale_after_s = stale_after_s
        self._last_ok = float("-inf")
        self._task_types_age_s = task_types_age_s or (lambda: 0.0)
        self._misconfigured = misconfigured or list
        self._file_problem: ProblemLog[str] = ProblemLog(logger)  # met at every beat while it lasts

    def beat(self) -> None:
        """Record a successful check now, and touch the health file (one it cannot touch goes stale)."""
        self._last_ok = time.monotonic()
        if self.path is not None:
            touch(self.path, self._file_problem, "health file")

    def age_s(self) -> float:
        """Seconds since the last successful check (infinite before the first)."""
        return time.monotonic() - self._last_ok

    def healthy(self) -> bool:
        """True while the last successful check is recent enough."""
        return self.age_s() <= self.stale_after_s

    def ready(self) -> bool:
        """True while healthy and able to claim: the task types were read at least once, no loop is misconfigured."""
        return self.healthy() and self._task_types_age_s() != float("inf") and not self._misconfigured()

    def report(self) -> bytes:
        """A JSON body describing the state, for `/healthz` and `/readyz` on the metrics port."""
        return json.dumps(
            {
                "status": "ok" if self.healthy() else "unavailable",
                "last_ok_age_s": finite(round(self.age_s(), 3)),  # JSON has no infinity: None before the first
                "ready": self.ready(),
                "task_types_age_s": finite(round(self._task_types_age_s(), 3)),
                "misconfigured": self._misconfigured(),
            }
        ).encode()


# --- burst mode ------------------------------------------------------------------------------------
class IdleCheck:
    """Whether a burst consumer's queues are idle, asked at every tick: False while Redis is away (said once)."""

    def __init__(self, broker: Broker, queues: Sequence[str], claimable: Callable[[], Collection[str]]) -> None:
        self.broker = broker
        self.queues = list(queues)
        self.claimable = claimable  # the queues the consumer may claim from now
        self._problem: ProblemLog[str] = ProblemLog(logger)

    def __call__(self) -> bool:
        """True once no queue has tasks in flight and only those it may not claim from have tasks waiting."""
        try:
            claimable = self.claimable()
            stats = [self.broker.inspect.queue_stats(queue) for queue in self.queues]
        except Exception as exc:
            self._problem.failed("check", repr(exc), "burst: cannot check the queues: %s", exc)
            return False
        self._problem.recovered("check", "burst: the queues can be checked again")
        if any(s.processing or (s.queue in claimable and not s.paused and (s.pending or s.delayed)) for s in stats):
            return False
        for left in (s for s in stats if s.pending or s.delayed):
            if left.paused:
                message = "burst: queue %s is paused with %d task(s) pending and %d delayed; leaving them for a resume"
            else:
                message = (
                    "burst: queue %s has %d task(s) pending and %d delayed that this consumer cannot claim "
                    "(it is not registered there); leaving them"
                )
            logger.warning(message, left.queue, left.pending, left.delayed)
        return True


# --- the HTTP endpoint -----------------------------------------------------------------------------
StartResponse = Callable[..., Any]
# Metrics and health are served to this host only unless an address is given.
METRICS_HOST = "127.0.0.1"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow scrape never blocks a health check."""

    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    """The same on IPv6; bound to `::`, it takes IPv4 connections too (whatever the system's default)."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        """Bind, accepting IPv4 as well where the system allows it."""
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Do not log every scrape."""


def make_app(liveness: Liveness, registry: CollectorRegistry = REGISTRY) -> Callable[..., Iterable[bytes]]:
    """Return a WSGI app serving `/healthz` and `/readyz` from `liveness` and metrics on every other path."""
    metrics_app: Callable[..., Iterable[bytes]] = make_wsgi_app(registry)
    checks: dict[str, Callable[[Liveness], bool]] = {"/healthz": Liveness.healthy, "/readyz": Liveness.ready}

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics_app(environ, start_response)
        body = liveness.report()
        start_response(
            "200 OK" if check(liveness) else "503 Service Unavailable",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return app


def serve_consumer_metrics(
    liveness: Liveness, broker: Broker, queues: Sequence[str], port: int, addr: str = METRICS_HOST
) -> WSGIServer:
    """Serve metrics, with the depths of `queues`, and `liveness` on `addr:port` from a daemon thread."""
    addr = addr.removeprefix("[").removesuffix("]")  # [::1] as in a URL
    server_class = _ThreadingServer6 if ":" in addr else _ThreadingServer
    server = make_server(addr, port, make_app(liveness), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    # Registered once the port is bound: a port it cannot bind leaves nothing registered.
    REGISTRY.register(QueueCollector(lambda: broker, list(queues)))
    return server
