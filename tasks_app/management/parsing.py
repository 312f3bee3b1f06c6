"""Argument errors of the queue's commands as one line on stderr ("manage.py X: error: ..."), not argparse's usage."""

from __future__ import annotations

from functools import partial
from typing import NoReturn

from django.core.management.base import CommandError, CommandParser


def one_line_error(parser: CommandParser, message: str) -> NoReturn:
    """Exit 2 with one line naming the command and the error (raise CommandError when called from code)."""
    if parser.called_from_command_line:
        parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")
    raise CommandError(f"Error: {message}")


class OneLineParser(CommandParser):
    """A parser whose errors are one line: for a command's subcommands (`add_subparsers(parser_class=...)`)."""

    def error(self, message: str) -> NoReturn:
        """Exit with one line, see `one_line_error`."""
        one_line_error(self, message)


def with_one_line_errors(parser: CommandParser) -> CommandParser:
    """Make the parser Django built for a command print its errors as one line; return it."""
    parser.error = partial(one_line_error, parser)  # type: ignore[method-assign]
    return parser
