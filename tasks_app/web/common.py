"""What the staff pages share: the admin's context, and reading a task's result record."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
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
