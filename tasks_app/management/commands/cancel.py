"""`manage.py cancel ID [ID...]`: cancel tasks; prints what happened to each, fails if any was unknown or finished."""

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.control import CANCELLED, FINISHED, REQUESTED, cancel_many

DONE = {CANCELLED: "cancelled (it will not run)", REQUESTED: "running: asked to stop"}


class Command(BaseCommand):
    help = "Cancel tasks by id: queued ones never run, running ones are asked to stop."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("ids", nargs="+", metavar="ID", help="Task ids.")
        parser.add_argument("--by", default="", help="Who cancels, stored in the record (default: cli:<user>).")

    def handle(self, *args: Any, ids: list[str], by: str, **options: Any) -> None:
        replies = cancel_many(ids, cancelled_by=by or f"cli:{getpass.getuser()}")
        problems = []
        for reply in replies:
            if reply.outcome in DONE:
                self.stdout.write(f"{reply.task_id} {DONE[reply.outcome]}")
            elif reply.outcome == FINISHED:
                problems.append(f"task {reply.task_id} already finished ({reply.status})")
            else:
                problems.append(f"no task {reply.task_id} (unknown, or its record has expired)")
        if problems:
            raise CommandError("; ".join(problems))
