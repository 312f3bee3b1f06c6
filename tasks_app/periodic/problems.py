"""Problems of periodic schedules, each logged once (per process) until its row changes or it goes away."""

from __future__ import annotations

import logging
from collections.abc import Collection

# What a schedule is once a problem of each kind has gone away, for the line that says so.
RECOVERY = {"schedule": "is scheduled again", "firing": "fires again"}


class ProblemLog:
    """Per schedule and kind of problem, the one last logged.

    Kinds: "schedule" (the row cannot be read as a schedule) and "firing" (its slots cannot be
    fired). The scheduler meets the same problem at every reload and every slot: only a new problem,
    or the same one after the row was saved again, is worth a line, and so is its end.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._open: dict[tuple[str, str], tuple[int, str]] = {}

    def is_new(self, name: str, kind: str, saved_ms: int, problem: str) -> bool:
        """Remember `problem` of schedule `name` (its row saved at `saved_ms`); True unless it was the last one said."""
        said = (saved_ms, problem)
        if self._open.get((name, kind)) == said:
            return False
        self._open[(name, kind)] = said
        return True

    def resolved(self, name: str, kind: str) -> None:
        """Log that schedule `name` has no problem of `kind` any more, if it had one."""
        if self._open.pop((name, kind), None) is not None:
            self._logger.info("periodic task %s %s", name, RECOVERY[kind])

    def keep_only(self, names: Collection[str]) -> None:
        """Forget the problems of schedules not among `names` (deleted or disabled): nothing to recover from."""
        for key in [key for key in self._open if key[0] not in names]:
            del self._open[key]
