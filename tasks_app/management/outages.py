"""The base of the queue's thin commands: Redis or the database away, or stdout closed, is one line on stderr."""

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import InterfaceError, OperationalError
from redis.exceptions import RedisError

from tasks_app.management.parsing import with_one_line_errors


class QueueCommand(BaseCommand):
    """A command whose Redis and database failures, and a reader leaving its pipe, end it with one CommandError."""

    # What had been done when stdout closed, for its error: set by a command whose output follows its work.
    progress_note = ""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """Django's parser, its argument errors printed as one line."""
        return with_one_line_errors(super().create_parser(prog_name, subcommand, **kwargs))

    def execute(self, *args: Any, **options: Any) -> Any:
        """Run the command, turning a failed Redis or database call into a one-line CommandError."""
        try:
            return super().execute(*args, **options)
        except RedisError as exc:
            raise CommandError(f"Redis unavailable: {_one_line(exc)}") from None
        except (OperationalError, InterfaceError) as exc:
            raise CommandError(f"database unavailable: {_one_line(exc)}") from None
        except BrokenPipeError:  # `| head`: stop as a tool that SIGPIPE ends would, without a traceback
            stdout = getattr(self.stdout, "_out", None)
            if stdout is sys.stdout and stdout is not None:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())  # or the flush at exit fails too
            if not self.progress_note:
                raise SystemExit(1) from None  # only output was lost: nothing to say
            raise CommandError(f"stdout closed by its reader{self.progress_note}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
