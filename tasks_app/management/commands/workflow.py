"""`manage.py workflow show|cancel ID`: a workflow's status and tree as JSON, or cancel it."""

import json
from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks_app.management.base import QueueCommand
from tasks_app.management.commands.cancel import cli_user
from tasks_app.workflows import WorkflowError, cancel_workflow, get_workflow


class Command(QueueCommand):
    help = "Show a workflow (status, counts, tree) as JSON, or cancel it: it starts nothing more."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["show", "cancel"])
        parser.add_argument("id", metavar="ID", help="Workflow id.")
        parser.add_argument("--by", default="", help="Who cancels, stored with it (default: cli:<user>).")

    def handle(self, *args: Any, action: str, id: str, by: str, **options: Any) -> None:
        try:
            if action == "show":
                self.stdout.write(json.dumps(get_workflow(id).as_json(), indent=2))
                return
            cancelled = cancel_workflow(id, cancelled_by=by or f"cli:{cli_user()}")
        except WorkflowError as exc:
            raise CommandError(str(exc)) from None
        if not cancelled.cancelled:
            raise CommandError(f"workflow {id} already ended ({cancelled.status})")
        self.stdout.write(f"{id} cancelled; {len(cancelled.task_ids)} started task(s) asked to stop")
