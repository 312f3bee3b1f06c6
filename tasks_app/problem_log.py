"""Problems that persist (Redis away, the database away, a bad row): said once, recalled now and then, and their end."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# While the same problem persists, a short reminder (with how often it recurred) is logged this often.
REMIND_EVERY_S = 60.0


@dataclass
class _Open:
    problem: Hashable
    level: int
    since: float
    said_at: float
    repeats: int = 0  # since it was last said


class ProblemLog[K: Hashable]:
    """Per key (a loop, a schedule), the problem last logged."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        remind_every_s: float | None = REMIND_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._remind_every_s = remind_every_s
        self._clock = clock
        self._open: dict[K, _Open] = {}
        self._lock = threading.Lock()

    def failed(
        self,
        key: K,
        problem: Hashable,
        message: str,
        *args: object,
        level: int | None = None,
        exc_info: bool = False,
    ) -> bool:
        """Log `message` if `problem` is new for `key`, else a reminder when one is due; True if a line was logged."""
        level = level if level is not None else logging.ERROR if exc_info else logging.WARNING
        now = self._clock()
        with self._lock:
            seen = self._open.get(key)
            if seen is None or seen.problem != problem:
                self._open[key] = _Open(problem, level, now, now)
                reminder = None
            elif self._remind_every_s is None or now - seen.said_at < self._remind_every_s:
                seen.repeats += 1
                return False
            else:
                reminder = (seen.repeats + 1, now - seen.said_at)
                seen.said_at, seen.repeats = now, 0
        if reminder is None:
            self._logger.log(level, message, *args, exc_info=exc_info)
        else:
            self._logger.log(level, message + " (still so: %d time(s) in the last %.0f s)", *args, *reminder)
        return True

    def recovered(self, key: K, message: str, *args: object) -> bool:
        """Log `message` if `key` had a problem, which it no longer has; True if it had."""
        if key not in self._open:  # the common case, on every pass of a loop: no lock taken
            return False
        with self._lock:
            seen = self._open.pop(key, None)
        if seen is None:
            return False
        self._logger.log(
            min(seen.level, logging.WARNING), message + " (after %.0f s)", *args, self._clock() - seen.since
        )
        return True

    def keep_only(self, kept: Callable[[K], bool]) -> None:
        """Forget the problems of keys not `kept` (gone): there is no recovery to log for them."""
        with self._lock:
            self._open = {key: seen for key, seen in self._open.items() if kept(key)}
