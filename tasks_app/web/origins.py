"""Where a task came from and what came of it, as its page links them: one entry of ORIGINS per kind of link."""

from __future__ import annotations

from dataclasses import dataclass

from tasks_app.models import PeriodicTask
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.keys import NAME_PATTERN
from tasks_app.protocol.records import ResultRecord
from tasks_app.templatetags.tasks_display import url_or_empty


@dataclass(frozen=True)
class Origin:
    """One line of the task page's "Origin" rows: a label, the linked text, and its URL ("" shows it unlinked)."""

    label: str
    text: str
    url: str
    note: str = ""  # why it is not linked, when that is not plain


def _task_link(label: str, task_id: str) -> Origin | None:
    """Another task, linked while it has a record (a bulk delete or the result TTL may have removed it)."""
    if not task_id:
        return None
    if get_broker().records.get_result(task_id) is None:
        return Origin(label, task_id, "", "its record has expired or was deleted")
    return Origin(label, task_id, url_or_empty("tasks_app:task", task_id))


def _schedule_link(name: str) -> Origin | None:
    """The periodic schedule that fired a task, linked to its admin page while the row exists."""
    if not name:
        return None
    # A foreign record's name may break the naming rule (a NUL, which PostgreSQL refuses in a query): no row has it.
    if not NAME_PATTERN.fullmatch(name):
        return Origin("Periodic schedule", name, "", "not a valid schedule name")
    row = PeriodicTask.objects.filter(name=name).only("pk").first()
    url = url_or_empty("admin:tasks_app_periodictask_change", str(row.pk)) if row else ""
    return Origin("Periodic schedule", name, url)


def task_origins(record: ResultRecord) -> list[Origin]:
    """The origin lines of a task's page."""
    origins = [
        _task_link("Retry of", record.retry_of),
        _task_link("Retried as", record.retried_as),
        _schedule_link(record.periodic),
    ]
    return [origin for origin in origins if origin is not None]
