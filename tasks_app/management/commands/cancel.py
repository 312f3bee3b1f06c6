"""`manage.py cancel [--force] ID [ID...]`: cancel tasks, saying what became of each; fails on unknown or finished."""

import getpass
import os
from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks_app.control import CANCELLED, FINISHED, REQUESTED, cancel_many
from tasks_app.management.base import QueueCommand

DONE = {CANCELLED: "cancelled (it will not run)", REQUESTED: "running: asked to stop"}
FORCED = {**DONE, REQUESTED: "running: stopped by force"}


def cli_user() -> str:
    """Who runs the command: the login name, else the uid (a container's user may have neither name nor USER)."""
    try:
        return getpass.getuser()
    except OSError:
        return f"uid:{os.getuid()}"


class Command(QueueCommand):
    help = "Cancel tasks by id: queued ones never run, running ones are asked to stop (with --force, stopped)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("ids", nargs="+", metavar="ID", help="Task ids.")
        parser.add_argument("--by", default="", help="Who cancels, stored in the record (default: cli:<user>).")
        parser.add_argument(
            "--force",
            action="store_true",
            help="Stop running tasks: TaskCancelled raised in them; in process mode, their process is replaced "
            "if they have not ended within --timeout-grace.",
        )

    def handle(self, *args: Any, ids: list[str], by: str, force: bool, **options: Any) -> None:
        replies = cancel_many(ids, cancelled_by=by or f"cli:{cli_user()}", force=force)
        done = FORCED if force else DONE
        problems = []
        for reply in replies:
            if reply.outcome in done:
                self.stdout.write(f"{reply.task_id} {done[reply.outcome]}")
            elif reply.outcome == FINISHED:
                problems.append(f"task {reply.task_id} already finished ({reply.status})")
            else:
                problems.append(f"no task {reply.task_id} (unknown, or its record has expired)")
        if problems:
            raise CommandError("; ".join(problems))
