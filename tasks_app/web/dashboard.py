"""The queue dashboard with its pause buttons, and each queue's dead letters, with requeue and delete (logged)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from django.contrib import messages
from django.contrib.admin.models import CHANGE, DELETION
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from tasks_app import tracing
from tasks_app.control import set_queue_paused
from tasks_app.models import MANAGE_DEAD_LETTERS_PERMISSION, PAUSE_QUEUE_PERMISSION
from tasks_app.periodic.status import schedule_statuses
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.inspection import DeadTask
from tasks_app.protocol.keys import NAME_PATTERN, InvalidName, validate_name
from tasks_app.protocol.records import LISTED_FIELDS, datetime_of_ms
from tasks_app.task_types import unique_windows
from tasks_app.web.charts import chart_data, dashboard_charts
from tasks_app.web.common import admin_context, log_task_actions, redis_required

PAGE_SIZE = 50
HELD_KEY = "a task with the same uniqueness key is enqueued already"


@staff_member_required
@redis_required
def queue_dashboard(request: HttpRequest) -> HttpResponse:
    """Show every queue's pending / processing / delayed / dead counts, consumers and throughput, and the schedules."""
    broker = get_broker()
    now_ms = broker.inspect.server_time_ms()  # leases are on the Redis clock
    queues = broker.inspect.known_queues()
    rows = [_queue_row(broker, queue, now_ms) for queue in queues]
    charts = dashboard_charts(chart_data(broker, queues))
    context = admin_context(request, "Queue dashboard", queues=rows, schedules=schedule_statuses(broker), **charts)
    return render(request, "tasks_app/dashboard.html", context)


def _queue_row(broker: Broker, queue: str, now_ms: int) -> dict[str, Any]:
    """One queue's counts, consumers and throughput; a producer's name no consumer could serve is not linked."""
    stats = broker.inspect.queue_stats(queue)
    return {
        "stats": stats,
        "consumers": [_consumer_row(info, now_ms) for info in stats.consumers],
        "completed_last_minute": broker.inspect.completed_last_minute(queue),
        "valid_name": NAME_PATTERN.fullmatch(queue) is not None,
        "paused_by": (broker.control.pause_states([queue])[queue] or {}).get("by", ""),
    }


