"""The JSON API: tasks (enqueue, read, cancel), workflows (read, cancel), queues (read, pause); token auth."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import RedisError

from tasks_app import control, producer, workflows
from tasks_app.models import CANCEL_PERMISSION, ENQUEUE_PERMISSION, PAUSE_QUEUE_PERMISSION, ApiToken
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.codec import MAX_JSON_DEPTH, JsonTooDeep, loads_bounded
from tasks_app.protocol.keys import InvalidName, validate_name
from tasks_app.protocol.records import datetime_of_ms
from tasks_app.templatetags.tasks_display import url_or_empty
from tasks_app.web.common import View, csrf_rejection, enqueue_body, error, load_record, redis_error_json

REQUEST_FIELDS = {"type", "args", "kwargs", "queue", "priority", "delay", "unique_key"}
MAX_CANCEL_BODY_BYTES = 1024  # its optional body: {"force": true}
FORCE_WORDS = {"1", "true", "on"}

logger = logging.getLogger(__name__)


class _CsrfCheck(CsrfViewMiddleware):
    """Django's CSRF check, returning the reason for a failure instead of a page."""

    def _reject(self, request: HttpRequest, reason: str) -> str:
        return reason


def api_view(methods: set[str], permission: str | None = None) -> Callable[[View], View]:
    """Allow `methods`; require a staff user (with `permission`) by bearer token, or by session with CSRF on writes."""

    def decorate(view: View) -> View:
        @csrf_exempt  # token requests carry no cookie; session requests are checked below
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                return error(405, f"method {request.method} not allowed", Allow=", ".join(sorted(methods)))
            try:
                return _denial(request, permission) or view(request, *args, **kwargs)
            except DatabaseError as exc:
                logger.error("task API: the database is unavailable: %s", exc)
                return error(503, "the database is unavailable; try again shortly", **{"Retry-After": "5"})
            except RedisError as exc:
                logger.error("task API: Redis failed: %s", exc)
                return redis_error_json(exc)

        return wrapper

    return decorate


def _denial(request: HttpRequest, permission: str | None) -> JsonResponse | None:
    """Why the caller may not use this view (401/403), or None; sets `request.user` to the caller."""
    header = request.headers.get("Authorization")
    user = getattr(request, "user", None) if header is None else _token_user(header)
    if isinstance(user, str):
        return error(401, user, **{"WWW-Authenticate": 'Bearer error="invalid_token"'})
    if user is None or not user.is_authenticated:
        message = "authentication required: send 'Authorization: Bearer <token>' or log in"
        return error(401, message, **{"WWW-Authenticate": "Bearer"})
    if not user.is_staff:
        return error(403, "only staff users may use the task API")
    if permission is not None and not user.has_perm(permission):
        return error(403, f"permission {permission} is required")
    if header is None and request.method not in {"GET", "HEAD", "OPTIONS"}:
        try:
            reason = csrf_rejection(request, _CsrfCheck)
        except (RequestDataTooBig, TooManyFieldsSent) as exc:  # it reads a form-typed body as a form
            message = f"{exc} (the body was read as form data, as its Content-Type says): send it as application/json"
            return error(413 if isinstance(exc, RequestDataTooBig) else 400, message)
        if reason:
            return error(403, f"CSRF check failed: {reason}")
    request.user = user  # a token acts as its user, in the view too
    return None


