"""Process mode: `runconsumer --processes N` starts N consumer processes and keeps them running.

Each child is a fresh `runconsumer` (no fork: Django and Redis connections are never shared)
with an id of its own, `<id>-<n>`; a replacement reuses it, so it recovers at once what a dead
predecessor held. Each child beats on a file of its own that has no name (an unlinked temporary
file passed as `/dev/fd/N`), so a supervisor killed with SIGKILL leaves nothing on disk, and
holds the read end of a pipe whose write end only the supervisor has: at its EOF (the
supervisor gone, however it died) the child stops claiming and stops gracefully. A child that
exits with `EXIT_RECYCLE` or `EXIT_HARD_LIMIT` is replaced at
once; one that crashes, after a backoff. A child whose beat file stops advancing (wedged in C
with the GIL held) is killed with SIGKILL and replaced. SIGTERM, SIGINT or SIGHUP (see
stop_signals.py) stops every child gracefully, then the supervisor exits 0; a second signal, or
SIGQUIT, kills them and exits 1 at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from tasks_app.consumer.process_mode import EXIT_HARD_LIMIT, EXIT_RECYCLE
from tasks_app.consumer.stop_signals import SIGNAL_ECHO_S, graceful_signals  # a signal this soon: the same request
from tasks_app.problem_log import ProblemLog

logger = logging.getLogger(__name__)

# A child whose beat is older than this is wedged: killed and replaced.
STALL_S = 10.0
# How long a child may take to start beating (Django's start-up on a loaded machine).
STARTUP_S = 60.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# A child that lived this long before crashing restarts without backoff.
STABLE_AFTER_S = 30.0
TICK_S = 0.1
# How often the group's health file is refreshed from its children's.
HEALTH_EVERY_S = 1.0
# Where a process names its own open files (a container's /dev may lack the fd link; /proc then has it).
FD_DIR = Path("/dev/fd") if Path("/dev/fd").is_dir() else Path("/proc/self/fd")

ChildCommand = Callable[[int, Path, int], Sequence[str]]
"""The argv of child `n`, which touches the given beat file and watches the lifeline fd for EOF."""


@dataclass
class Child:
    """One slot of the group: its process, if running, and when it may start again."""

    index: int
    beat_file: IO[bytes]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = 0.0
    start_at: float = 0.0
    # Sent SIGTERM since the group began stopping.
    told: bool = False
    # The beat file's last mtime seen (ns), and when (monotonic): a wall-clock step never looks like a stall.
    beat_mtime: int | None = None
    beat_seen_at: float = 0.0

    @property
    def beat(self) -> Path:
        """The beat file as the child (which gets the same fd) and this process name it."""
        return FD_DIR / str(self.beat_file.fileno())


def describe_exit(returncode: int) -> str:
    """`exited with status 3`, or `was killed by signal 9 (SIGKILL)`."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown"
    return f"was killed by signal {-returncode} ({name})"


