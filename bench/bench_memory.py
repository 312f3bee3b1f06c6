"""Memory: Redis bytes per waiting task at 10,000, 100,000 and 1,000,000 tasks, us beside Huey, RQ and Celery.

Each system fills one growing backlog of no-op tasks on its own private redis-server (INFO
used_memory delta over an empty Redis, everything the enqueue writes counted). The largest
level is BENCH_MEMORY_MAX (default 1,000,000); Huey and Celery have no bulk API, so their
backlog is enqueued one call per task and takes minutes. Prints a table on stderr, writes it to
.run/bench-memory.md, and prints one JSON line.
"""

from __future__ import annotations

import os

from bench_compare import publish, run_drivers
from workloads import memory_levels

PEERS = ["huey", "rq", "celery"]
LARGEST = int(os.environ.get("BENCH_MEMORY_MAX", "1000000"))
TIMEOUT_S = 3600


def table(results: dict[str, dict[str, float]]) -> str:
    """One row per level: bytes per task of every system, and ours over Huey's."""
    names = list(results)
    lines = [
        "| waiting tasks | " + " | ".join(names) + " | ours/huey |",
        "|" + "---|" * (len(names) + 2),
    ]
    for level in memory_levels(LARGEST):
        cells = [f"{results[name][str(level)]:g}" for name in names]
        lines.append(
            f"| {level:,} | "
            + " | ".join(cells)
            + f" | {results['ours'][str(level)] / results['huey'][str(level)]:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    results = run_drivers(PEERS, ["--workloads", "memory", "--memory", str(LARGEST)], TIMEOUT_S)
    per_task = {name: record["memory_bytes_per_task"] for name, record in results.items()}
    publish("memory", table(per_task), {"bytes_per_task": per_task})


if __name__ == "__main__":
    main()
