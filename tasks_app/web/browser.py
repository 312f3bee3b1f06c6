"""The task browser `/tasks/`: recent tasks filtered and paged from the history index, and its bulk actions."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.models import ADDITION, CHANGE, DELETION
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse, QueryDict
from django.shortcuts import redirect, render
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_http_methods

import tasks_app
from tasks_app import producer, workflows
from tasks_app.models import CANCEL_PERMISSION, DELETE_TASK_RECORDS_PERMISSION, ENQUEUE_PERMISSION, TaskType
from tasks_app.protocol import history
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import Arguments, UndecodableTask, decode_task, finite
from tasks_app.protocol.history import CANCELLED, REQUESTED
from tasks_app.protocol.inspection import WaitingTask
from tasks_app.protocol.keys import InvalidName, validate_name
from tasks_app.protocol.records import (
    FINISHED,
    LISTED_FIELDS,
    READY,
    RETRY_OF_HEADER,
    WHOLE_RECORD_FIELDS,
    WORKFLOW_HEADER,
    WORKFLOW_PATH_HEADER,
    ResultRecord,
    ResultUpdate,
    enqueued_fields,
    ms_of_datetime,
)
from tasks_app.web.common import admin_context, log_task_actions, redis_required

REFRESH_S = 5
PAGE_SIZES = (25, 50, 100, 200)
DEFAULT_PAGE_SIZE = 50
# Entries one page may read looking for tasks of the wanted type, in chunks.
SCAN_BUDGET = 5000
CHUNK = 250
# The longest id a cursor carries (`after`).
MAX_ID_CHARS = 10_000
RANGES = {"15m": timedelta(minutes=15), "1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}


@staff_member_required
@redis_required
@require_http_methods(["GET", "POST"])
def task_browser(request: HttpRequest) -> HttpResponse:
    """List recent tasks newest first (`?format=json` as JSON); POST runs a bulk action on the selected ones."""
    if request.method == "POST":
        _run_action(request)
        return redirect(request.get_full_path())
    filters = Filters.from_query(request.GET)
    broker = get_broker()
    queues = broker.inspect.known_queues()
    page = find_page(broker, filters, queues)
    if request.GET.get("format") == "json":
        return JsonResponse(page_json(page))
    return render(
        request,
        "tasks_app/browser.html",
        admin_context(
            request,
            "Tasks",
            filters=filters,
            page=page,
            rows=[{**row_json(record, score), "record": record} for record, score in page.records],
            history_max=broker.records.history_max,
            waiting=filters.status == READY and not (filters.workflow or filters.q),
            older_cursor=repr(page.older) if page.older is not None else "",
            statuses=history.STATUSES,
            queues=queues,
            types=TaskType.objects.values_list("name", flat=True),
            not_kept=TaskType.objects.exclude(keep_results=TaskType.KeepResults.ALWAYS).order_by("name"),
            ranges=list(RANGES),
            page_sizes=PAGE_SIZES,
            base_query=query_without(request.GET, "before", "seen", "after", "format"),
            page_query=query_without(request.GET, "format"),
            actions=[action for action in ACTIONS.values() if request.user.has_perm(action.permission)],
            refresh_s=REFRESH_S,
        ),
    )


def _run_action(request: HttpRequest) -> None:
    """Run the posted action on the posted task ids, if this user may; tell what happened."""
    action = ACTIONS.get(request.POST.get("action", ""))
    if action is None:
        messages.error(request, "Unknown action.")
        return
    if not request.user.has_perm(action.permission):
        raise PermissionDenied(f"permission {action.permission} is required")
    ids = list(dict.fromkeys(request.POST.getlist("task")))[:MAX_SELECTED]
    records = [ResultRecord.from_fields(fields) for fields in get_broker().records.get_results(ids) if fields]
    if not records:
        messages.warning(request, "Select at least one task (that still has a record).")
        return
    shown = {r.id: request.POST.get(f"retried_as:{r.id}", "") for r in records}  # each row's, as the page showed it
    try:
        logged, message = action.run(Selection(records, f"user:{request.user.get_username()}", shown))
    except (producer.EnqueueError, producer.QueueUnavailable) as exc:
        messages.error(request, f"{action.label}: {exc}")
        return
    log_task_actions(request, logged)
    gone = len(ids) - len(records)  # deleted or expired since the page was shown
    messages.success(request, message + (f" {gone} selected task(s) no longer had a record, left." if gone else ""))


@dataclass(frozen=True)
class Filters:
    """What the browser lists: each filter is a query-string parameter of the same name."""

    status: str = ""
    type: str = ""
    queue: str = ""
    q: str = ""
    workflow: str = ""  # a workflow's id: its tasks, in tree order (`after` then names the last one shown)
    range: str = ""
    since: datetime | None = None
    until: datetime | None = None
    before: float | None = None  # the cursor: entries enqueued strictly before this score (ms)...
    seen: int = 0  # ...or at it too, but for the first `seen` of those (earlier pages showed them)...
    after: str = ""  # ...those from this id on (in the index's order) of them, when given
    size: int = DEFAULT_PAGE_SIZE
    errors: list[str] = field(default_factory=list)

    @classmethod
    def from_query(cls, query: QueryDict) -> Filters:
        """Read the filters; a value that does not parse is dropped with a message in `errors`."""
        errors: list[str] = []
        status = query.get("status", "")
        if status and status not in history.STATUSES:
            errors.append(f"Unknown status {status!r}.")
            status = ""
        preset = query.get("range", "")
        if preset and preset not in RANGES:
            errors.append(f"Unknown time range {preset!r}.")
            preset = ""
        workflow = query.get("workflow", "").strip()[:200]
        try:
            if workflow:
                validate_name(workflow, "workflow id")
        except InvalidName as exc:
            errors.append(f"{exc}.")
            workflow = ""
        size = _digits(query.get("size", ""), DEFAULT_PAGE_SIZE)
        return cls(
            status=status,
            type=query.get("type", "").strip()[:200],
            queue=query.get("queue", "").strip()[:200],
            q=query.get("q", "").strip()[:200],
            workflow=workflow,
            range=preset,
            since=_moment(query.get("since", ""), "since", errors),
            until=_moment(query.get("until", ""), "until", errors),
            before=_number(query.get("before", "")),
            seen=min(_digits(query.get("seen", ""), 0), history.HISTORY_MAX),
            after=query.get("after", "")[:MAX_ID_CHARS],
            size=size if size in PAGE_SIZES else DEFAULT_PAGE_SIZE,
            errors=errors,
        )

    def bounds_ms(self, now: datetime) -> tuple[float | None, float | None]:
        """The score range selected: (newer than, older than), either None for open."""
        since = now - RANGES[self.range] if self.range else self.since
        upper: list[float] = [ms_of_datetime(self.until)] if self.until else []
        if self.before is not None:
            upper.append(self.before)
        return (ms_of_datetime(since) if since else None, min(upper) if upper else None)

    def matches(self, record: ResultRecord) -> bool:
        """Whether a record passes the filters the index cannot apply (its type; its status, kept current)."""
        return (not self.type or record.type == self.type) and (not self.status or record.status == self.status)

    def admits(self, record: ResultRecord, score_ms: float, lower: float | None, upper: float | None) -> bool:
        """Whether a record read outside the index passes every filter, its score within (lower, upper)."""
        return (
            self.matches(record)
            and (not self.queue or record.queue == self.queue)
            and (lower is None or score_ms >= lower)
            and (upper is None or score_ms <= upper)
        )


def _moment(text: str, name: str, errors: list[str]) -> datetime | None:
    """`text` as a time in UTC; None if empty, or with an error if not one on the calendar."""
    if not text:
        return None
    try:
        moment = parse_datetime(text)  # None if not shaped like a time; ValueError for a 13th month
        if moment is not None:  # day 1 at +14:00 or day 9999 at -14:00 is off the calendar in UTC
            return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        pass
    errors.append(f"{name} must be a date and time like 2026-12-01T14:30.")
    return None


def _number(text: str) -> float | None:
    """A cursor: any score but NaN (a producer's record may score 1e300 or inf)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value else None


def _digits(text: str, default: int) -> int:
    """A count typed in a query: ASCII digits only (int() takes no "²", nor thousands of digits), else `default`."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else default


@dataclass(frozen=True)
class Page:
    """One page of the browser: its tasks, the cursor of the next (older) page, and the total if known."""

    records: list[tuple[ResultRecord, float]]
    older: float | None
    total: int | None
    exhausted_budget: bool = False
    next_after: str = ""  # a workflow's page: the next page's `after`
    older_seen: int = 0  # of the entries scored `older`, how many were shown
    older_after: str = ""  # the id of the last of them
    cut: bool = False  # a prefix search that filled a page: more may match


def find_page(broker: Broker, filters: Filters, known: Sequence[str]) -> Page:
    """The tasks the filters select among the `known` queues, newest first, one page of them."""
    queues = [filters.queue] if filters.queue else list(known)
    if filters.status == READY and not (filters.workflow or filters.q):  # `seen` is its offset, not a cursor
        return _waiting_page(broker, filters, queues, *replace(filters, before=None).bounds_ms(datetime.now(UTC)))
    lower, upper = filters.bounds_ms(datetime.now(UTC))
    if filters.workflow:
        return _workflow_page(broker, filters, lower, upper)
    if filters.q:
        return _search(broker, filters, queues, lower, upper)
    resumed = upper is not None and upper == filters.before
    seen, after = (filters.seen, filters.after) if resumed else (0, "")
    found: list[tuple[ResultRecord, float]] = []
    examined = 0
    chunk = CHUNK if filters.type else filters.size  # without a type nearly every entry is a row
    # A type or an end time narrows what the index counts.
    narrowed = filters.type or filters.until or filters.before is not None
    total = None if narrowed else broker.records.history_count(queues, filters.status or None, lower)
    while examined < SCAN_BUDGET:
        window = broker.records.history_window(queues, filters.status or None, upper, lower, chunk, seen, after)
        for entry, record in zip(window, _records(broker, [e.task_id for e in window]), strict=True):
            seen, after, upper = seen + 1 if entry.score_ms == upper else 1, entry.task_id, entry.score_ms
            if record is not None and filters.matches(record):
                found.append((record, entry.score_ms))
                if len(found) == filters.size:
                    return Page(found, upper, total, older_seen=seen, older_after=after)
        examined += len(window)
        if len(window) < chunk:
            return Page(found, None, total)
    return Page(found, upper, total, exhausted_budget=True, older_seen=seen, older_after=after)


def _records(broker: Broker, task_ids: list[str]) -> list[ResultRecord | None]:
    fields = broker.records.get_results(task_ids, LISTED_FIELDS)
    return [ResultRecord.from_fields(item) if item else None for item in fields]


def _waiting_page(
    broker: Broker, filters: Filters, queues: list[str], lower: float | None, upper: float | None
) -> Page:
    """Waiting tasks read from the queues themselves (not the history), from offset `seen` on."""
    # Their rows show what the envelope holds, with the status of the record or mark (a cancel's CANCELLED).
    found: list[tuple[ResultRecord, float]] = []
    offset, total = filters.seen, None
    narrowed = filters.type or lower is not None or upper is not None
    chunk = CHUNK if narrowed else filters.size
    for _ in range(0, SCAN_BUDGET, chunk):
        waiting, waiting_total = broker.inspect.waiting_tasks(queues, offset, chunk)
        total = None if narrowed else waiting_total
        rows = [_waiting_row(item) for item in waiting]
        statuses = broker.records.get_results([row.id for row, _ in rows if row], ["status"])
        for at, (row, score_ms) in enumerate(rows):
            row = row and replace(row, status=(statuses.pop(0) or {}).get("status", READY))
            if row is not None and filters.admits(row, score_ms, lower, upper):
                found.append((row, score_ms))
                if len(found) == filters.size:
                    return Page(found, 0.0, total, older_seen=offset + at + 1)
        offset += len(rows)
        if len(waiting) < chunk:
            return Page(found, None, total)
    return Page(found, 0.0, total, exhausted_budget=True, older_seen=offset)


def _waiting_row(item: WaitingTask) -> tuple[ResultRecord | None, float]:
    """A waiting task's row from its envelope, scored by its enqueue time; None if it does not decode."""
    try:
        task = decode_task(item.raw)
    except UndecodableTask:
        return None, 0.0
    fields = enqueued_fields(task, Arguments([], {}))  # a row shows no arguments: its payload is not parsed
    return ResultRecord.from_fields(fields), float(task.enqueued_at_ms)


def _workflow_page(broker: Broker, filters: Filters, lower: float | None, upper: float | None) -> Page:
    """A workflow's tasks that pass the filters, in tree order, from the one after `after` on (no index read)."""
    try:
        ids = workflows.task_ids(filters.workflow, broker=broker)
    except workflows.WorkflowError:
        return Page([], None, 0)
    start = ids.index(filters.after) + 1 if filters.after in ids else 0
    found: list[tuple[ResultRecord, float]] = []
    for first in range(start, min(len(ids), start + SCAN_BUDGET), CHUNK):
        chunk = ids[first : first + CHUNK]
        for task_id, record in zip(chunk, _records(broker, chunk), strict=True):
            score_ms = ms_of_datetime(record.enqueued_at) if record and record.enqueued_at else 0.0
            if record is not None and filters.admits(record, score_ms, lower, upper):
                found.append((record, score_ms))
                if len(found) == filters.size:
                    return Page(found, None, None, next_after=task_id if ids[-1] != task_id else "")
    end = min(len(ids), start + SCAN_BUDGET)
    more = end < len(ids)
    return Page(found, None, None, exhausted_budget=more, next_after=ids[end - 1] if more else "")


def _search(broker: Broker, filters: Filters, queues: list[str], lower: float | None, upper: float | None) -> Page:
    """`q` as an exact id (any task with a record, indexed or not), else as a prefix of ids in the index."""
    exact = broker.records.get_result(filters.q)
    if exact is not None:
        record = ResultRecord.from_fields(exact)
        return Page([(record, 0.0)] if filters.admits(record, 0.0, None, None) else [], None, None)
    entries = broker.records.history_by_prefix(queues, filters.q, filters.size)
    rows = [
        (record, entry.score_ms)
        for entry, record in zip(entries, _records(broker, [e.task_id for e in entries]), strict=True)
        if record and filters.admits(record, entry.score_ms, lower, upper)
    ]
    return Page(rows, None, None, cut=len(entries) == filters.size)


def query_without(query: QueryDict, *names: str) -> str:
    """The query string without `names` (to build the links to other pages of the same filters)."""
    kept = query.copy()
    for name in names:
        kept.pop(name, None)
    return kept.urlencode()


def page_json(page: Page) -> dict[str, Any]:
    """A page of the browser as JSON (`?format=json`): its rows, the next cursor, what is known of the rest."""
    return {
        "tasks": [row_json(record, score) for record, score in page.records],
        "older": finite(page.older),  # a producer's score of +inf: strict JSON has no Infinity
        "older_seen": page.older_seen,
        "older_after": page.older_after,
        "total": page.total,
        "cut": page.cut,
    }


def row_json(record: ResultRecord, score_ms: float) -> dict[str, Any]:
    """A row of the browser as JSON: the record but its args, kwargs and return value; the run time; the last error."""
    listed = {name: value for name, value in record.as_json().items() if name not in WHOLE_RECORD_FIELDS}
    return {
        **listed,
        "duration_s": duration_s(record),
        "error_line": error_line(record),
        "cursor": finite(score_ms),
    }


def duration_s(record: ResultRecord) -> float | None:
    """How long the task ran: from its first start to its finish (or to now while it runs); None if not started."""
    if record.started_at is None:
        return None
    end = record.finished_at or (datetime.now(UTC) if record.status == "RUNNING" else None)
    return max(0.0, (end - record.started_at).total_seconds()) if end else None


def error_line(record: ResultRecord) -> str:
    """The first line of the last error: the exception and its message, as a traceback's last line has them."""
    if not record.errors:
        return record.dead_reason.splitlines()[0] if record.dead_reason else ""
    lines = [line for line in record.errors[-1].get("traceback", "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else record.errors[-1].get("exception_class_path", "")


MAX_SELECTED = 500  # a page holds at most 200
# Fixed, or a request repeated across a change of it would enqueue a second copy.
RETRY_ID_NAMESPACE = uuid.UUID("5f0c0b52-8e0a-4c51-9a7e-3d1b2f64a9c1")
# A repeated request's copies named in its answer; more are counted.
NAMED_REPEATS = 3


@dataclass(frozen=True)
class Selection:
    """The selected tasks (their records as they are now), who acts, and what the page showed of each."""

    records: Sequence[ResultRecord]
    actor: str  # "user:<name>"
    shown_retried_as: Mapping[str, str] = field(default_factory=dict)  # by task id, as the page showed them


# What an action did: the admin log entries to write (task id, type, flag, message) and what to tell the user.
Outcome = tuple[list[tuple[str, str, int, str]], str]


@dataclass(frozen=True)
class BulkAction:
    """An action on selected tasks: its name in the form, its label, the permission it needs, what it does."""

    name: str
    label: str
    permission: str
    run: Callable[[Selection], Outcome]


def retry_task_id(task_id: str, shown_retried_as: str) -> str:
    """The id of the copy that retrying a task makes from a page showing it retried as `shown_retried_as` (or "")."""
    return str(uuid.uuid5(RETRY_ID_NAMESPACE, json.dumps([task_id, shown_retried_as]).encode()))


def retry(selection: Selection) -> Outcome:
    """Enqueue a copy of each task (type, args, kwargs, queue, priority), its record linking to the original."""
    records = selection.records
    copy_ids = [retry_task_id(r.id, selection.shown_retried_as.get(r.id, "")) for r in records]
    tasks = _enqueue_copies(records, copy_ids)
    retried = [(r, task) for r, task in zip(records, tasks, strict=True) if task is not None and not task.duplicate]
    broker = get_broker()
    for record, task in retried:
        broker.records.record_result(ResultUpdate(record.id, {"retried_as": task.id}, settings.TASKS_RESULT_TTL))
    # A duplicate holding the copy's own id is a repeat; one holding another id, a unique type's key holder.
    repeats = [i for i, task in zip(copy_ids, tasks, strict=True) if task is None or (task.duplicate and task.id == i)]
    held = len(records) - len(retried) - len(repeats)
    note = f" {held} not retried: a task of the same unique type and key is enqueued already." if held else ""
    logged = [(record.id, record.type, ADDITION, f"Retried as task {task.id}") for record, task in retried]
    return (logged, f"Enqueued {len(retried)} retry task(s).{note}{_repeats_note(repeats)}")


def _enqueue_copies(records: Sequence[ResultRecord], copy_ids: Sequence[str]) -> list[producer.EnqueuedTask | None]:
    """Enqueue each task's copy under its id; None for a copy already made (its record exists), pushing nothing."""
    made = [fields is not None for fields in get_broker().records.get_results(copy_ids)]
    requests = [
        producer.TaskRequest(
            type=r.type,
            args=r.args,
            kwargs=r.kwargs,
            queue=r.queue,
            priority=r.priority,
            headers={RETRY_OF_HEADER: r.id, **_workflow_headers(r)},
            task_id=copy_id,
            fresh_id=False,  # the caller's id: a repeat of it is a duplicate
        )
        for r, copy_id, found in zip(records, copy_ids, made, strict=True)
        if not found
    ]
    pushed = iter(producer.enqueue_many(requests))
    return [None if found else next(pushed) for found in made]


def _workflow_headers(record: ResultRecord) -> dict[str, str]:
    """Headers that make a retry of a workflow's task settle its place in it (a stopped workflow goes on)."""
    return {WORKFLOW_HEADER: record.workflow, WORKFLOW_PATH_HEADER: record.workflow_path} if record.workflow else {}


def _repeats_note(repeats: Sequence[str]) -> str:
    if not repeats:
        return ""
    more = len(repeats) - NAMED_REPEATS
    named = ", ".join(repeats[:NAMED_REPEATS]) + (f" and {more} more" if more > 0 else "")
    return f" {len(repeats)} already retried as {named} (a repeated request), not enqueued again."


def delete(selection: Selection) -> Outcome:
    """Delete the records of finished tasks and their history entries (a queued or running task keeps its record)."""
    records = selection.records
    finished = [r for r in records if r.status in FINISHED]
    replies = get_broker().records.delete_finished([(r.queue, r.id) for r in finished])
    deleted = [r for r, reply in zip(finished, replies, strict=True) if reply == history.DELETED]
    kept = len(records) - len(finished) + replies.count(history.KEPT)
    note = f" {kept} not finished (or cancelled, still in their queue), kept." if kept else ""
    logged = [(r.id, r.type, DELETION, "Deleted the task's record") for r in deleted]
    return logged, f"Deleted {len(deleted)} record(s).{note}"


def cancel(selection: Selection, *, force: bool = False) -> Outcome:
    """Cancel each task: one not started never runs, a running one is asked to stop (or stopped, `force`)."""
    records = selection.records
    replies = tasks_app.cancel_many([r.id for r in records], cancelled_by=selection.actor, force=force)
    acted = {reply.task_id: reply.outcome for reply in replies if reply.outcome in (CANCELLED, REQUESTED)}
    what = "Cancel by force" if force else "Cancel"
    logged = [(r.id, r.type, CHANGE, f"{what}: {acted[r.id]}") for r in records if r.id in acted]
    stopped = sum(outcome == REQUESTED for outcome in acted.values())
    note = f" {len(records) - len(acted)} already finished, left." if len(acted) < len(records) else ""
    how = "stopped by force" if force else "asked to stop"
    return (logged, f"Cancelled {len(acted) - stopped} task(s); {stopped} running one(s) {how}.{note}")


ACTIONS: dict[str, BulkAction] = {
    action.name: action
    for action in (
        BulkAction("retry", "Retry selected tasks (enqueue a copy)", ENQUEUE_PERMISSION, retry),
        BulkAction("cancel", "Cancel selected tasks", CANCEL_PERMISSION, cancel),
        BulkAction(
            "cancel_force",
            "Cancel selected tasks, stopping running ones by force",
            CANCEL_PERMISSION,
            partial(cancel, force=True),
        ),
        BulkAction("delete", "Delete the records of selected finished tasks", DELETE_TASK_RECORDS_PERMISSION, delete),
    )
}
