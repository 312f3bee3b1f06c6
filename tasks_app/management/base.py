"""The base of the queue's commands: bad arguments, Redis or the database away, or stdout closed, in one line."""

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import InterfaceError, OperationalError
from redis.exceptions import RedisError

ArgType = Callable[[str], Any]


def bounded_arg(name: str, low: float, high: float, problem: str, convert: ArgType = int) -> ArgType:
    """An argparse type taking values from `low` to `high` (`problem` names others); `name` is for text not a number."""

    def parse(text: str) -> Any:
        value = convert(text)
        if not low <= value <= high:  # also refuses nan and inf
            raise argparse.ArgumentTypeError(problem.format(value=value, text=text))
        return value

    parse.__name__ = name
    return parse


class OneLineParser(CommandParser):
    """A parser whose errors are one line ("manage.py X: error: ..."), not argparse's usage."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with one line naming the command and the error (raise CommandError when called from code)."""
        if self.called_from_command_line:
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
        raise CommandError(f"Error: {message}")


def with_one_line_errors(parser: CommandParser) -> CommandParser:
    """Make the parser Django built for a command print its errors as one line; return it."""
    parser.error = partial(OneLineParser.error, parser)  # type: ignore[method-assign, arg-type]
    return parser


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
