"""The task browser's bulk actions: each one entry of ACTIONS, with its permission, and one admin log entry per task."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from django.conf import settings
from django.contrib.admin.models import ADDITION, CHANGE, DELETION

import tasks_app
from tasks_app import producer
from tasks_app.models import CANCEL_PERMISSION, DELETE_TASK_RECORDS_PERMISSION, ENQUEUE_PERMISSION
from tasks_app.protocol import history
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.control import CANCELLED, REQUESTED
from tasks_app.protocol.records import FINISHED, RETRY_OF_HEADER, ResultRecord, ResultUpdate

# At most this many tasks are acted on at once (a page holds at most 200).
MAX_SELECTED = 500
# The namespace of retry ids (uuid5): fixed, or a request repeated across a change would enqueue a second copy.
RETRY_ID_NAMESPACE = uuid.UUID("5f0c0b52-8e0a-4c51-9a7e-3d1b2f64a9c1")
# A repeated request's copies named in its answer; more are counted.
NAMED_REPEATS = 3


@dataclass(frozen=True)
class Selection:
    """The selected tasks (their records as they are now), who acts, and what the page showed of each."""

    records: Sequence[ResultRecord]
    actor: str  # "user:<name>"
    # Each task's `retried_as` as the page showed it, by task id (missing: none shown).
    shown_retried_as: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What an action did: the admin log entries to write (task id, type, flag, message) and what to tell the user."""

    logged: list[tuple[str, str, int, str]]
    message: str


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
    return Outcome(logged, f"Enqueued {len(retried)} retry task(s).{note}{_repeats_note(repeats)}")


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
            headers={RETRY_OF_HEADER: r.id},
            task_id=copy_id,
            fresh_id=False,  # the caller's id: a repeat of it is a duplicate
        )
        for r, copy_id, found in zip(records, copy_ids, made, strict=True)
        if not found
    ]
    pushed = iter(producer.enqueue_many(requests))
    return [None if found else next(pushed) for found in made]


def _repeats_note(repeats: Sequence[str]) -> str:
    """What the answer says of the tasks a repeated request retried already ("" when none)."""
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
    return Outcome(
        [(r.id, r.type, DELETION, "Deleted the task's record") for r in deleted],
        f"Deleted {len(deleted)} record(s).{note}",
    )


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
