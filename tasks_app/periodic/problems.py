"""Problems of periodic schedules, each logged once (per process) until its row changes or it goes away."""

from __future__ import annotations

import logging
from collections.abc import Collection

from tasks_app.problem_log import ProblemLog

# What a schedule is once a problem of each kind has gone away, for the line that says so.
RECOVERY = {"schedule": "is scheduled again", "firing": "fires again", "error": "is tended without error again"}


class ScheduleProblems:
    """Per schedule and kind of problem, the one last logged."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log: ProblemLog[tuple[str, str]] = ProblemLog(logger, remind_every_s=None)

    def failed(
        self,
        name: str,
        kind: str,
        saved_ms: int,
        problem: str,
        message: str,
        *args: object,
        level: int = logging.ERROR,
        exc_info: bool = False,
    ) -> None:
        """Log `message` unless `problem` of schedule `name` (its row saved at `saved_ms`) was the last one said."""
        self._log.failed((name, kind), (saved_ms, problem), message, *args, level=level, exc_info=exc_info)

    def resolved(self, name: str, kind: str) -> None:
        """Log that schedule `name` has no problem of `kind` any more, if it had one."""
        self._log.recovered((name, kind), "periodic task %s %s", name, RECOVERY[kind])

    def keep_only(self, names: Collection[str]) -> None:
        """Forget the problems of schedules not among `names` (deleted or disabled): nothing to recover from."""
        self._log.keep_only(lambda key: key[0] in names)
