"""Workflow: the cost of a chord of 1,000 no-op members beside 1,001 plain no-ops, us beside Celery's chord.

Each system runs on its own private redis-server (see bench_compare.py for how the Celery peer is
installed). Redis bytes: INFO used_memory delta of the waiting tasks, no worker running (a chord's
member also carries its share of the workflow's keys). Tasks/s: from the enqueue call to the last
task done (the chord's callback run), on one warm worker, best of 3. Prints a table on stderr,
writes it to .run/bench-workflow.md, and prints one JSON line.
"""

from __future__ import annotations

from typing import Any

from bench_compare import publish, run_drivers

PEERS = ["celery"]
MEMBERS = 1000
ROWS = [
    ("plain_per_s", "1,001 plain no-ops, enqueue to last done (tasks/s)"),
    ("chord_per_s", "chord of 1,000 no-ops and its callback, enqueue to callback done (tasks/s)"),
    ("plain_bytes_per_task", "Redis bytes per waiting plain task"),
    ("chord_bytes_per_member", "Redis bytes per waiting chord member"),
]


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per figure, a column per system, and the chord's over the plain tasks' for each."""
    names = list(results)
    lines = ["| figure | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{results[name][key]:g}" for name in names) + " |")
    speed = [f"{results[n]['chord_per_s'] / results[n]['plain_per_s']:.2f}" for n in names]
    size = [f"{results[n]['chord_bytes_per_member'] / results[n]['plain_bytes_per_task']:.2f}" for n in names]
    lines.append("| chord / plain, tasks/s | " + " | ".join(speed) + " |")
    lines.append("| chord / plain, bytes | " + " | ".join(size) + " |")
    return "\n".join(lines)


def main() -> None:
    results = run_drivers(PEERS, ["--workloads", "chord", "--chord", str(MEMBERS)])
    publish("workflow", table(results), {"results": results})


if __name__ == "__main__":
    main()
