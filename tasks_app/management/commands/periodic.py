"""`manage.py periodic list|run NAME|sync`: inspect schedules, fire one run now, write code schedules to rows."""

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from tasks_app.management.base import OneLineParser, QueueCommand
from tasks_app.models import PeriodicTask
from tasks_app.periodic.code import sync_code_schedules
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import run_now
from tasks_app.periodic.status import ScheduleStatus, schedule_statuses
from tasks_app.producer import EnqueueError, QueueUnavailable
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.keys import InvalidName, validate_name
from tasks_app.registry import registry


class Command(QueueCommand):
    help = "List periodic tasks, fire one now (outside its schedule), or sync the TASKS_PERIODIC schedules."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(
            dest="action", required=True, metavar="{list,run,sync}", parser_class=OneLineParser
        )
        actions.add_parser("list", help="Name, schedule, next run, last run and enabled of every periodic task.")
        run = actions.add_parser("run", help="Enqueue one run of a periodic task now; prints its task id.")
        run.add_argument("name", help="The periodic task's name.")
        actions.add_parser("sync", help="Create, update and remove the rows of the TASKS_PERIODIC schedules.")

    def handle(self, *args: Any, action: str, name: str = "", **options: Any) -> None:
        if action == "list":
            self.stdout.write("\n".join(_table(schedule_statuses(get_broker()))))
        elif action == "run":
            self.stdout.write(_run(name))
        else:
            report = sync_code_schedules(settings.TASKS_PERIODIC, registry)
            for label in ("created", "updated", "unchanged", "removed"):
                self.stdout.write(f"{label}: {', '.join(getattr(report, label)) or '-'}")
            if report.refused:
                raise CommandError("; ".join(f"{name}: {why}" for name, why in report.refused.items()))


def _run(name: str) -> str:
    try:
        validate_name(name, "periodic task name")  # no row has another; one not UTF-8 would fail the query
    except InvalidName as exc:
        raise CommandError(str(exc)) from None
    row = PeriodicTask.objects.select_related("task_type").filter(name=name).first()
    if row is None:
        raise CommandError(f"no periodic task named {name!r}")
    try:
        row.full_clean()
        return run_now(PeriodicConfig.from_model(row)).id
    except ValidationError as exc:
        why = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in exc.message_dict.items())
        raise CommandError(f"periodic task {name!r} is invalid: {why}") from None
    except (EnqueueError, QueueUnavailable) as exc:
        raise CommandError(str(exc)) from None


def _table(statuses: list[ScheduleStatus]) -> list[str]:
    lines = [f"{'name':<28}{'schedule':<36}{'next run':<22}{'last run':<22}{'enabled':<8}"]
    for s in statuses:
        next_run = f"{s.next_run:%Y-%m-%d %H:%M:%S}" if s.next_run else "-"
        last_run = f"{s.last_slot:%Y-%m-%d %H:%M:%S}" if s.last_slot else "-"
        line = f"{s.name:<28}{s.schedule:<36}{next_run:<22}{last_run:<22}{'yes' if s.enabled else 'no':<8}"
        notes = [f"INVALID: {s.error}"] if s.error else []
        lines.append("  ".join([line, *notes, *([s.state_error] if s.state_error else [])]))
    return lines
