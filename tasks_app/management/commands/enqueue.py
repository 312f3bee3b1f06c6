"""`manage.py enqueue`: validate and enqueue tasks, printing one id per line."""

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.producer import MAX_BATCH, EnqueuedTask, EnqueueError, QueueUnavailable, enqueue
from tasks_app.protocol.jsontext import loads_bounded


def json_value(text: str) -> Any:
    try:
        return loads_bounded(text)
    except ValueError as exc:  # JsonTooDeep too: deeper arguments would be refused anyway
        raise argparse.ArgumentTypeError(f"invalid JSON: {exc}") from None


class Command(BaseCommand):
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
        parser.add_argument("--queue", help="Queue (default: the task type's queue).")
        parser.add_argument("--priority", type=int, default=0, help="-100..100; higher runs first.")
        parser.add_argument("--delay", type=float, default=0.0, metavar="SECONDS", help="Run no sooner than this.")
        parser.add_argument(
            "--count",
            type=int,
            default=1,
            metavar="N",
            help=f"Enqueue N identical tasks ({MAX_BATCH} per round trip: all or nothing up to that many).",
        )
        parser.add_argument(
            "--unique-key",
            metavar="KEY",
            help="Unique task types: what makes tasks the same (default: the type and arguments).",
        )

    def handle(
        self,
        *args: Any,
        type: str,
        task_args: Any,
        kwargs: Any,
        queue: str | None,
        priority: int,
        delay: float,
        count: int,
        unique_key: str | None,
        **options: Any,
    ) -> None:
        batch = partial(
            enqueue, type, task_args, kwargs, queue=queue, priority=priority, delay_s=delay, unique_key=unique_key
        )
        duplicates = self._enqueue_all(batch, count)
        if duplicates:
            self.stderr.write(
                f"{duplicates} duplicate(s) of a unique task already enqueued: its id printed, nothing pushed"
            )

    def _enqueue_all(self, batch: Callable[..., list[EnqueuedTask]], count: int) -> int:
        """Enqueue `count` tasks, MAX_BATCH per round trip, printing their ids as they go; return the duplicates."""
        if count < 1:
            raise CommandError(f"--count must be at least 1, got {count}")
        done = duplicates = 0
        while done < count:
            size = min(MAX_BATCH, count - done)
            try:
                enqueued = batch(count=size)
            except (EnqueueError, QueueUnavailable) as exc:
                before = f"{done} task(s) were enqueued before this error: " if done else ""
                raise CommandError(f"{before}{exc}") from None
            self.stdout.write("\n".join(task.id for task in enqueued))
            done += size
            duplicates += sum(task.duplicate for task in enqueued)
        return duplicates
