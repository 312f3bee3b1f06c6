"""Schedules as operators see them (command, dashboard, admin): next run, last fired run, validity."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from redis.exceptions import RedisError

from tasks_app.models import PeriodicTask
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.schedule import InvalidSchedule, Schedule
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.periodic import PeriodicState
from tasks_app.protocol.records import datetime_of_ms
from tasks_app.protocol.scripts import is_transient


@dataclass(frozen=True)
class ScheduleStatus:
    """One periodic task: its schedule in words, next run, last fired run (None when unknown)."""

    name: str
    task_type: str
    queue: str
    schedule: str
    enabled: bool
    source: str
    next_run: datetime | None
    last_slot: datetime | None
    last_task_id: str
    error: str  # why the row is not scheduled ("" when it is)
    state_error: str  # why its state (last run) is unknown: "Redis unavailable" ("" when known)


def schedule_statuses(broker: Broker, rows: list[PeriodicTask] | None = None) -> list[ScheduleStatus]:
    """The status of each row (default: all), reading every schedule's state from Redis in one round trip."""
    if rows is None:
        rows = list(PeriodicTask.objects.select_related("task_type").order_by("name"))
    queues = [row.queue or row.task_type.queue for row in rows]
    states: list[PeriodicState | None]
    try:
        states = list(broker.periodic.periodic_states(list(zip(queues, [row.name for row in rows], strict=True))))
    except RedisError as exc:
        if not is_transient(exc):
            raise
        states = [None] * len(rows)  # Redis away
    now_ms = int(time.time() * 1000)
    return [_status(row, queue, state, now_ms) for row, queue, state in zip(rows, queues, states, strict=True)]


def _status(row: PeriodicTask, queue: str, state: PeriodicState | None, now_ms: int) -> ScheduleStatus:
    schedule: Schedule | None = None
    try:
        schedule, error = PeriodicConfig.from_model(row).schedule, ""
    except InvalidSchedule as exc:
        error = str(exc)
    next_ms = schedule.next_after(now_ms) if schedule and row.enabled else None
    last_ms = state.fired_slot_ms if state else None
    return ScheduleStatus(
        name=row.name,
        task_type=row.task_type.name,
        queue=queue,
        schedule=schedule.describe() if schedule else row.cron or f"{row.interval_s} s",
        enabled=row.enabled,
        source=row.source,
        next_run=datetime_of_ms(next_ms) if next_ms is not None else None,
        last_slot=datetime_of_ms(last_ms) if last_ms is not None else None,
        last_task_id=state.task_id if state else "",
        error=error,
        state_error="" if state else "Redis unavailable",
    )
