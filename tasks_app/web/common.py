"""What the staff pages share: the admin context, body limits, answers when Redis fails, a task's record."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.shortcuts import render
from redis.exceptions import RedisError, ResponseError

from tasks_app.logging import escape_control
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.records import ResultRecord
from tasks_app.protocol.scripts import is_transient

View = Callable[..., HttpResponse]

logger = logging.getLogger(__name__)
# How soon a page answered 503 for Redis away asks to be tried again.
REDIS_RETRY_AFTER_S = 5


def admin_context(request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
    """Return the admin site's template context (header, user links) plus a title and `extra`."""
    return {**admin.site.each_context(request), "title": title, **extra}


# Room for what surrounds the arguments (an API call's JSON, a form's other fields).
ENVELOPE_ALLOWANCE_BYTES = 64 * 1024
# Body bytes per byte of the arguments' compact UTF-8 JSON: URL encoding writes a byte as up to three,
# JSON's \uXXXX six for a two-byte character, and a client may add whitespace.
BODY_ENCODING_FACTOR = 4


def enqueue_body(request: HttpRequest) -> tuple[bytes | None, int]:
    """An enqueue request's body (None if over the limit) and that limit: the arguments as encoded, and room."""
    limit = BODY_ENCODING_FACTOR * settings.TASKS_MAX_PAYLOAD_BYTES + ENVELOPE_ALLOWANCE_BYTES
    declared = request.headers.get("Content-Length") or "0"
    if declared.isdigit() and int(declared) > limit:
        return None, limit
    data = request.read(limit + 1)
    return (data if len(data) <= limit else None), limit


def csrf_rejection(request: HttpRequest, check: type[CsrfViewMiddleware] = CsrfViewMiddleware) -> Any:
    """Run Django's CSRF check for a view exempt from the middleware's; None if it passes, else `check`'s rejection."""
    middleware = check(lambda _request: HttpResponse())
    middleware.process_request(request)
    return middleware.process_view(request, None, (), {})  # type: ignore[arg-type]


def load_record(task_id: str) -> ResultRecord | None:
    """Return a task's result record, or None if it is unknown or expired."""
    fields = get_broker().records.get_result(task_id)
    return ResultRecord.from_fields(fields) if fields else None


def log_task_actions(request: HttpRequest, entries: Iterable[tuple[str, str, int, str]]) -> None:
    """One admin log entry per (task id, type, action flag, message): tasks are not models, so no content type."""
    if not request.user.is_authenticated:  # the views are staff-only: an entry always has its user
        raise PermissionDenied
    LogEntry.objects.bulk_create(
        [
            LogEntry(
                user_id=request.user.pk,
                content_type=None,
                # PostgreSQL's text holds no NUL, which a producer's id or type may.
                object_id=escape_control(task_id)[:200],
                object_repr=escape_control(f"{task_type} {task_id}")[:200],
                action_flag=flag,
                change_message=escape_control(message),
            )
            for task_id, task_type, flag, message in entries
        ]
    )


def error(status: int, message: str, **headers: str) -> JsonResponse:
    """Return `{"error": message}` with an HTTP status."""
    return JsonResponse({"error": message}, status=status, headers=headers)


def redis_required(view: View) -> View:
    """Answer Redis away with a 503 saying so, and any other Redis error (a misconfigured key) with a 500 saying why."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except RedisError as exc:
            status, message = _redis_failure(exc)
            logger.error("staff page %s: %s", request.path, message)
            if request.path.endswith(".json") or request.GET.get("format") == "json":
                return redis_error_json(exc)
            if status == 500:
                context = admin_context(request, "Redis answered with an error", message=message)
                return render(request, "tasks_app/redis_refused.html", context, status=500)
            context = admin_context(request, "Redis is unreachable", message=message, retry_s=REDIS_RETRY_AFTER_S)
            response = render(request, "tasks_app/redis_away.html", context, status=503)
            response["Retry-After"] = str(REDIS_RETRY_AFTER_S)
            return response

    return wrapper


def redis_error_json(exc: RedisError) -> JsonResponse:
    """The JSON answer (`{"error": ...}`) of a view Redis failed: 500 for a refusal, else 503 with Retry-After."""
    status, message = _redis_failure(exc)
    if status == 500:
        return error(500, message)
    return error(503, message, **{"Retry-After": str(REDIS_RETRY_AFTER_S)})


def _redis_failure(exc: RedisError) -> tuple[int, str]:
    """500 and why for an error that waiting does not cure (see `is_transient`), else 503 for Redis away."""
    if isinstance(exc, ResponseError) and not is_transient(exc):  # a key of ours of the wrong type, say
        return 500, f"Redis answered with an error: {exc}"
    return 503, f"Redis is unreachable ({exc}); try again shortly."
