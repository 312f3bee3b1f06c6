"""`manage.py queue pause|resume QUEUE`: stop or restart claiming from a queue (enqueues go on)."""

from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks_app.control import set_queue_paused
from tasks_app.management.base import QueueCommand
from tasks_app.protocol.keys import InvalidName, validate_name


class Command(QueueCommand):
    help = "Pause a queue (consumers stop claiming it within a second; enqueues are accepted) or resume it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["pause", "resume"], help="pause or resume")
        parser.add_argument("queue", help="Queue name, e.g. default.")
        parser.add_argument("--by", default="manage.py queue", help="Who pauses it, shown on the dashboard.")

    def handle(self, *args: Any, action: str, queue: str, by: str, **options: Any) -> None:
        try:
            validate_name(queue, "queue")
        except InvalidName as exc:
            raise CommandError(str(exc)) from None
        changed = set_queue_paused(queue, action == "pause", by=by)
        self.stdout.write(f"queue {queue} {action}d" if changed else f"queue {queue} was already {action}d")
