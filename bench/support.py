"""Benchmark plumbing shared by every bench script and peer driver (standard library only).

Peer drivers run in their own virtualenvs, so nothing here may import a third-party package.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from private_redis import RedisServer

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RUN_DIR = ROOT / ".run"


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    """Run a private redis-server (no persistence) for the duration of the block."""
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
        server = RedisServer(Path(directory), "--appendonly", "no")
        try:
            yield server.start()
        finally:
            server.remove()


def wait_for(condition: Callable[[], bool], timeout_s: float, message: str, interval_s: float = 0.005) -> None:
    """Poll `condition` until it holds; raise TimeoutError with `message` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(interval_s)


def percentile(values: Sequence[float], fraction: float) -> float:
    """Return the `fraction` quantile (nearest rank) of `values`."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    """Return the median of `values`."""
    return statistics.median(values)


def rss_bytes(pid: int) -> int:
    """Return the resident set size of a process and all its descendants, in bytes."""
    total = 0
    for one in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def cpu_seconds(pid: int) -> float:
    """Return the CPU time (user + system) a process and all its live descendants used, in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for one in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def descendants(pid: int) -> list[int]:
    """Return the ids of every live descendant of a process."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


class Worker:
    """A consumer/worker subprocess of any system, its output kept in a log file.

    `stop` sends SIGTERM to the whole process group, or with `term_main_only` to the main process
    alone, for a system whose main process passes it on to its children (a second one is a kill).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        log_name: str = "worker",
        term_main_only: bool = False,
    ) -> None:
        self.term_main_only = term_main_only
        RUN_DIR.mkdir(exist_ok=True)
        self.log_path = RUN_DIR / f"bench-{log_name}-{os.getpid()}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(argv),
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_bytes(self) -> int:
        """Resident memory of the worker and its child processes."""
        return rss_bytes(self.process.pid)

    def cpu_seconds(self) -> float:
        """CPU time the worker and its child processes used so far."""
        return cpu_seconds(self.process.pid)

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM the worker's process group (or main process), SIGKILL the group if it lingers, close the log."""
        if self.process.poll() is None:
            try:
                if self.term_main_only:
                    os.kill(self.process.pid, signal.SIGTERM)
                else:
                    os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self._log.close()

    def tail(self, lines: int = 20) -> str:
        """The last lines the worker printed (for error messages)."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise if the worker exited early."""
        if self.process.poll() is not None:
            raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.tail()}")


def emit(record: dict[str, Any]) -> None:
    """Print the one JSON line a bench script or driver reports."""
    print(json.dumps(record, sort_keys=False), flush=True)


def machine() -> dict[str, Any]:
    """Describe the machine: cores, CPU model, Python and Redis versions."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "python": sys.version.split()[0],
        "redis": redis_version.split("v=")[1].split()[0] if "v=" in redis_version else redis_version,
    }
