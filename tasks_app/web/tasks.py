"""Staff pages: the enqueue form (permission enqueue_task), a task's status page, its origins and its cancel button."""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple, cast

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from tasks_app import control, producer
from tasks_app.models import CANCEL_PERMISSION, ENQUEUE_PERMISSION, PeriodicTask, TaskType, name_validator
from tasks_app.producer import MAX_UNIQUE_KEY_CHARS
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.codec import PRIORITY_MAX, PRIORITY_MIN, JsonTooDeep, loads_bounded
from tasks_app.protocol.keys import NAME_PATTERN
from tasks_app.protocol.records import ResultRecord
from tasks_app.registry import registry
from tasks_app.templatetags.tasks_display import url_or_empty
from tasks_app.web.common import admin_context, csrf_rejection, enqueue_body, load_record, redis_required
from tasks_app.web.workflows import place_of

REFRESH_S = 2
# Characters of each value a task page shows: it reloads every REFRESH_S and a value may be megabytes.
SHOWN_CHARS = 20_000

JSON_TEXTAREA = forms.Textarea(attrs={"rows": 3, "cols": 60, "class": "vLargeTextField", "spellcheck": "false"})


def parse_json_field[T](text: str, expected: type[T], what: str) -> T:
    """Parse `text` as JSON of type `expected` (empty means empty), with a precise message on error."""
    if not text.strip():
        return expected()
    try:
        value = loads_bounded(text)
    except JsonTooDeep as exc:
        raise forms.ValidationError(str(exc), code="too_deep") from None
    except ValueError as exc:
        raise forms.ValidationError(f"Invalid JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, expected):
        kind = "array" if expected is list else "object"
        raise forms.ValidationError(f"{what} must be a JSON {kind}, got {type(value).__name__}", code="wrong_type")
    return value


class EnqueueForm(forms.Form):
    """Which task to enqueue and with what arguments."""

    type = forms.ChoiceField(label="Task type", choices=())
    args = forms.CharField(
        label="Args",
        required=False,
        widget=JSON_TEXTAREA,
        help_text='Positional arguments as a JSON array, e.g. <code>[1, "two"]</code>.',
    )
    kwargs = forms.CharField(
        label="Kwargs",
        required=False,
        widget=JSON_TEXTAREA,
        help_text='Keyword arguments as a JSON object, e.g. <code>{"to": "a@b.c"}</code>.',
    )
    queue = forms.CharField(
        label="Queue",
        required=False,
        max_length=100,
        validators=[name_validator],
        help_text="Leave empty for the task type's queue.",
    )
    priority = forms.IntegerField(
        label="Priority",
        initial=0,
        min_value=PRIORITY_MIN,
        max_value=PRIORITY_MAX,
        help_text=f"{PRIORITY_MIN} to {PRIORITY_MAX}; higher runs first.",
    )
    delay = forms.FloatField(
        label="Delay (seconds)",
        initial=0,
        min_value=0,
        max_value=settings.TASKS_MAX_DELAY_S,
        help_text="Run no sooner than this many seconds from now.",
    )
    unique_key = forms.CharField(
        label="Unique key",
        required=False,
        strip=False,
        max_length=MAX_UNIQUE_KEY_CHARS,
        help_text="For task types with <code>unique_for_s</code>: a task enqueued with the same key within the "
        "window is not enqueued again (you are taken to the first one). Leave empty for a hash of the arguments.",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rows = TaskType.objects.filter(enabled=True).only("name", "handler")
        names = [row.name for row in rows if registry.get(row.handler) is not None]
        cast(forms.ChoiceField, self.fields["type"]).choices = [("", "---------"), *((n, n) for n in names)]

    def clean_args(self) -> list[Any]:
        return parse_json_field(self.cleaned_data["args"], list, "Args")

    def clean_kwargs(self) -> dict[str, Any]:
        return parse_json_field(self.cleaned_data["kwargs"], dict, "Kwargs")


# Which form field a producer error is about, by the start of its message.
_ERROR_FIELDS = {
    "args": ("payload", "arguments", "args"),
    "kwargs": ("kwargs",),
    "queue": ("invalid queue",),
    "priority": ("priority",),
    "delay": ("delay",),
    "unique_key": ("unique_key",),
    "type": ("invalid task type", "unknown task type", "task type"),
}


@csrf_exempt  # checked in the view, once the body is read within the payload limit
@staff_member_required
@permission_required(ENQUEUE_PERMISSION, raise_exception=True)
@require_http_methods(["GET", "POST"])
def enqueue_task(request: HttpRequest) -> HttpResponse:
    """Show the enqueue form; on a valid POST enqueue one task and go to its page."""
    refused = _read_form(request) if request.method == "POST" else None
    if refused is not None:
        return refused
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
                unique_key=data["unique_key"] or None,
            )[0]
        except producer.EnqueueError as exc:
            field = next((name for name, starts in _ERROR_FIELDS.items() if str(exc).startswith(starts)), None)
            form.add_error(field, str(exc))
        except producer.QueueUnavailable as exc:
            form.add_error(None, str(exc))
        else:
            if task.duplicate:
                messages.info(request, f"Task {task.id} was enqueued already, within its unique window: nothing added.")
            else:
                messages.success(request, f"Task {task.id} enqueued on queue {task.queue}.")
            return redirect(url_or_empty("tasks_app:task", task.id) or "tasks_app:enqueue")
    return render(request, "tasks_app/enqueue.html", admin_context(request, "Enqueue a task", form=form))


def _read_form(request: HttpRequest) -> HttpResponse | None:
    """Read the form's body within the payload limit (not DATA_UPLOAD_MAX_MEMORY_SIZE), then check CSRF."""
    data, limit = enqueue_body(request)
    reason = f"The form is over the limit of {limit} bytes"
    if data is not None:
        request._body = data  # as `request.body` keeps what it read: POST is parsed from it
        try:
            request.POST  # noqa: B018 (parsed here, where its errors are answered)
            rejection: HttpResponse | None = csrf_rejection(request)
            return rejection
        except RequestDataTooBig:  # multipart/form-data: Django caps its fields at DATA_UPLOAD_MAX_MEMORY_SIZE
            reason = "The form's fields are over DATA_UPLOAD_MAX_MEMORY_SIZE (send it URL-encoded)"
    message = (
        f"{reason}: its arguments may take up to {settings.TASKS_MAX_PAYLOAD_BYTES} bytes of JSON "
        "(TASKS_MAX_PAYLOAD_BYTES). Nothing was enqueued."
    )
    context = admin_context(request, "Enqueue a task", form=EnqueueForm(), refused=message)
    return render(request, "tasks_app/enqueue.html", context, status=413)


@staff_member_required
@redis_required
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
            origins=_origins(record),
            workflow=place_of(record),
            last_error=record.errors[-1] if record.errors else None,
            traceback=_shown(record.errors[-1].get("traceback", "") if record.errors else "", tail=True),
            args_json=_shown(_pretty(record.args)),
            kwargs_json=_shown(_pretty(record.kwargs)),
            return_json=_shown(_pretty(record.return_value)),
            can_cancel=not record.is_finished and request.user.has_perm(CANCEL_PERMISSION),
            queue_paused=record.status == "READY"
            and get_broker().control.pause_states([record.queue])[record.queue] is not None,
            progress_percent=_percent(record.progress),
        ),
    )


