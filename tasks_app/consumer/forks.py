"""A process a handler forked is not the consumer: once it comes back into the consumer's code, it exits.

A handler may fork (a bare `os.fork()`, `multiprocessing` with the fork start method). A child
that execs or exits on its own never comes back. One that returns from the handler would go on
as a copy of the consumer that kept only the forking thread: a worker's waited for work forever;
the asyncio lane's ran its loop, shared with its parent (the same selector and wake-up socket),
and settled runs its parent settles too (as failures: retried, they ran twice). It exits at once
instead, with FORKED_CHILD_EXIT, having written nothing: a worker's as the handler returns (or
raises), the lane's as its loop gets control back after the step that forked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from typing import NoReturn

# EX_SOFTWARE: the handler that forked returned into the consumer, a bug of the handler.
FORKED_CHILD_EXIT = 70

# The lanes' loops by the thread running them, for the hook a child runs right after its fork.
_loops: dict[int, asyncio.AbstractEventLoop] = {}
_lock = threading.Lock()
_hooked = False


def call_unforked[T](call: Callable[[], T]) -> T:
    """Return `call()`; a child forked inside it exits there instead of returning (or raising)."""
    pid = os.getpid()
    try:
        return call()
    finally:
        exit_if_forked(pid)


def exit_if_forked(pid: int) -> None:
    """End this process at once unless it is `pid`: it is a child a handler forked, back in the consumer."""
    if os.getpid() != pid:
        _exit()


def guard_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Make a child forked on this thread (which runs `loop`) exit once `loop` gets control back."""
    global _hooked
    with _lock:
        if not _hooked:
            os.register_at_fork(after_in_child=_forked)
            _hooked = True
        _loops[threading.get_ident()] = loop


def unguard_loop() -> None:
    """Forget this thread's loop (the thread is about to end)."""
    with _lock:
        _loops.pop(threading.get_ident(), None)


def _forked() -> None:
    """In a child, right after its fork: if it was forked on a lane's loop, end it at the loop's next turn."""
    loop = _loops.get(threading.get_ident())  # no lock: another thread may have held it, and is gone here
    if loop is not None:
        with contextlib.suppress(RuntimeError):  # a closed loop runs nothing: its handler returns into the lane
            loop.call_soon(_exit)


def _exit() -> NoReturn:
    with contextlib.suppress(OSError):  # stderr may be closed: the exit matters, not the line
        os.write(2, f"process {os.getpid()}, forked by a handler, returned into the consumer: it exits\n".encode())
    os._exit(FORKED_CHILD_EXIT)
