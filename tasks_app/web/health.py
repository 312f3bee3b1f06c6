"""The web app's `/healthz` view: the database and Redis, each checked on every request."""

from __future__ import annotations

import logging

from django.db import connections
from django.http import HttpRequest, JsonResponse

from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.broker import get_broker

logger = logging.getLogger(__name__)
# A load balancer probes every few seconds: an outage is logged once (and recalled now and then), and its end.
_problems: ProblemLog[str] = ProblemLog(logger)


def healthz(request: HttpRequest) -> JsonResponse:
    """Answer 200 when the database and Redis are reachable, else 503; only staff see each check's state."""
    checks: dict[str, str] = {}
    for name, probe in (("database", _ping_database), ("redis", lambda: get_broker().inspect.ping())):
        try:
            probe()
        except Exception as exc:
            checks[name] = f"error: {exc}"
            _problems.failed(name, checks[name], "health check: %s %s", name, checks[name])
        else:
            checks[name] = "ok"
            _problems.recovered(name, "health check: %s ok again", name)
    healthy = all(state == "ok" for state in checks.values())
    body: dict[str, object] = {"status": "ok" if healthy else "unavailable"}
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        body["checks"] = checks  # error text may name hosts and credentials' users: not for everyone
    return JsonResponse(body, status=200 if healthy else 503)


def _ping_database() -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT 1")
