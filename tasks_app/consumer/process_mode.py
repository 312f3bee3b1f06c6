"""A consumer as one child of `runconsumer --processes`: its beat, its recycling and its hard time limits.

A child leaves with a documented exit code, and its supervisor starts a replacement at once:
`EXIT_RECYCLE` after `--max-tasks-per-child` runs or above `--max-memory-per-child` MB,
`EXIT_HARD_LIMIT` after a handler outlived its timeout, or a forced cancel, by the grace period
(`--timeout-grace`). Either way it stops claiming, returns what it had not started and lets its
other running tasks finish.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tasks_app.consumer.options import ConsumerOptions
from tasks_app.problem_log import ProblemLog

logger = logging.getLogger(__name__)

EXIT_RECYCLE = 75
EXIT_HARD_LIMIT = 76
# Beyond the waits of a leaving consumer's shutdown, what its exit may take at most (s).
EXIT_MARGIN_S = 5.0
# How often a child touches its beat file (its supervisor kills a child whose beat stops).
BEAT_EVERY_S = 1.0

Leave = Callable[[int, str], None]
"""Asks the consumer to stop gracefully and exit with this code, logging the reason."""


def rss_mb() -> float:
    """This process's resident memory in MB (its peak where /proc is absent)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


def exit_within_s(options: ConsumerOptions) -> float:
    """How long a consumer that leaves may still take to exit: Consumer.shutdown waits for its
    claimers (block_s + 1), its running tasks (grace_s) and its last acks (grace_s + 5)."""
    return options.block_s + 1 + options.grace_s + options.grace_s + 5 + EXIT_MARGIN_S


class ProcessGuard:
    """Watches a consumer for process mode: beats for its supervisor, recycles it, enforces hard limits."""

    def __init__(self, options: ConsumerOptions, fail_hung: Callable[[float, float], int], leave: Leave) -> None:
        self.options = options
        self.fail_hung = fail_hung
        self.leave = leave
        self._ran = 0
        self._ran_lock = threading.Lock()
        # Told by the supervisor: a child orphaned while it started up has init for a parent already.
        self._parent = options.supervisor_pid or os.getppid()
        self._stop = threading.Event()
        self._beat_problem: ProblemLog[str] = ProblemLog(logger)  # met at every beat while it lasts

    def start(self) -> None:
        """Start the beat thread when supervised or recycling by memory, and the lifeline's watch."""
        if self.options.supervisor_beat or self.options.max_memory_mb:
            threading.Thread(target=self._beat_forever, name="process-guard", daemon=True).start()
        if self.options.supervisor_lifeline is not None:
            threading.Thread(target=self._watch_lifeline, name="supervisor-lifeline", daemon=True).start()

    def stop(self) -> None:
        """Stop the beat thread (the process is about to exit)."""
        self._stop.set()

    def ran_one(self) -> None:
        """Count one finished run; recycle once `max_tasks` have run."""
        limit = self.options.max_tasks
        with self._ran_lock:
            self._ran += 1
            spent = self._ran == limit
        if spent:
            self.leave(EXIT_RECYCLE, f"ran {limit} task(s) (--max-tasks-per-child): recycling")

    def watching(self, watch: Callable[[], object]) -> Callable[[], int]:
        """`watch` (the soft time limits of the running tasks), then `enforce_hard_limits`."""

        def tick() -> int:
            watch()
            return self.enforce_hard_limits()

        return tick

    def enforce_hard_limits(self) -> int:
        """Settle runs past their timeout or forced cancel plus grace, and leave; return how many (0 in thread mode)."""
        grace_s = self.options.hard_limit_grace_s
        if grace_s is None:
            return 0
        failed = self.fail_hung(grace_s, exit_within_s(self.options))
        if failed:
            self.leave(
                EXIT_HARD_LIMIT, f"{failed} handler(s) still running {grace_s:g} s past their timeout or forced cancel"
            )
        return failed

    def _beat_forever(self) -> None:
        beat = Path(self.options.supervisor_beat) if self.options.supervisor_beat else None
        wait_s = 0.0  # the first beat at once: the supervisor waits for it
        while not self._stop.wait(wait_s):
            wait_s = BEAT_EVERY_S
            if beat is not None:
                if os.getppid() != self._parent:
                    self.leave(0, "its supervisor is gone: stopping")
                self._touch(beat)
            self._check_memory()

    def _watch_lifeline(self) -> None:
        """Leave once the supervisor's end of the lifeline pipe is closed: it exited, or was killed."""
        fd = self.options.supervisor_lifeline
        assert fd is not None
        try:
            os.set_inheritable(fd, False)  # a handler's subprocess does not hold it
            while os.read(fd, 1):
                pass
        except OSError as exc:  # not a pipe after all: the beat's parent check still stands
            logger.error("cannot watch the supervisor's lifeline (fd %d): %s", fd, exc)
            return
        self.leave(0, "its supervisor is gone: stopping")

    def _touch(self, beat: Path) -> None:
        # A supervisor that crashed removed its beat files on its way out: this thread must live
        # on to see it gone (one that is still there kills a child whose beat stops).
        try:
            beat.touch()
        except OSError as exc:
            message = "cannot touch the beat file %s: %s"
            self._beat_problem.failed("beat", repr(exc), message, beat, exc, level=logging.ERROR)
            return
        self._beat_problem.recovered("beat", "beat file %s touched again", beat)

    def _check_memory(self) -> None:
        # Only after a run (as Celery does): a process over the limit from its start still runs a
        # task, so a group whose every fresh process is over it goes on instead of only restarting.
        limit = self.options.max_memory_mb
        if limit is not None and self._ran and (used := rss_mb()) > limit:
            self.leave(EXIT_RECYCLE, f"uses {used:.0f} MB, over --max-memory-per-child {limit} MB: recycling")
