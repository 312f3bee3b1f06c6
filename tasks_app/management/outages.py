"""The base of the queue's thin commands: Redis or the database away is one line on stderr, not a traceback."""

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import InterfaceError, OperationalError
from redis.exceptions import RedisError


class QueueCommand(BaseCommand):
    """A command whose Redis and database failures end it with a CommandError naming what was away."""

    def execute(self, *args: Any, **options: Any) -> Any:
        """Run the command, turning a failed Redis or database call into a one-line CommandError."""
        try:
            return super().execute(*args, **options)
        except RedisError as exc:
            raise CommandError(f"Redis unavailable: {_one_line(exc)}") from None
        except (OperationalError, InterfaceError) as exc:
            raise CommandError(f"database unavailable: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
