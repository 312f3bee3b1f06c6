"""Schedules declared in code (the TASKS_PERIODIC setting), written to PeriodicTask rows marked `source=code`."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from typing import Any, cast

from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction
from django.utils import timezone

from tasks_app.models import PeriodicTask, TaskType
from tasks_app.registry import Registry
from tasks_app.task_types import UnknownTaskType, ensure_task_type

logger = logging.getLogger(__name__)

# Keys an entry of TASKS_PERIODIC may have besides "task" (the task type); each is a PeriodicTask field.
ENTRY_FIELDS = frozenset(
    {"args", "kwargs", "interval_s", "cron", "timezone", "start_at", "end_at", "queue", "priority", "catch_up"}
)


class InvalidCodeSchedule(ValueError):
    """An entry of TASKS_PERIODIC that cannot become a schedule."""


@dataclass
class SyncReport:
    """What a sync did: names created, updated, left as they were and removed, and entries refused with why."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def sync_code_schedules(entries: Mapping[str, Mapping[str, Any]], registry: Registry) -> SyncReport:
    """Create or update a `source=code` row per entry and delete code rows no entry names any more."""
    report = SyncReport()
    for name, entry in entries.items():
        try:
            outcome = _sync_one(str(name), entry, registry)
        except InvalidCodeSchedule as exc:
            report.refused[str(name)] = str(exc)
            logger.error("TASKS_PERIODIC[%r] is not scheduled: %s", name, exc)
            continue
        getattr(report, outcome).append(str(name))
    stale = PeriodicTask.objects.filter(source=PeriodicTask.Source.CODE).exclude(name__in=[str(n) for n in entries])
    report.removed = sorted(stale.values_list("name", flat=True))
    stale.delete()
    return report


def _sync_one(name: str, entry: Mapping[str, Any], registry: Registry) -> str:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("task"), str):
        raise InvalidCodeSchedule('an entry is a dict with at least "task" (a task type) and "cron" or "interval_s"')
    unknown = set(entry) - ENTRY_FIELDS - {"task"}
    if unknown:
        raise InvalidCodeSchedule(f"unknown keys {sorted(unknown)}; allowed: task, {', '.join(sorted(ENTRY_FIELDS))}")
    try:
        task_type = ensure_task_type(entry["task"], registry)
    except UnknownTaskType as exc:
        raise InvalidCodeSchedule(str(exc)) from None
    try:
        with transaction.atomic():
            return _write_row(name, entry, task_type.name)
    except IntegrityError:  # consumers starting together race to create the row: the loser updates it
        with transaction.atomic():
            return _write_row(name, entry, task_type.name)


def _write_row(name: str, entry: Mapping[str, Any], task_type: str) -> str:
    """Write one entry's row; return "created", "updated" or "unchanged"."""
    row = PeriodicTask.objects.select_for_update().filter(name=name).first() or PeriodicTask(name=name)
    created = row.pk is None
    before = _owned_values(row)
    defaults = PeriodicTask()
    for attr in ENTRY_FIELDS:
        value = entry.get(attr)  # None: not given (no column of these takes None for anything else)
        setattr(row, attr, getattr(defaults, attr) if value is None else _as_stored(attr, value))
    _read_dates(row)
    row.task_type = TaskType.objects.get(name=task_type)
    row.source = PeriodicTask.Source.CODE
    try:
        row.full_clean()
    except ValidationError as exc:
        raise InvalidCodeSchedule(
            "; ".join(f"{key}: {' '.join(msgs)}" for key, msgs in exc.message_dict.items())
        ) from None
    if not created and _owned_values(row) == before:
        return "unchanged"
    row.save()
    return "created" if created else "updated"


def _as_stored(attr: str, value: Any) -> Any:
    """Arguments as the database gives them back (a tuple as a list): an unchanged entry then equals its row."""
    if attr not in ("args", "kwargs"):
        return value
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return value  # not JSON: full_clean says what is wrong


def _read_dates(row: PeriodicTask) -> None:
    """Read start_at and end_at as the database stores them: a naive time (no offset) in the default zone."""
    for attr in ("start_at", "end_at"):
        if not isinstance(getattr(row, attr), (str, date, type(None))):  # Django's parser raises TypeError
            raise InvalidCodeSchedule(f"{attr}: give a datetime or an ISO 8601 text such as 2026-01-01T03:00:00Z")
        try:
            moment = cast(models.DateTimeField, PeriodicTask._meta.get_field(attr)).to_python(getattr(row, attr))
        except ValidationError:
            continue  # full_clean reports it
        setattr(row, attr, timezone.make_aware(moment) if moment and timezone.is_naive(moment) else moment)


def _owned_values(row: PeriodicTask) -> tuple[Any, ...]:
    return (row.source, row.task_type_id, *(getattr(row, attr) for attr in sorted(ENTRY_FIELDS)))
