"""Health checks: the web app's `/healthz` view and a consumer's liveness (file and HTTP)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from django.db import connections
from django.http import HttpRequest, JsonResponse

from .broker import Broker, get_broker

logger = logging.getLogger(__name__)


def check_web() -> dict[str, str]:
    """Check the database and Redis; map each to "ok" or the error met (which is also logged)."""
    checks: dict[str, str] = {}
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {exc}"
    try:
        get_broker().ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {exc}"
    for name, state in checks.items():
        if state != "ok":
            logger.warning("health check: %s %s", name, state)
    return checks


def healthz(request: HttpRequest) -> JsonResponse:
    """Answer 200 when the database and Redis are reachable, else 503; only staff see each check's state."""
    checks = check_web()
    healthy = all(state == "ok" for state in checks.values())
    body: dict[str, object] = {"status": "ok" if healthy else "unavailable"}
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        body["checks"] = checks  # error text may name hosts and credentials' users: not for everyone
    return JsonResponse(body, status=200 if healthy else 503)


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
