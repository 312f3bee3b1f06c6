"""`manage.py queuestats`: per queue pending / processing / delayed / dead, and live consumers."""

import json
from typing import Any

from django.core.management.base import CommandParser

from tasks_app.management.outages import QueueCommand
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.refusals import read_each
from tasks_app.task_types import listed_queues


class Command(QueueCommand):
    help = "Show per-queue counts (pending, processing, delayed, dead) and live consumers."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    def handle(self, *args: Any, json: bool, **options: Any) -> None:
        broker = get_broker()
        # Where Redis refuses the queue set (a foreign key's type), the task types' queues, and one line saying why.
        queues, queue_set_refused = listed_queues(broker)
        if queue_set_refused:
            self.stderr.write(queue_set_refused)
        # A queue whose keys Redis refuses to count (a foreign key's type) is listed with the error.
        by_queue, unreadable = read_each(queues, broker.queue_stats)
        stats = list(by_queue.values())
        if json:
            refusal = {"queue_set_unreadable": queue_set_refused} if queue_set_refused else {}
            self.stdout.write(_dumps({"queues": [s.as_dict() for s in stats], "unreadable": unreadable, **refusal}))
            return
        header = f"{'queue':<24}{'pending':>10}{'processing':>12}{'delayed':>10}{'dead':>8}{'consumers':>11}  state"
        self.stdout.write(header)
        for s in stats:
            self.stdout.write(
                f"{s.queue:<24}{s.pending:>10}{s.processing:>12}{s.delayed:>10}{s.dead:>8}{len(s.consumers):>11}"
                f"  {'paused' if s.paused else 'running'}"
            )
        for queue, error in unreadable.items():
            self.stdout.write(f"{queue:<24}unreadable: {error}")
        for s in stats:
            for consumer in s.consumers:
                self.stdout.write(f"  {s.queue}: consumer {consumer['id']} in flight {consumer['in_flight']}")


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True)
