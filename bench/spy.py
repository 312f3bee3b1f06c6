"""py-spy attached to a worker process of any system, and a summary of what it recorded (standard library only).

Peer drivers import it from their own virtualenvs (py-spy attaches by pid to any Python), so
nothing here may import a third-party package. py-spy itself comes from the "[profile]" section
of requirements-peers.txt, in .run/peers/profile.
"""

from __future__ import annotations

import collections
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import wait_for

DEFAULT_RATE = 250


@dataclass
class SpyOptions:
    """Where py-spy is and how it samples: `gil` keeps only the thread holding the GIL, else every active one."""

    py_spy: Path
    out: Path
    rate: int = DEFAULT_RATE
    gil: bool = True

    def argv(self, pid: int) -> list[str]:
        """py-spy's command line recording `pid` in raw (collapsed) form, samples aggregated by function."""
        argv = [str(self.py_spy), "record", "--pid", str(pid), "--format", "raw", "--function", "--nonblocking"]
        argv += ["--rate", str(self.rate), "--output", str(self.out)]
        return [*argv, "--gil"] if self.gil else argv


def profiled(
    plain_start: Callable[[], Any], options: SpyOptions, started: Callable[[], bool] | None = None
) -> Callable[[], Any]:
    """Wrap a worker start so py-spy records the worker (from when `started()` holds, if given) until it stops.

    py-spy's own log goes to `options.out` with the suffix ".log", the seconds it recorded for to ".seconds".
    """

    def start_profiled():
        worker = plain_start()
        if started is not None:
            wait_for(lambda: started() or worker.process.poll() is not None, 60, "the worker never started a task")
        log = options.out.with_suffix(".log").open("wb")
        spy = subprocess.Popen(options.argv(worker.pid), stdout=log, stderr=subprocess.STDOUT)
        attached_at = time.perf_counter()
        original_stop = worker.stop

        def stop(timeout_s: float = 15) -> None:
            options.out.with_suffix(".seconds").write_text(f"{time.perf_counter() - attached_at:.3f}\n")
            original_stop(timeout_s)
            spy.wait(30)
            log.close()

        worker.stop = stop
        return worker

    return start_profiled


def hottest(out: Path) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Count the samples of py-spy's raw output: (total, inclusive by function, self by function)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [frame for frame in stack.split(";") if frame.strip()]
        if frames and "idle" in frames[-1]:
            continue
        total += int(count)
        names = [frame_name(frame) for frame in frames] or ["(no Python frame)"]
        own[names[-1]] += int(count)
        for name in set(names):
            inclusive[name] += int(count)
    return total, inclusive, own


def frame_name(frame: str) -> str:
    """ "Class.function file.py:line" from py-spy's "Class.function (package/file.py:line)"."""
    function, _, where = frame.partition(" (")
    return f"{function} {where.rstrip(')').rsplit('/', 1)[-1]}" if where else function


def sampled(out: Path) -> float | None:
    """How many seconds py-spy recorded for (from its attach to the worker's stop), where known."""
    seconds = out.with_suffix(".seconds")
    return float(seconds.read_text()) if seconds.exists() else None
