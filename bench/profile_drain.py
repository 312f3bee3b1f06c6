"""Profile one system's worker draining a backlog with py-spy (not part of `make bench`).

Usage: `python bench/profile_drain.py [ours|huey|vtasks|rq|celery|dramatiq] [N] [--kind noop|redis_op|async_redis_op]
[--all-threads] [--rate R]`. Runs the system's driver (bench/peers/<name>.py) with its own virtualenv's Python
on a private redis-server, the drain of N tasks of that kind only, with py-spy (the "[profile]" section of
requirements-peers.txt, in .run/peers/profile) attached to the worker process from its first finished task
until it is stopped. py-spy samples the thread holding the GIL, or with --all-threads every active thread.
Writes the raw collapsed stacks to .run/profile-drain-<system>-<kind>[-all].txt and prints one JSON line: the
drain's figures; over the recording, the tasks finished and the CPU per task of the worker (in all and by
thread name) and of Redis; the samples and their share of the samplings the rate allowed in that time (with
the GIL: about how often a thread held it; with every thread: threads py-spy saw active per sampling; lower
bounds: py-spy may fall behind its rate, and its "Errors" are samplings it could not read, py_spy_errors); the
hottest functions, inclusive and self, in % of the samples.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench_compare import PEERS, peer_python, run_driver, sections
from spy import DEFAULT_RATE, hottest, spanned
from support import RUN_DIR, emit

TOP = 25
WORKLOADS = {"noop": "drain", "redis_op": "drain_redis_op", "async_redis_op": "drain_async_redis_op"}


def parse_args() -> argparse.Namespace:
    """The system, the backlog, the kind of task and how py-spy samples."""
    parser = argparse.ArgumentParser(description="Profile one system's worker draining a backlog with py-spy.")
    parser.add_argument("system", nargs="?", default="ours", choices=["ours", *PEERS], help="whose worker (ours)")
    parser.add_argument("tasks", nargs="?", type=int, default=30000, help="tasks in the backlog (30000)")
    parser.add_argument("--kind", default="noop", choices=list(WORKLOADS))
    parser.add_argument("--all-threads", action="store_true", help="every active thread, not only the GIL holder")
    parser.add_argument("--rate", type=int, default=DEFAULT_RATE, help="py-spy samples per second")
    return parser.parse_args()


def main() -> None:
    """Run the named system's drain with py-spy on its worker; print the summary line."""
    args = parse_args()
    pins = sections()
    py_spy = peer_python("profile", pins["profile"]).parent / "py-spy"
    python = Path(sys.executable) if args.system == "ours" else peer_python(args.system, pins[args.system])
    out = RUN_DIR / f"profile-drain-{args.system}-{args.kind}{'-all' if args.all_threads else ''}.txt"
    out.unlink(missing_ok=True)
    options = ["--workloads", WORKLOADS[args.kind], "--drain", str(args.tasks), "--profile", str(out)]
    options += ["--py-spy", str(py_spy), "--profile-rate", str(args.rate)]
    figures = run_driver(args.system, python, [*options, *(["--all-threads"] if args.all_threads else [])], 900)
    if not out.exists():
        log = out.with_suffix(".log")
        said = log.read_text(errors="replace").strip().splitlines()[:1] if log.exists() else []
        raise SystemExit(f"no profile of {args.system} ({figures}); py-spy said: {said or 'nothing'}")
    emit(summary(args, figures, out))


def summary(args: argparse.Namespace, figures: dict[str, Any], out: Path) -> dict[str, Any]:
    """The JSON line: the drain's figures, what the recording spanned, and the hottest functions."""
    total, inclusive, own = hottest(out)
    span = spanned(out)
    samplings = round(span["seconds"] * args.rate) if span else None
    tasks = span.get("tasks") or None
    return {
        "bench": "profile_drain",
        "kind": args.kind,
        "mode": "all threads" if args.all_threads else "gil",
        **figures,
        "profile": str(out.relative_to(RUN_DIR.parent)),
        **span,
        "worker_cpu_us_per_task": round(1e6 * span["worker_cpu_s"] / tasks, 1) if tasks else None,
        "redis_cpu_us_per_task": round(1e6 * span["redis_cpu_s"] / tasks, 1) if tasks else None,
        "samples": total,
        ("active_threads_per_sampling" if args.all_threads else "gil_held_share"): (
            round(total / samplings, 3) if samplings else None
        ),
        "top_inclusive": [[name, round(100 * n / total, 1)] for name, n in inclusive.most_common(TOP)],
        "top_self": [[name, round(100 * n / total, 1)] for name, n in own.most_common(TOP)],
    }


if __name__ == "__main__":
    main()
