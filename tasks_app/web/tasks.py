"""Staff pages: the enqueue form (permission enqueue_task), a task's status page and its cancel button."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from tasks_app import control, producer
from tasks_app.models import CANCEL_PERMISSION, ENQUEUE_PERMISSION
from tasks_app.web.common import admin_context, load_record
from tasks_app.web.forms import EnqueueForm, error_field
from tasks_app.web.origins import task_origins

REFRESH_S = 2


@staff_member_required
@permission_required(ENQUEUE_PERMISSION, raise_exception=True)
@require_http_methods(["GET", "POST"])
def enqueue_task(request: HttpRequest) -> HttpResponse:
    """Show the enqueue form; on a valid POST enqueue one task and go to its page."""
    form = EnqueueForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            task = producer.enqueue(
                data["type"],
                data["args"],
                data["kwargs"],
                queue=data["queue"] or None,
                priority=data["priority"],
                delay_s=data["delay"],
                unique_key=data["unique_key"],
            )[0]
        except producer.EnqueueError as exc:
            form.add_error(error_field(str(exc)), str(exc))
        except producer.QueueUnavailable as exc:
            form.add_error(None, str(exc))
        else:
            if task.duplicate:
                messages.info(request, f"Task {task.id} was enqueued already, within its unique window: nothing added.")
            else:
                messages.success(request, f"Task {task.id} enqueued on queue {task.queue}.")
            return redirect("tasks_app:task", task_id=task.id)
    return render(request, "tasks_app/enqueue.html", admin_context(request, "Enqueue a task", form=form))


@staff_member_required
def task_detail(request: HttpRequest, task_id: str) -> HttpResponse:
    """Show a task's status, arguments and outcome; the page reloads itself until it finishes."""
    record = load_record(task_id)
    if record is None:
        raise Http404("No task with this id (or its record has expired).")
    return render(
        request,
        "tasks_app/task.html",
        admin_context(
            request,
            f"Task {record.id}",
            record=record,
            refresh_s=None if record.is_finished else REFRESH_S,
            origins=task_origins(record),
            last_error=record.errors[-1] if record.errors else None,
            args_json=_pretty(record.args),
            kwargs_json=_pretty(record.kwargs),
            return_json=_pretty(record.return_value),
            can_cancel=not record.is_finished and request.user.has_perm(CANCEL_PERMISSION),
            progress_percent=_percent(record.progress),
        ),
    )


@staff_member_required
@permission_required(CANCEL_PERMISSION, raise_exception=True)
@require_http_methods(["POST"])
def cancel_task(request: HttpRequest, task_id: str) -> HttpResponse:
    """Cancel the task (the buttons on its page: by force too) and go back to its page, saying what happened."""
    force = request.POST.get("force") == "1"
    try:
        reply = control.cancel(task_id, cancelled_by=f"user:{request.user.get_username()}", force=force)
    except control.TaskNotFound as exc:
        raise Http404(str(exc)) from None
    except control.TaskAlreadyFinished as exc:
        messages.error(request, str(exc))
    else:
        if reply.outcome == control.CANCELLED:
            messages.success(request, f"Task {task_id} cancelled: it will not run.")
        elif force:
            messages.warning(request, f"Task {task_id} is running: it is being stopped by force.")
        else:
            messages.warning(request, f"Task {task_id} is running: it was asked to stop.")
    return redirect("tasks_app:task", task_id=task_id)


def _percent(progress: dict[str, Any] | None) -> float | None:
    """How far a progress report says the run is, 0-100; None without a positive total."""
    if not progress:
        return None
    current, total = progress.get("current"), progress.get("total")
    if not isinstance(current, int | float) or not isinstance(total, int | float) or total <= 0:
        return None
    return max(0.0, min(100.0, 100.0 * current / total))


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)
