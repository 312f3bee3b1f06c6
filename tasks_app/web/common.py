"""What the staff pages share: the admin's context, and reading a task's result record."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.results import ResultRecord


def admin_context(request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
    """Return the admin site's template context (header, user links) plus a title and `extra`."""
    return {**admin.site.each_context(request), "title": title, **extra}


def load_record(task_id: str) -> ResultRecord | None:
    """Return a task's result record, or None if it is unknown or expired."""
    fields = get_broker().get_result(task_id)
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
                object_id=task_id[:200],
                object_repr=f"{task_type} {task_id}"[:200],
                action_flag=flag,
                change_message=message,
            )
            for task_id, task_type, flag, message in entries
        ]
    )
