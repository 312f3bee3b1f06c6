"""Process mode and stop signals: `runconsumer --processes N` starts N consumer processes and keeps them running.

Each child is a fresh `runconsumer` with the id `<id>-<n>`, which its replacement reuses to recover at
once what it held. A child beats on an unlinked file (killed and replaced once the beat stops) and
stops at the EOF of a pipe only the supervisor writes. Signals as in Celery and gunicorn: SIGTERM,
SIGINT and SIGHUP stop gracefully, a second one (or SIGQUIT) exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from tasks_app.consumer.loops import touch
from tasks_app.consumer.options import ConsumerOptions
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

# The argv of child `n`, which touches the given beat file and watches the lifeline fd for EOF.
ChildCommand = Callable[[int, Path, int], Sequence[str]]


@dataclass
class Child:
    """One place in the group: its process, if running, and when it may start again."""

    index: int
    beat_file: IO[bytes]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = 0.0
    start_at: float = 0.0
    told: bool = False  # sent SIGTERM since the group began stopping
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
            while not (self._quit or any(at - self._signals[0] >= SIGNAL_ECHO_S for at in self._signals[1:])):
                for child in self.children:
                    self._tend(child)
                self._refresh_health()
                if all(child.process is None and (self._stopping or child.start_at < 0) for child in self.children):
                    logger.info("supervisor %d: every consumer process has exited", os.getpid())
                    return 0
                time.sleep(TICK_S)
            return self._kill_all()
        finally:
            for child in self.children:
                child.beat_file.close()
            os.close(self._lifeline)
            os.close(self._lifeline_end)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(time.monotonic())
        if not self._stopping:
            self._stopping = True
            logger.info("signal %d: stopping every consumer process gracefully; send again to kill them", signum)

    def _on_quit(self, signum: int, frame: FrameType | None) -> None:
        self._quit = True

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
            message = "consumer process %d (pid %d) stopped beating for %g s (wedged): killing it"
            logger.error(message, child.index, child.process.pid, STALL_S)
            child.process.kill()

    def _start(self, child: Child) -> None:
        os.utime(child.beat_file.fileno(), ns=(0, 0))  # not beating yet
        child.beat_mtime = None
        argv = list(self.command(child.index, child.beat, self._lifeline))
        # This process's environment, with its import path: a child imports what the supervisor did.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(entry) for entry in sys.path if entry)}
        try:
            child.process = subprocess.Popen(argv, env=env, pass_fds=(child.beat_file.fileno(), self._lifeline))
        except OSError as exc:  # fork refused (a process limit, memory): a crash at start, not the group's end
            self._back_off(child, lived_s=0.0)
            message = "consumer process %d could not start: %s; trying again in %.1f s"
            logger.error(message, child.index, exc, child.backoff_s)
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
        message = "consumer process %d (pid %d) %s after %.1f s; replacing it in %.1f s"
        logger.error(message, child.index, pid, describe_exit(returncode), lived_s, child.backoff_s)

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
        # A file it cannot write leaves the group's probe a stale file, never the group without its supervisor.
        touch(self.health_file, self._health_problem, "group's health file")


EXIT_RECYCLE = 75
EXIT_HARD_LIMIT = 76
# Beyond the waits of a leaving consumer's shutdown, what its exit may take at most (s).
EXIT_MARGIN_S = 5.0
# How often a child touches its beat file (its supervisor kills a child whose beat stops).
BEAT_EVERY_S = 1.0


def rss_mb() -> float:
    """This process's resident memory in MB (its peak where /proc is absent)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


def exit_within_s(options: ConsumerOptions) -> float:
    """How long a leaving consumer may take to exit: its claimers, running tasks and last acks (see shutdown)."""
    return options.block_s + 1 + options.grace_s + options.grace_s + 5 + EXIT_MARGIN_S


class ProcessGuard:
    """Watches a consumer for process mode: beats for its supervisor, recycles it, enforces hard limits."""

    def __init__(
        self, options: ConsumerOptions, fail_hung: Callable[[float, float], int], leave: Callable[[int, str], None]
    ) -> None:
        self.options = options
        self.fail_hung = fail_hung
        self.leave = leave  # asks the consumer to stop gracefully and exit with this code, logging the reason
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
                touch(beat, self._beat_problem, "beat file")
            # Only after a run, as in Celery: a group whose every fresh process is over it still runs tasks.
            limit = self.options.max_memory_mb
            if limit is not None and self._ran and (used := rss_mb()) > limit:
                self.leave(EXIT_RECYCLE, f"uses {used:.0f} MB, over --max-memory-per-child {limit} MB: recycling")

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


# The consumer's own logger: these lines were always the consumer's.
stop_logger = logging.getLogger("tasks_app.consumer.lifecycle")

# Ctrl-C reaches the whole process group, and supervisors pass it on too: a signal this soon is the same request.
SIGNAL_ECHO_S = 1.0


def graceful_signals() -> list[signal.Signals]:
    """The signals that ask for a graceful stop: SIGTERM, SIGINT, and SIGHUP unless ignored from the start."""
    hangup = [] if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, signal.SIGINT, *hangup]


def install_stop_signals(request_stop: Callable[[], None], grace_s: float, *, supervised: bool = False) -> None:
    """Graceful signals call `request_stop`; a second one exits now unless `supervised`; SIGQUIT exits now."""
    first_signal_at: list[float] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if not first_signal_at:
            first_signal_at.append(now)
            again = "a second signal to the supervisor kills it" if supervised else "send again to exit now"
            stop_logger.info("signal %d: finishing in-flight tasks (grace %gs); %s", signum, grace_s, again)
            request_stop()
        elif not supervised and now - first_signal_at[0] >= SIGNAL_ECHO_S:
            stop_logger.warning("second signal: exiting now; the lease will recover what was held")
            os._exit(1)

    def on_quit(signum: int, frame: FrameType | None) -> None:
        stop_logger.warning("signal %d (SIGQUIT): exiting now; the lease will recover what was held", signum)
        os._exit(1)

    for signum in graceful_signals():
        signal.signal(signum, on_signal)
    signal.signal(signal.SIGQUIT, on_quit)
