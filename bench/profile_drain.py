"""Profile one consumer draining a backlog with py-spy (not part of `make bench`).

py-spy comes from the "[profile]" section of requirements-peers.txt, in .run/peers/profile.
Writes collapsed stacks to .run/profile-drain.txt and prints the hottest functions
(share of the samples taken while a thread held the GIL, inclusive and self) as one JSON line.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_compare import peer_python, sections
from ours import our_system
from support import RUN_DIR, emit
from workloads import Sizes, run_drain

TOP = 25


def main() -> None:
    py_spy = peer_python("profile", sections()["profile"]).parent / "py-spy"
    out = RUN_DIR / "profile-drain.txt"
    with our_system() as (system, client):
        system.start_worker = profiled(system.start_worker, py_spy, out)
        figures = run_drain(system, client, Sizes(drain=int(sys.argv[1]) if len(sys.argv) > 1 else 30000))
    total, inclusive, own = hottest(out)
    emit(
        {
            "bench": "profile_drain",
            **figures,
            "samples": total,
            "top_inclusive": [[name, round(100 * n / total, 1)] for name, n in inclusive.most_common(TOP)],
            "top_self": [[name, round(100 * n / total, 1)] for name, n in own.most_common(TOP)],
        }
    )


def profiled(plain_start: Callable[[], Any], py_spy: Path, out: Path) -> Callable[[], Any]:
    """Wrap a worker start so py-spy records the worker until it stops."""

    def start_profiled():
        worker = plain_start()
        spy = subprocess.Popen(
            [
                str(py_spy),
                "record",
                "--pid",
                str(worker.pid),
                "--format",
                "raw",
                "--rate",
                "200",
                "--gil",
                "--nonblocking",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        original_stop = worker.stop

        def stop(timeout_s: float = 15) -> None:
            original_stop(timeout_s)
            spy.wait(30)

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
        frames = stack.split(";")
        if not frames or "idle" in frames[-1]:
            continue
        total += int(count)
        names = [frame.split(" (")[0] + " " + frame.rsplit("/", 1)[-1].rstrip(")") for frame in frames]
        own[names[-1]] += int(count)
        for name in set(names):
            inclusive[name] += int(count)
    return total, inclusive, own


if __name__ == "__main__":
    main()