def child_env() -> dict[str, str]:
    """This process's environment, with its import path: a child imports what the supervisor did."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)}


class Supervisor:
    """Runs N consumer processes until stopped (or, in burst mode, until each has exited 0)."""

    def __init__(
        self, command: ChildCommand, processes: int, *, burst: bool = False, health_file: str | None = None
    ) -> None:
        self.command = command
        self.burst = burst
        self.health_file = Path(health_file) if health_file else None
        self.health_stale_s = 3 * HEALTH_EVERY_S + 15.0
        # Nameless (O_TMPFILE where it can): the OS frees each once no process holds it. Closed by run().
        self.children = [Child(n, tempfile.TemporaryFile()) for n in range(processes)]  # noqa: SIM115
        self._lifeline, self._lifeline_end = os.pipe()  # the children's read end; the write end only here
        self._signals: list[float] = []
        self._quit = False
        self._stopping = False
        self._health_at = 0.0
        self._health_problem: ProblemLog[str] = ProblemLog(logger)  # met at every refresh while it lasts

    def run(self) -> int:
        """Start the children and watch them; return the exit code."""
        for signum in graceful_signals():
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGQUIT, self._on_quit)
        logger.info("supervisor %d starting %d consumer process(es)", os.getpid(), len(self.children))
        try:
            return self._watch()
        finally:
            for child in self.children:
                child.beat_file.close()
            os.close(self._lifeline)
            os.close(self._lifeline_end)

    def _watch(self) -> int:
        while True:
            if self._quit or self._second_signal():
                return self._kill_all()
            for child in self.children:
                self._tend(child)
            self._refresh_health()
            if all(child.process is None and (self._stopping or child.start_at < 0) for child in self.children):
                logger.info("supervisor %d: every consumer process has exited", os.getpid())
                return 0
            time.sleep(TICK_S)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(time.monotonic())
        if not self._stopping:
            self._stopping = True
            logger.info("signal %d: stopping every consumer process gracefully; send again to kill them", signum)

    def _on_quit(self, signum: int, frame: FrameType | None) -> None:
        self._quit = True

    def _second_signal(self) -> bool:
        return any(at - self._signals[0] >= SIGNAL_ECHO_S for at in self._signals[1:])

    def _kill_all(self) -> int:
        reason = "SIGQUIT" if self._quit else "second signal"
        logger.warning("%s: killing every consumer process; their leases will recover what they held", reason)
        for child in self.children:
            self._send(child, signal.SIGKILL)
            if child.process is not None:
                child.process.wait()
        return 1

    def _send(self, child: Child, signum: int) -> None:
        if child.process is not None and child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signum)

    def _tend(self, child: Child) -> None:
        """Start, reap or kill one child as its state asks."""
        if child.process is None:
            if not self._stopping and 0 <= child.start_at <= time.monotonic():
                self._start(child)
            return
        if self._stopping and not child.told:
            self._send(child, signal.SIGTERM)
            child.told = True
        returncode = child.process.poll()
        if returncode is not None:
            self._exited(child, returncode)
        elif self._stalled(child):
            logger.error(
                "consumer process %d (pid %d) stopped beating for %g s (wedged): killing it",
                child.index,
                child.process.pid,
                STALL_S,
            )
            child.process.kill()

    def _start(self, child: Child) -> None:
        os.utime(child.beat_file.fileno(), ns=(0, 0))  # not beating yet
        child.beat_mtime = None
        argv = list(self.command(child.index, child.beat, self._lifeline))
        try:
            child.process = subprocess.Popen(argv, env=child_env(), pass_fds=(child.beat_file.fileno(), self._lifeline))
        except OSError as exc:  # fork refused (a process limit, memory): a crash at start, not the group's end
            self._back_off(child, lived_s=0.0)
            logger.error(
                "consumer process %d could not start: %s; trying again in %.1f s", child.index, exc, child.backoff_s
            )
            return
        child.started_at = time.monotonic()
        logger.info("consumer process %d started (pid %d)", child.index, child.process.pid)

    def _stalled(self, child: Child) -> bool:
        """True once the beat file has not changed for STALL_S (or not appeared for STARTUP_S)."""
        now = time.monotonic()
        mtime = os.fstat(child.beat_file.fileno()).st_mtime_ns
        if not mtime:
            return now - child.started_at > STARTUP_S
        if mtime != child.beat_mtime:
            child.beat_mtime, child.beat_seen_at = mtime, now
        return now - child.beat_seen_at > STALL_S

    def _exited(self, child: Child, returncode: int) -> None:
        assert child.process is not None
        pid, lived_s = child.process.pid, time.monotonic() - child.started_at
        child.process = None
        if self._stopping:
            logger.info("consumer process %d (pid %d) %s", child.index, pid, describe_exit(returncode))
            return
        if returncode == 0 and self.burst:
            child.start_at = -1  # burst: it found the queues idle; not replaced
            return
        if returncode in (0, EXIT_RECYCLE, EXIT_HARD_LIMIT):
            logger.warning("consumer process %d (pid %d) %s; replacing it", child.index, pid, describe_exit(returncode))
            child.backoff_s, child.start_at = 0.0, time.monotonic()
            return
        self._back_off(child, lived_s)
        logger.error(
            "consumer process %d (pid %d) %s after %.1f s; replacing it in %.1f s",
            child.index,
            pid,
            describe_exit(returncode),
            lived_s,
            child.backoff_s,
        )

    @staticmethod
    def _back_off(child: Child, lived_s: float) -> None:
        """Schedule a crashed child's replacement: at once after a stable run, else after a doubling backoff."""
        stable = lived_s >= STABLE_AFTER_S
        child.backoff_s = 0.0 if stable else min(MAX_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * child.backoff_s))
        child.start_at = time.monotonic() + child.backoff_s

    def _refresh_health(self) -> None:
        """Touch the group's health file while every child's own health file is fresh."""
        now = time.time()
        if self.health_file is None or now - self._health_at < HEALTH_EVERY_S:
            return
        self._health_at = now
        for child in self.children:
            try:
                if now - Path(f"{self.health_file}.{child.index}").stat().st_mtime > self.health_stale_s:
                    return
            except FileNotFoundError:
                return
        try:  # a file it cannot write leaves the group's probe a stale file, never the group without its supervisor
            self.health_file.touch()
        except OSError as exc:
            message = "cannot touch the group's health file %s: %s"
            self._health_problem.failed("health file", repr(exc), message, self.health_file, exc, level=logging.ERROR)
            return
        self._health_problem.recovered("health file", "group's health file %s touched again", self.health_file)
