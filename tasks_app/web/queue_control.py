"""Pausing and resuming a queue from the dashboard and the JSON API (permission pause_queue)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from tasks_app.control import set_queue_paused
from tasks_app.models import PAUSE_QUEUE_PERMISSION
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.keys import InvalidName, validate_name
from tasks_app.protocol.records import datetime_of_ms
from tasks_app.web.api import api_view, error
from tasks_app.web.common import redis_required


def queue_state(queue: str) -> dict[str, Any]:
    """A queue's counts and whether (since when, by whom) it is paused, as JSON."""
    broker = get_broker()
    counts = broker.inspect.queue_stats(queue).as_dict()
    counts.pop("consumers", None)
    state = broker.control.pause_states([queue])[queue] or {}
    since = datetime_of_ms(state["since_ms"]) if state.get("since_ms") is not None else None
    return {
        **counts,
        "paused_since": since.isoformat() if since else None,
        "paused_by": state.get("by"),
    }


@staff_member_required
@redis_required
@require_POST
def pause_page(request: HttpRequest, queue: str) -> HttpResponse:
    """The dashboard's pause / resume buttons (POST action=pause|resume, with CSRF)."""
    if not request.user.has_perm(PAUSE_QUEUE_PERMISSION):
        raise PermissionDenied(f"permission {PAUSE_QUEUE_PERMISSION} is required")
    try:
        validate_name(queue, "queue")
    except InvalidName as exc:
        raise Http404(str(exc)) from None
    action = request.POST.get("action")
    if action not in {"pause", "resume"}:
        messages.error(request, "Unknown action.")
    elif set_queue_paused(queue, action == "pause", by=request.user.get_username()):
        messages.success(request, f"Queue {queue} {action}d.")
    else:
        messages.info(request, f"Queue {queue} was already {action}d.")
    return redirect("tasks_app:dashboard")


def _api_set(request: HttpRequest, queue: str, paused: bool) -> HttpResponse:
    try:
        validate_name(queue, "queue")
    except InvalidName as exc:
        return error(400, str(exc))
    changed = set_queue_paused(queue, paused, by=request.user.get_username())
    return JsonResponse({**queue_state(queue), "changed": changed})


@api_view({"POST"}, permission=PAUSE_QUEUE_PERMISSION)
def api_pause(request: HttpRequest, queue: str) -> HttpResponse:
    """Pause a queue: consumers stop claiming it within a second; enqueues are still accepted."""
    return _api_set(request, queue, True)


@api_view({"POST"}, permission=PAUSE_QUEUE_PERMISSION)
def api_resume(request: HttpRequest, queue: str) -> HttpResponse:
    """Resume a paused queue."""
    return _api_set(request, queue, False)


@api_view({"GET"})
def api_queue(request: HttpRequest, queue: str) -> HttpResponse:
    """A queue's counts and pause state."""
    try:
        validate_name(queue, "queue")
    except InvalidName as exc:
        return error(400, str(exc))
    return JsonResponse(queue_state(queue))
