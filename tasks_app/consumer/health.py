"""A consumer's liveness (when it last reached Redis: a file's mtime, `/healthz`) and readiness (`/readyz`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.jsontext import finite

logger = logging.getLogger(__name__)


class Liveness:
    """When a consumer last reached Redis (mirrored to a file's mtime if asked), and whether it may claim."""

    def __init__(
        self,
        path: str | None,
        stale_after_s: float,
        task_types_age_s: Callable[[], float] | None = None,
        misconfigured: Callable[[], list[str]] | None = None,
    ) -> None:
        """`task_types_age_s`: seconds since the task types were read (infinite before: nothing is claimed then);
        `misconfigured`: the loops whose last pass failed on a key of ours of another type (see loops.py)."""
        self.path = Path(path) if path else None
        self.stale_after_s = stale_after_s
        self._last_ok = float("-inf")
        self._task_types_age_s = task_types_age_s or (lambda: 0.0)
        self._misconfigured = misconfigured or list
        self._file_problem: ProblemLog[str] = ProblemLog(logger)  # met at every beat while it lasts

    def beat(self) -> None:
        """Record a successful check now (and touch the health file, saying once if it cannot be)."""
        self._last_ok = time.monotonic()
        if self.path is None:
            return
        # Not the consumer's failure: one that cannot write it (no such directory, no permission) runs
        # on, and `/healthz` still answers; its liveness probe sees the stale file.
        try:
            self.path.touch()  # an existing file gets a fresh mtime
        except OSError as exc:
            message = "cannot touch the health file %s: %s"
            self._file_problem.failed("health file", repr(exc), message, self.path, exc, level=logging.ERROR)
            return
        self._file_problem.recovered("health file", "health file %s touched again", self.path)

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


class HealthLoop:
    """Pings Redis every few seconds and, when it answers, records the consumer as alive."""

    name = "health"

    def __init__(self, broker: Broker, liveness: Liveness, interval_s: float) -> None:
        self.broker = broker
        self.liveness = liveness
        self.interval_s = interval_s

    def run_once(self) -> float:
        self.broker.ping()
        self.liveness.beat()
        return self.interval_s
