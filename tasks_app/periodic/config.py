"""Periodic tasks as the scheduler sees them: immutable snapshots of the enabled rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tasks_app.models import PeriodicTask, argument_errors
from tasks_app.periodic.problems import ScheduleProblems
from tasks_app.periodic.schedule import InvalidSchedule, Schedule
from tasks_app.protocol.records import ms_of_datetime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeriodicConfig:
    """One PeriodicTask row, frozen: what to enqueue and when."""

    name: str
    task_type: str
    schedule: Schedule
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    queue: str = ""  # empty: the task type's queue
    # The type's queue read with the row: a move of the type reaches the scheduler with its rows (TaskType.save).
    type_queue: str = ""
    priority: int = 0
    catch_up: str = PeriodicTask.CatchUp.SKIP
    enabled: bool = True
    saved_ms: int = 0  # the row's last save (epoch ms)

    @classmethod
    def from_model(cls, row: PeriodicTask) -> PeriodicConfig:
        """Snapshot a row; raise InvalidSchedule if its schedule cannot produce slots or its arguments are not JSON."""
        # A row saved past the admin (raw SQL): firing other arguments than the row's would run a job nobody asked for.
        if errors := argument_errors(row.args, row.kwargs):
            raise InvalidSchedule(" ".join(errors.values()))
        schedule = Schedule(row.interval_s, (row.cron or "").strip(), row.timezone, row.start_at, row.end_at)
        return cls(
            name=row.name,
            task_type=row.task_type.name,
            schedule=schedule,
            args=list(row.args),
            kwargs=dict(row.kwargs),
            queue=row.queue,
            type_queue=row.task_type.queue,
            priority=row.priority,
            catch_up=row.catch_up,
            enabled=row.enabled,
            saved_ms=ms_of_datetime(row.updated_at),
        )

    @property
    def target_queue(self) -> str | None:
        """The runs' queue: the row's own, else its type's as read with the row (None: as the producer reads it)."""
        return self.queue or self.type_queue or None


def load_configs(*, problems: ScheduleProblems | None = None) -> list[PeriodicConfig]:
    """Snapshot the enabled rows in one query; a row whose schedule is invalid (saved past the admin) is left out."""
    problems = problems or ScheduleProblems(logger)
    configs = []
    rows = list(PeriodicTask.objects.filter(enabled=True).select_related("task_type").order_by("name"))
    for row in rows:
        try:
            configs.append(PeriodicConfig.from_model(row))
        except InvalidSchedule as exc:
            message = "periodic task %s is not scheduled (said once until it changes): %s"
            problems.failed(row.name, "schedule", ms_of_datetime(row.updated_at), str(exc), message, row.name, exc)
        else:
            problems.resolved(row.name, "schedule")
    problems.keep_only({row.name for row in rows})
    return configs
