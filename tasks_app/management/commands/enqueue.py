"""`manage.py enqueue`: validate and enqueue tasks, printing one id per line."""

import argparse
from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks_app.management.base import QueueCommand, bounded_arg
from tasks_app.producer import EnqueueError, QueueUnavailable, enqueue
from tasks_app.protocol.codec import loads_bounded
from tasks_app.protocol.keys import InvalidName, validate_name

# Tasks pushed per round trip (Sidekiq's push_bulk batch): each chunk is all or nothing.
CHUNK_TASKS = 1000
# The most tasks one run enqueues (a typo of a few zeros must not fill Redis's memory); more take several runs.
MAX_COUNT = 1_000_000


def json_value(text: str) -> Any:
    """Parse an argument given as JSON."""
    try:
        return loads_bounded(text)
    except ValueError as exc:  # JsonTooDeep too: deeper arguments would be refused anyway
        raise argparse.ArgumentTypeError(f"invalid JSON: {exc}") from None


def queue_name(text: str) -> str:
    """A valid queue name: the producer reads "" as none, but `--queue "$UNSET"` is a mistake."""
    try:
        return validate_name(text, "queue")
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


task_count = bounded_arg("task_count", 1, MAX_COUNT, f"must be from 1 to {MAX_COUNT}, got {{value}}")


class Command(QueueCommand):
    help = "Enqueue tasks of a registered type; prints one task id per line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("type", help="Task type name, e.g. demo.echo.")
        parser.add_argument(
            "--args",
            dest="task_args",
            type=json_value,
            default=[],
            metavar="JSON_ARRAY",
            help="Positional arguments as a JSON array.",
        )
        parser.add_argument(
            "--kwargs", type=json_value, default={}, metavar="JSON_OBJECT", help="Keyword arguments as a JSON object."
        )
        parser.add_argument("--queue", type=queue_name, help="Queue (default: the task type's queue).")
        parser.add_argument("--priority", type=int, default=0, help="-100..100; higher runs first.")
        parser.add_argument("--delay", type=float, default=0.0, metavar="SECONDS", help="Run no sooner than this.")
        parser.add_argument(
            "--count",
            type=task_count,
            default=1,
            metavar="N",
            help=f"Enqueue N identical tasks, 1 to {MAX_COUNT} ({CHUNK_TASKS} per round trip).",
        )
        parser.add_argument(
            "--unique-key",
            metavar="KEY",
            help="Unique task types: what makes tasks the same (default: the type and arguments).",
        )

    def handle(self, *args: Any, type: str, task_args: Any, kwargs: Any, count: int, **options: Any) -> None:
        duplicates = 0
        # One script per chunk: one script of millions of tasks would block Redis for minutes.
        for done in range(0, max(count, 1), CHUNK_TASKS):
            try:
                enqueued = enqueue(
                    type,
                    task_args,
                    kwargs,
                    queue=options["queue"],
                    priority=options["priority"],
                    delay_s=options["delay"],
                    count=min(CHUNK_TASKS, count - done),
                    unique_key=options["unique_key"],
                )
            except (EnqueueError, QueueUnavailable) as exc:
                raise CommandError(
                    f"{exc}{f' ({done} of {count} enqueued, their ids printed)' if done else ''}"
                ) from None
            self.progress_note = f" after {done + len(enqueued)} of {count} tasks were enqueued; the rest were not"
            self.stdout.write("\n".join(task.id for task in enqueued))
            self.stdout.flush()  # a reader of a pipe sees each chunk's ids as it lands
            duplicates += sum(task.duplicate for task in enqueued)
        if duplicates:
            self.stderr.write(
                f"{duplicates} duplicate(s) of a unique task already enqueued: its id printed, nothing pushed"
            )