def _consumer_row(info: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """A live consumer; its last heartbeat is its lease's deadline minus the lease."""
    deadline_ms, lease_ms = info["lease_deadline_ms"], info.get("lease_ms")
    beat_ms = deadline_ms - lease_ms if lease_ms else None
    return {
        "id": info["id"],
        "host": str(info.get("host", "")),
        "pid": info.get("pid", ""),
        "in_flight": info["in_flight"],
        "concurrency": info.get("concurrency", ""),
        "last_heartbeat": datetime_of_ms(beat_ms) if beat_ms is not None else None,
        "heartbeat_age_s": max(0.0, (now_ms - beat_ms) / 1000) if beat_ms is not None else None,
        "lease_deadline": datetime_of_ms(deadline_ms),
    }


@staff_member_required
@redis_required
@require_POST
def pause_page(request: HttpRequest, queue: str) -> HttpResponse:
    """The dashboard's pause / resume buttons (POST action=pause|resume, with CSRF)."""
    if not request.user.has_perm(PAUSE_QUEUE_PERMISSION):
        raise PermissionDenied(f"permission {PAUSE_QUEUE_PERMISSION} is required")
    _require_valid(queue)
    action = request.POST.get("action")
    if action not in {"pause", "resume"}:
        messages.error(request, "Unknown action.")
    elif set_queue_paused(queue, action == "pause", by=request.user.get_username()):
        messages.success(request, f"Queue {queue} {action}d.")
    else:
        messages.info(request, f"Queue {queue} was already {action}d.")
    return redirect("tasks_app:dashboard")


def _require_valid(queue: str) -> None:
    try:
        validate_name(queue, "queue")
    except InvalidName as exc:
        raise Http404(str(exc)) from None


@staff_member_required
@redis_required
def chart_series(request: HttpRequest) -> JsonResponse:
    """The dashboard's chart data as JSON: per-minute series of the last hour, per queue and per type."""
    broker = get_broker()
    return JsonResponse(chart_data(broker, broker.inspect.known_queues()))


@staff_member_required
@redis_required
@require_http_methods(["GET", "POST"])
def dead_letter_page(request: HttpRequest, queue: str) -> HttpResponse:
    """List a queue's dead-lettered tasks; POST (permission manage_dead_letters) requeues or deletes some."""
    _require_valid(queue)
    can_manage = request.user.has_perm(MANAGE_DEAD_LETTERS_PERMISSION)
    if request.method == "POST":
        if not can_manage:
            raise PermissionDenied(f"permission {MANAGE_DEAD_LETTERS_PERMISSION} is required")
        _act(request, queue)
        return redirect(request.get_full_path())
    broker = get_broker()
    total = broker.inspect.dead_count(queue)
    page = Paginator(range(total), PAGE_SIZE).get_page(request.GET.get("page"))
    tasks = broker.inspect.list_dead_tasks(queue, (page.number - 1) * PAGE_SIZE, PAGE_SIZE)
    records = broker.records.get_results((task.task_id for task in tasks), LISTED_FIELDS)
    context = admin_context(
        request,
        f"Dead letters of queue {queue}",
        queue=queue,
        can_manage=can_manage,
        dead_tasks=tasks,
        # Dead letters outlive result records (TASKS_DEAD_LETTER_MAX_AGE_S): link the tasks that still have one.
        recorded_ids={task.task_id for task, fields in zip(tasks, records, strict=True) if fields},
        page=page,
        total=total,
    )
    return render(request, "tasks_app/dead_letters.html", context)


def _act(request: HttpRequest, queue: str) -> None:
    """Apply the posted action: requeue one (`requeue_one`), or requeue / delete the selected `ref`s."""
    if request.POST.get("requeue_one"):
        action, refs = "requeue", [request.POST["requeue_one"]]
    else:
        action, refs = request.POST.get("action", ""), request.POST.getlist("ref")
    if action not in {"requeue", "delete"}:
        messages.error(request, "Unknown action.")
        return
    if not refs:
        messages.warning(request, "Select at least one task.")
        return
    found = get_broker().inspect.find_dead_tasks(queue, refs)
    if action == "requeue":
        _requeue(request, queue, found, len(refs))
        return
    deleted = get_broker().inspect.delete_dead_tasks(queue, found)
    _log(request, found, DELETION, f"Deleted dead-lettered task from queue {queue}")
    messages.success(request, f"Deleted {deleted} task(s).")


def _requeue(request: HttpRequest, queue: str, found: Sequence[DeadTask], asked: int) -> None:
    """Requeue `found` (of `asked` selected), a unique type's task taking its key; say what was done."""
    sends = tracing.Sends()  # a requeue is a new send: its runs join the trace of this request
    try:
        done = get_broker().inspect.requeue_dead_tasks(
            queue,
            found,
            unique_windows=unique_windows(task.type for task in found),
            stamp=partial(tracing.restamp, sends=sends, queue=queue),
        )
    except BaseException as exc:
        sends.end([], exc)
        raise
    sends.end((queue, task.task_id) for task in done.moved)
    _log(request, done.moved, CHANGE, f"Requeued dead-lettered task on queue {queue}")
    skipped = asked - len(done.moved) - len(done.held)
    held = "".join(f" Task {task.task_id:.200} not requeued: {HELD_KEY} ({holder:.200})." for task, holder in done.held)
    note = f" {skipped} could not be requeued (no longer dead, or undecodable)." if skipped else ""
    report = messages.warning if held else messages.success
    report(request, f"Requeued {len(done.moved)} task(s).{held}{note}")


def _log(request: HttpRequest, tasks: Sequence[DeadTask], flag: int, message: str) -> None:
    log_task_actions(request, ((task.task_id or task.ref, task.type, flag, message) for task in tasks))