@staff_member_required
@redis_required
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
        else:
            how = "it is being stopped by force" if force else "it was asked to stop"
            messages.warning(request, f"Task {task_id} is running: {how}.")
    return redirect("tasks_app:task", task_id=task_id)


class Origin(NamedTuple):
    """One "Origin" row of a task page: a label, the text, its URL ("": unlinked) and why not linked."""

    label: str
    text: str
    url: str
    note: str = ""


def _origins(record: ResultRecord) -> list[Origin]:
    """The tasks a task retries or was retried as (while they have a record), and the schedule that fired it."""
    origins = []
    for label, task_id in (("Retry of", record.retry_of), ("Retried as", record.retried_as)):
        if task_id and get_broker().records.get_result(task_id) is None:  # a bulk delete or the result TTL
            origins.append(Origin(label, task_id, "", "its record has expired or was deleted"))
        elif task_id:
            origins.append(Origin(label, task_id, url_or_empty("tasks_app:task", task_id)))
    name = record.periodic
    # A producer's record may name no valid schedule (a NUL, which PostgreSQL refuses in a query).
    if name and not NAME_PATTERN.fullmatch(name):
        origins.append(Origin("Periodic schedule", name, "", "not a valid schedule name"))
    elif name:
        row = PeriodicTask.objects.filter(name=name).only("pk").first()
        url = url_or_empty("admin:tasks_app_periodictask_change", str(row.pk)) if row else ""
        origins.append(Origin("Periodic schedule", name, url))
    return origins


def _percent(progress: dict[str, Any] | None) -> float | None:
    """How far a progress report says the run is, 0-100; None without a positive total."""
    total = (progress or {}).get("total")
    if not total:
        return None
    try:
        share = 100.0 * progress["current"] / total  # type: ignore[index]
    except OverflowError:  # a handler's integer past a float's range
        return None
    return max(0.0, min(100.0, share)) if math.isfinite(share) else None


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def _shown(text: str, *, tail: bool = False) -> dict[str, Any]:
    """Its first (`tail`: last) SHOWN_CHARS characters, and its length when cut."""
    if len(text) <= SHOWN_CHARS:
        return {"text": text, "cut_of": None}
    return {"text": text[-SHOWN_CHARS:] if tail else text[:SHOWN_CHARS], "cut_of": len(text)}
