"""Handlers' odd values and errors: objects whose encoding or message raises, an async callable object."""

from __future__ import annotations

import asyncio
from typing import Any


class ExitsWhenShown(Exception):
    """An error whose message raises SystemExit: traceback's own shield stops only Exceptions."""

    def __str__(self) -> str:
        raise SystemExit(5)


def raises_an_error_that_exits_when_shown() -> None:
    raise ExitsWhenShown


class ExitsWhenListed(dict):
    """A mapping whose items raise SystemExit when its JSON encoding reads them."""

    def items(self) -> Any:
        raise SystemExit(4)


class Unlistable(dict):
    """A mapping whose items cannot be read (its JSON encoding raises neither TypeError nor ValueError)."""

    def items(self) -> Any:
        raise RuntimeError("items unavailable")


class AsyncAdder:
    """A handler object whose `__call__` is a coroutine function."""

    async def __call__(self, a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b
