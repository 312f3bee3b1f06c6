"""`LoopInbox`: calls handed to an event loop from other threads, made in batches, one wake-up of the loop each."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class LoopInbox:
    """Callbacks handed to one event loop from any thread, called on it in the order given.

    `call_soon_threadsafe` for each makes a handle and writes to the loop's wake-up socket every
    time; while the loop is busy, callbacks come faster than it wakes, and one scheduled drain
    takes them all. A callback is queued before the flag is read, and the drain clears the flag
    before it takes callbacks: one that found the flag set is taken by the drain that is due, one
    that found it clear schedules a drain of its own, so none is left waiting.
    """

    __slots__ = ("_calls", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._scheduled = False

    def put(self, callback: Callable[..., None], *args: Any) -> bool:
        """Have `callback(*args)` called on the loop soon; False if the loop is closed (it never will be)."""
        self._calls.append((callback, args))
        if self._scheduled:
            return True
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # "Event loop is closed"
            self._scheduled = False
            return False
        return True

    def _drain(self) -> None:
        """On the loop: make the calls queued until now (later ones wait for the next turn of the loop)."""
        self._scheduled = False
        calls = self._calls
        for _ in range(len(calls)):
            callback, args = calls.popleft()
            try:
                callback(*args)
            except Exception:  # as the loop would log a failing callback; the others are still made
                logger.exception("a callback handed to the asyncio lane's event loop raised")
