"""The task browser's bulk actions: each one entry of ACTIONS, with its permission, and one admin log entry per task."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from django.conf import settings
from django.contrib.admin.models import ADDITION, CHANGE, DELETION
from django.http import HttpRequest

import tasks_app
from tasks_app import producer
from tasks_app.models import CANCEL_PERMISSION, DELETE_TASK_RECORDS_PERMISSION, ENQUEUE_PERMISSION
from tasks_app.protocol import history
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.control import CANCELLED, REQUESTED
from tasks_app.protocol.replies import ResultUpdate
from tasks_app.protocol.results import FINISHED, RETRY_OF_HEADER, ResultRecord
from tasks_app.web.common import log_task_actions

# At most this many tasks are acted on at once (a page holds at most 200).
MAX_SELECTED = 500


@dataclass(frozen=True)
class Outcome:
    """What an action did: the log entries to write (task, flag, message) and what to tell the user."""

    logged: list[tuple[ResultRecord, int, str]]
    message: str


@dataclass(frozen=True)
class BulkAction:
    """An action on selected tasks: its name in the form, its label, the permission it needs, what it does."""

    name: str
    label: str
    permission: str
    run: Callable[[Sequence[ResultRecord], str], Outcome]  # the tasks, and who acts ("user:<name>")


def retry(records: Sequence[ResultRecord], actor: str) -> Outcome:
    """Enqueue a copy of each task (type, args, kwargs, queue, priority), its record linking to the original."""
    requests = [
        producer.TaskRequest(
            type=r.type,
            args=r.args,
            kwargs=r.kwargs,
            queue=r.queue,
            priority=r.priority,
            headers={RETRY_OF_HEADER: r.id},
        )
        for r in records
    ]
    pairs = list(zip(records, producer.enqueue_many(requests), strict=True))
    # A unique type's copy is not enqueued while a task holds its key (the original itself, often).
    retried = [(record, task) for record, task in pairs if not task.duplicate]
    broker = get_broker()
    for record, task in retried:
        broker.record_result(ResultUpdate(record.id, {"retried_as": task.id}, settings.TASKS_RESULT_TTL))
    logged = [(record, ADDITION, f"Retried as task {task.id}") for record, task in retried]
    held = len(pairs) - len(retried)
    note = f" {held} not retried: a task of the same unique type and key is enqueued already." if held else ""
    return Outcome(logged, f"Enqueued {len(retried)} retry task(s).{note}")


def delete(records: Sequence[ResultRecord], actor: str) -> Outcome:
    """Delete the records of finished tasks and their history entries (a queued or running task keeps its record).

    Each record is judged as it is when deleted, not as the page read it: a dead task requeued since keeps it,
    and so does a task cancelled where it waits, until a consumer has dropped it (without it, it would run).
    """
    finished = [r for r in records if r.status in FINISHED]
    replies = get_broker().delete_finished([(r.queue, r.id) for r in finished])
    deleted = [r for r, reply in zip(finished, replies, strict=True) if reply == history.DELETED]
    kept = len(records) - len(finished) + replies.count(history.KEPT)
    note = f" {kept} not finished (or cancelled, still in their queue), kept." if kept else ""
    return Outcome(
        [(r, DELETION, "Deleted the task's record") for r in deleted], f"Deleted {len(deleted)} record(s).{note}"
    )


def cancel(records: Sequence[ResultRecord], actor: str, *, force: bool = False) -> Outcome:
    """Cancel each task: one not started never runs, a running one is asked to stop (or stopped, `force`)."""
    replies = tasks_app.cancel_many([r.id for r in records], cancelled_by=actor, force=force)
    acted = {reply.task_id: reply.outcome for reply in replies if reply.outcome in (CANCELLED, REQUESTED)}
    what = "Cancel by force" if force else "Cancel"
    logged = [(r, CHANGE, f"{what}: {acted[r.id]}") for r in records if r.id in acted]
    stopped = sum(outcome == REQUESTED for outcome in acted.values())
    note = f" {len(records) - len(acted)} already finished, left." if len(acted) < len(records) else ""
    how = "stopped by force" if force else "asked to stop"
    return Outcome(logged, f"Cancelled {len(acted) - stopped} task(s); {stopped} running one(s) {how}.{note}")


# The actions offered, in this order; an action is one entry.
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


def allowed_actions(request: HttpRequest) -> list[BulkAction]:
    """The actions this user may run."""
    return [action for action in ACTIONS.values() if request.user.has_perm(action.permission)]


def log(request: HttpRequest, logged: Sequence[tuple[ResultRecord, int, str]]) -> None:
    """One admin log entry per task acted on."""
    log_task_actions(request, ((record.id, record.type, flag, message) for record, flag, message in logged))
