"""`manage.py queuestats`: per queue pending / processing / delayed / dead, and live consumers."""

from json import dumps
from typing import Any

from django.core.management.base import CommandParser

from tasks_app.management.base import QueueCommand
from tasks_app.protocol.broker import get_broker


class Command(QueueCommand):
    help = "Show per-queue counts (pending, processing, delayed, dead) and live consumers."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    def handle(self, *args: Any, json: bool, **options: Any) -> None:
        broker = get_broker()
        stats = [broker.inspect.queue_stats(queue) for queue in broker.inspect.known_queues()]
        if json:
            self.stdout.write(dumps({"queues": [s.as_dict() for s in stats]}, indent=2, sort_keys=True))
            return
        header = f"{'queue':<24}{'pending':>10}{'processing':>12}{'delayed':>10}{'dead':>8}{'consumers':>11}  state"
        self.stdout.write(header)
        for s in stats:
            self.stdout.write(
                f"{s.queue:<24}{s.pending:>10}{s.processing:>12}{s.delayed:>10}{s.dead:>8}{len(s.consumers):>11}"
                f"  {'paused' if s.paused else 'running'}"
            )
        for s in stats:
            for consumer in s.consumers:
                self.stdout.write(f"  {s.queue}: consumer {consumer['id']} in flight {consumer['in_flight']}")
