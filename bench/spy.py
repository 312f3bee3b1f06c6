"""py-spy attached to a worker process of any system, and a summary of what it recorded (standard library only).

Peer drivers import it from their own virtualenvs (py-spy attaches by pid to any Python), so
nothing here may import a third-party package. py-spy itself comes from the "[profile]" section
of requirements-peers.txt, in .run/peers/profile.
"""

from __future__ import annotations

import collections
import json
import os
import re
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
    plain_start: Callable[[], Any],
    options: SpyOptions,
    started: Callable[[], bool] | None = None,
    counters: Callable[[], dict[str, float]] | None = None,
) -> Callable[[], Any]:
    """Wrap a worker start so py-spy records the worker (from when `started()` holds, if given) until it stops.

    py-spy's own log goes to `options.out` with the suffix ".log"; what the recording spanned to ".json":
    seconds, the worker's CPU seconds (in all, in the kernel, by thread name), py-spy's, the change of `counters`.
    """

    def start_profiled():
        worker = plain_start()
        if started is not None:
            wait_for(lambda: started() or worker.process.poll() is not None, 60, "the worker never started a task")
        log = options.out.with_suffix(".log").open("wb")
        spy = subprocess.Popen(options.argv(worker.pid), stdout=log, stderr=subprocess.STDOUT)
        first = snapshot(worker.pid, counters)
        original_stop = worker.stop

        def stop(timeout_s: float = 15) -> None:
            spanned = window(first, snapshot(worker.pid, counters))
            spanned["py_spy_cpu_s"] = round(sum(cpu_seconds(Path(f"/proc/{spy.pid}/stat"))), 3)
            options.out.with_suffix(".json").write_text(json.dumps(spanned) + "\n")
            original_stop(timeout_s)
            spy.wait(30)
            log.close()

        worker.stop = stop
        return worker

    return start_profiled


def snapshot(pid: int, counters: Callable[[], dict[str, float]] | None) -> dict[str, Any]:
    """Now: the time, the CPU seconds of process `pid` and of its live threads by name, and `counters()`."""
    return {
        "at": time.perf_counter(),
        "cpu": cpu_seconds(Path(f"/proc/{pid}/stat")),
        "threads": thread_cpu_seconds(pid),
        "counters": counters() if counters else {},
    }


def window(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """What changed from one snapshot to a later one."""
    return {
        "seconds": round(last["at"] - first["at"], 3),
        "worker_cpu_s": round(sum(last["cpu"]) - sum(first["cpu"]), 3),
        "worker_system_cpu_s": round(last["cpu"][1] - first["cpu"][1], 3),
        "thread_cpu_s": {name: round(s - first["threads"].get(name, 0.0), 3) for name, s in last["threads"].items()},
        **{name: round(value - first["counters"][name], 6) for name, value in last["counters"].items()},
    }


def cpu_seconds(stat: Path) -> tuple[float, float]:
    """(user, system) CPU seconds from a /proc stat file ((0, 0) if it is gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each live thread of `pid`, summed by thread name (/proc comm)."""
    found: collections.Counter[str] = collections.Counter()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        found[name] += sum(cpu_seconds(task / "stat"))
    return dict(found)


def hottest(out: Path) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Count the samples of py-spy's raw output: (total, inclusive by function, self by function)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    # Lines end with "\n" only: a frame name py-spy read mid-change can hold other line breaks,
    # and such a line (no sample count at its end) is skipped.
    for line in out.read_text(errors="replace").split("\n"):
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
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
    """A py-spy frame "Class.function (package/file.py:line)" named as "Class.function file.py:line"."""
    function, _, where = frame.partition(" (")
    return f"{function} {where.rstrip(')').rsplit('/', 1)[-1]}" if where else function


def spanned(out: Path) -> dict[str, Any]:
    """What the recording into `out` spanned (see `profiled`) and py-spy's failed samplings, where known."""
    path, log = out.with_suffix(".json"), out.with_suffix(".log")
    found = json.loads(path.read_text()) if path.exists() else {}
    # py-spy's last line: "Samples: N Errors: M"; an error is a sampling whose stacks it could not read.
    errors = re.findall(r"Errors: (\d+)", log.read_text(errors="replace")) if log.exists() else []
    return found | ({"py_spy_errors": int(errors[-1])} if errors else {})