def _token_user(header: str) -> Any:
    """The user of an `Authorization: Bearer <token>` header; unless an active one, why it is refused (a str)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "malformed Authorization header: expected 'Bearer <token>'"
    row = ApiToken.objects.select_related("user").filter(key_hash=ApiToken.hash_of(token.strip())).first()
    if row is None:
        return "invalid API token"
    if row.revoked_at is not None:
        return "API token revoked"
    if not row.user.is_active:
        return "the token's user is inactive"
    ApiToken.objects.filter(pk=row.pk).update(last_used_at=timezone.now())
    return row.user


def _read_body(request: HttpRequest) -> dict[str, Any] | JsonResponse:
    """The enqueue request's body as a dict of known fields, or the 400/413 answer saying what is wrong."""
    data, limit = enqueue_body(request)
    if data is None:
        payload = f"arguments may take up to TASKS_MAX_PAYLOAD_BYTES={settings.TASKS_MAX_PAYLOAD_BYTES}"
        return error(413, f"request body is over the limit of {limit} bytes ({payload})")
    try:
        body = loads_bounded(data or b"null", MAX_JSON_DEPTH + 1)  # the arguments sit in the body
    except JsonTooDeep:
        return error(400, f"request body is nested too deeply: arguments may nest at most {MAX_JSON_DEPTH} levels")
    except ValueError as exc:
        return error(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error(400, "request body must be a JSON object")
    unknown = sorted(set(body) - REQUEST_FIELDS)
    if unknown:
        return error(400, f"unknown field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(REQUEST_FIELDS))}")
    if not isinstance(body.get("type"), str) or not body["type"]:
        return error(400, "field 'type' is required and must be a string")
    if body.get("queue") == "":  # the producer reads "" as none, for the form's empty field
        return error(400, "invalid queue '': leave it out or send null for the type's queue")
    return body


@api_view({"POST"}, permission=ENQUEUE_PERMISSION)
def create_task(request: HttpRequest) -> HttpResponse:
    """Enqueue one task; 201 with its id and a Location header naming its record (200 for a duplicate)."""
    body = _read_body(request)
    if isinstance(body, JsonResponse):
        return body
    try:
        task = producer.enqueue(
            body["type"],
            body.get("args", []),
            {} if body.get("kwargs") is None else body["kwargs"],  # null: none; [] or false is refused
            queue=body.get("queue"),
            priority=body.get("priority", 0),
            delay_s=body.get("delay", 0),
            unique_key=body.get("unique_key"),
        )[0]
    except producer.EnqueueError as exc:
        return error(400, str(exc))
    except producer.QueueUnavailable as exc:
        return error(503, str(exc))
    return _enqueued_answer(request, task)


def _enqueued_answer(request: HttpRequest, task: producer.EnqueuedTask) -> HttpResponse:
    """201 with the task just enqueued; for a duplicate, 200 with the task holding its key, as its record says now."""
    path = url_or_empty("tasks_app:api-task", task.id)  # a duplicate's holder may have an id no URL names
    location = request.build_absolute_uri(path) if path else None
    answer = {
        "id": task.id,
        "type": task.type,
        "queue": task.queue,
        "priority": task.priority,
        "status": "READY",
        "enqueued_at": _iso(task.enqueued_at_ms),
        "run_after": _iso(task.run_after_ms) if task.run_after_ms else None,
    }
    holder = load_record(task.id) if task.duplicate else None
    if holder is not None:
        held = holder.as_json()
        answer.update({name: held[name] for name in ("priority", "status", "enqueued_at", "run_after")})
        answer.update({name: held[name] for name in ("type", "queue") if held[name]})  # else the request's
    answer.update(url=location, duplicate=task.duplicate)
    response = JsonResponse(answer, status=200 if task.duplicate else 201)
    if location:
        response["Location"] = location
    return response


def _iso(ms: int) -> str | None:
    moment = datetime_of_ms(ms)
    return moment.isoformat() if moment else None


@api_view({"GET"})
def task_record(request: HttpRequest, task_id: str) -> HttpResponse:
    """Return a task's result record as JSON; 404 if it is unknown or expired."""
    record = load_record(task_id)
    if record is None:
        return error(404, f"no task {task_id!r} (unknown, or its record has expired)")
    return JsonResponse(record.as_json())


def _read_force(request: HttpRequest) -> bool | JsonResponse:
    """Whether a cancel is forced: `{"force": true}` as its JSON body, or a form field force=true (no body: no)."""
    declared = request.headers.get("Content-Length") or "0"
    if not declared.isdigit() or int(declared) > MAX_CANCEL_BODY_BYTES:
        return error(413, f"a cancel's body is at most {MAX_CANCEL_BODY_BYTES} bytes")
    # A multipart stream may have been read (CSRF): not its body. JSON sent as a form (curl -d) is JSON.
    if request.content_type == "multipart/form-data" or (
        request.content_type == "application/x-www-form-urlencoded" and not request.body.lstrip().startswith(b"{")
    ):
        try:
            return request.POST.get("force", "").lower() in FORCE_WORDS
        except MultiPartParserError as exc:
            return error(400, f"request body is not valid form data: {exc}")
    if not request.body.strip():
        return False
    try:
        body = loads_bounded(request.body, 1)
    except ValueError as exc:
        return error(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict) or set(body) - {"force"} or not isinstance(body.get("force", False), bool):
        return error(400, 'request body must be empty or a JSON object {"force": true|false}')
    return bool(body.get("force", False))


@api_view({"POST"}, permission=CANCEL_PERMISSION)
def cancel_task(request: HttpRequest, task_id: str) -> HttpResponse:
    """Cancel a task: 200 if it will never run, 202 if it runs and was asked (or forced) to stop, 404, 409."""
    force = _read_force(request)
    if isinstance(force, JsonResponse):
        return force
    try:
        reply = control.cancel(task_id, cancelled_by=f"user:{request.user.get_username()}", force=force)
    except control.TaskNotFound as exc:
        return error(404, str(exc))
    except control.TaskAlreadyFinished as exc:
        return error(409, str(exc))
    running = reply.outcome == control.REQUESTED
    answer = {"id": task_id, "outcome": reply.outcome, "status": reply.status, "cancel_requested": running}
    return JsonResponse({**answer, "forced": running and force}, status=202 if running else 200)


@api_view({"GET"})
def workflow_state(request: HttpRequest, workflow_id: str) -> HttpResponse:
    """Return a workflow's status, counts and tree as JSON; 404 if it is unknown or expired."""
    try:
        return JsonResponse(workflows.get_workflow(workflow_id).as_json())
    except workflows.WorkflowError as exc:
        return error(404, str(exc))


@api_view({"POST"}, permission=CANCEL_PERMISSION)
def cancel_workflow(request: HttpRequest, workflow_id: str) -> HttpResponse:
    """Cancel a workflow: 200 with the tasks asked to stop, 404 if unknown, 409 if it ended already."""
    try:
        cancelled = workflows.cancel_workflow(workflow_id, cancelled_by=f"user:{request.user.get_username()}")
    except workflows.WorkflowError as exc:
        return error(404, str(exc))
    if not cancelled.cancelled:
        return error(409, f"workflow {workflow_id!r} already ended ({cancelled.status})")
    return JsonResponse({"id": workflow_id, "status": cancelled.status, "cancelled_task_ids": cancelled.task_ids})


@api_view({"GET"})
def api_queue(request: HttpRequest, queue: str) -> HttpResponse:
    """A queue's counts and whether (since when, by whom) it is paused."""
    return _queue_answer(request, queue)


@api_view({"POST"}, permission=PAUSE_QUEUE_PERMISSION)
def api_pause(request: HttpRequest, queue: str, paused: bool) -> HttpResponse:
    """Pause a queue (consumers stop claiming it within a second; enqueues go on) or resume it; then as api_queue."""
    return _queue_answer(request, queue, paused)


def _queue_answer(request: HttpRequest, queue: str, paused: bool | None = None) -> HttpResponse:
    try:
        validate_name(queue, "queue")
    except InvalidName as exc:
        return error(400, str(exc))
    changed = None if paused is None else control.set_queue_paused(queue, paused, by=request.user.get_username())
    broker = get_broker()
    answer = broker.inspect.queue_stats(queue).as_dict()
    answer.pop("consumers")
    state = broker.control.pause_states([queue])[queue] or {}
    answer["paused_since"] = _iso(state["since_ms"]) if state.get("since_ms") is not None else None
    answer["paused_by"] = state.get("by")
    if changed is not None:
        answer["changed"] = changed
    return JsonResponse(answer)
