"""Handlers that misbehave: odd exceptions, odd return values, odd things done to their process.

Consumer subprocesses load them with TASK_HANDLER_MODULES=ODD_HANDLER_MODULES.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from django.dispatch import receiver
from django.tasks import task
from django.tasks.signals import task_finished

from tasks_app import Retry
from tasks_app.protocol.broker import get_broker
from tasks_app.registry import handler

ODD_HANDLER_MODULES = "tests.support.handlers,tests.support.odd_handlers"
NOTES_KEY_SUFFIX = "odd:notes"
HUGE_TEXT = "x" * (10 * 1024 * 1024)


class CustomBase(BaseException):
    """A BaseException of a handler's own, neither Exception nor SystemExit."""


class Unshowable(Exception):
    """An error whose message and repr raise."""

    def __str__(self) -> str:
        raise RuntimeError("no message")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class Interrupts(Exception):
    """An error whose message raises KeyboardInterrupt."""

    def __str__(self) -> str:
        raise KeyboardInterrupt


class Huge(Exception):
    """An error whose message is 10 MB."""

    def __str__(self) -> str:
        return HUGE_TEXT


def _circular() -> BaseException:
    first, second = ValueError("first"), ValueError("second")
    first.__cause__ = first.__context__ = second
    second.__cause__ = second.__context__ = first
    return first


def _recurse() -> int:
    return _recurse() + 1


def _raise(kind: str) -> None:
    if kind == "recursion":
        _recurse()
    errors: dict[str, Callable[[], BaseException]] = {
        "system_exit": lambda: SystemExit(None),
        "keyboard_interrupt": KeyboardInterrupt,
        "generator_exit": GeneratorExit,
        "custom_base": lambda: CustomBase("custom"),
        "unshowable": Unshowable,
        "interrupts_when_shown": Interrupts,
        "huge_message": Huge,
        "circular": _circular,
        "memory_error": MemoryError,
        "retry_huge": lambda: Retry("later", in_s=10**12),
    }
    raise errors[kind]()


async def _coroutine() -> int:
    return 5


def _generator() -> Any:
    yield 1


def _value(kind: str) -> Any:
    values: dict[str, Callable[[], Any]] = {
        "generator": _generator,
        "nan": lambda: math.nan,
        "inf": lambda: [math.inf],
        "huge": lambda: HUGE_TEXT,
        "surrogate": lambda: "caf\udce9",
        "set": lambda: {1},
        "int_huge": lambda: 10**5000,
    }
    return values[kind]()


@handler("odd.raise")
def odd_raise(kind: str) -> None:
    """Raise the odd exception named `kind`."""
    _raise(kind)


@handler("odd.return")
def odd_return(kind: str) -> Any:
    """Return the odd value named `kind`."""
    return _value(kind)


@handler("odd.async_raise")
async def odd_async_raise(kind: str) -> None:
    """`odd.raise` on the asyncio lane."""
    await asyncio.sleep(0)
    _raise(kind)


@handler("odd.async_return")
async def odd_async_return(kind: str) -> Any:
    """`odd.return` on the asyncio lane."""
    await asyncio.sleep(0)
    return _value(kind)


@task
def task_raise(kind: str) -> None:
    """`odd.raise` as a `@task` function."""
    _raise(kind)


@task
def task_return(kind: str) -> Any:
    """`odd.return` as a `@task` function."""
    return _value(kind)


@task
async def task_async_raise(kind: str) -> None:
    """`odd.raise` as an `async def` `@task` function."""
    await asyncio.sleep(0)
    _raise(kind)


@task
async def task_async_return(kind: str) -> Any:
    """`odd.return` as an `async def` `@task` function."""
    await asyncio.sleep(0)
    return _value(kind)


# --- what handlers do to their process ---------------------------------------------------------
def note(what: str) -> None:
    """Append `what` and this process's pid to the notes list."""
    broker = get_broker()
    broker.client.rpush(f"{broker.keys.prefix}:{NOTES_KEY_SUFFIX}", f"{what} {os.getpid()}")


@handler("odd.note")
def odd_note(name: str) -> str:
    """Note `name`."""
    note(name)
    return name


@handler("odd.async_note")
async def odd_async_note(name: str, sleep_s: float = 0.0) -> str:
    """Note `name` after `sleep_s` on the lane."""
    await asyncio.sleep(float(sleep_s))
    note(name)
    return name


@handler("odd.close_std")
def odd_close_std() -> str:
    """Close sys.stdout and sys.stderr, and leave a non-daemon thread running."""
    sys.stdout.close()
    sys.stderr.close()
    threading.Thread(target=time.sleep, args=(60,), daemon=False).start()
    return "closed"


@handler("odd.fork")
def odd_fork(child_s: float = 0.0) -> str:
    """Fork; the child, after `child_s`, returns from the handler as the parent does."""
    if os.fork() == 0:
        time.sleep(float(child_s))
        note("child returns")
        return "child"
    return "parent"


@handler("odd.async_fork")
async def odd_async_fork(child_s: float = 0.0) -> str:
    """Fork on the lane; the child's coroutine goes on awaiting `child_s`, then returns."""
    child = os.fork() == 0
    if child:
        note("child forked")
    await asyncio.sleep(float(child_s))
    note("child returns" if child else "parent returns")
    return "child" if child else "parent"


@task
def task_fork(child_s: float = 0.0) -> str:
    """`odd.fork` as a `@task` function."""
    return odd_fork(child_s)


@task
async def task_async_fork(child_s: float = 0.0) -> str:
    """`odd.async_fork` as an `async def` `@task` function."""
    return await odd_async_fork(child_s)


@receiver(task_finished)
def note_fork_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    """Note where task_finished is sent for a run of a forking `@task` function."""
    if task_result.task.name in ("task_fork", "task_async_fork"):
        note("finished")
