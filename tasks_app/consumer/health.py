"""A consumer's liveness: when it last reached Redis, shown by a file's mtime and `/healthz` on its metrics port."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tasks_app.protocol.broker import Broker


class Liveness:
    """When a consumer last showed it can reach Redis; mirrored to a file's mtime if asked."""

    def __init__(self, path: str | None, stale_after_s: float) -> None:
        self.path = Path(path) if path else None
        self.stale_after_s = stale_after_s
        self._last_ok = float("-inf")

    def beat(self) -> None:
        """Record a successful check now (and touch the health file)."""
        self._last_ok = time.monotonic()
        if self.path is not None:
            self.path.touch()  # an existing file gets a fresh mtime

    def age_s(self) -> float:
        """Seconds since the last successful check (infinite before the first)."""
        return time.monotonic() - self._last_ok

    def healthy(self) -> bool:
        """True while the last successful check is recent enough."""
        return self.age_s() <= self.stale_after_s

    def report(self) -> bytes:
        """A JSON body describing the state, for `/healthz` on the metrics port."""
        age = self.age_s()
        return json.dumps(
            {
                "status": "ok" if self.healthy() else "unavailable",
                "last_ok_age_s": round(age, 3) if age != float("inf") else None,
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
