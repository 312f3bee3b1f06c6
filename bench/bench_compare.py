"""Run the same enqueue / footprint / drain / latency / idle workloads against us and every Python peer.

The drains empty a backlog of no-ops, of tasks making one Redis round trip, and of async tasks
making that round trip (on the systems that run `async def` tasks; "—" on the others).

Each peer is installed from bench/requirements-peers.txt (its "[name]" section) into its own
virtualenv under .run/peers/<name>, and runs on its own private redis-server, one after the
other. Prints a table (ours / peer for every figure) on stderr, writes it to
.run/bench-compare.md, and prints one JSON line with every figure.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from support import BENCH_DIR, RUN_DIR, emit, machine, redis_server

PEERS_DIR = RUN_DIR / "peers"
REQUIREMENTS = BENCH_DIR / "requirements-peers.txt"
PEERS = ["rq", "celery", "dramatiq", "huey", "vtasks"]
# Slow systems drain a smaller backlog so the whole run stays within its time budget;
# every figure is a rate, so the sizes need not match. Each drain workload uses the same size.
DRAIN_TASKS = {"ours": 20000, "vtasks": 10000, "dramatiq": 5000, "huey": 5000, "celery": 5000, "rq": 3000}
SIZES = ["--single", "2000", "--bulk", "50000", "--footprint", "10000"]
# (key, label, True when more is better)
FIGURES = [
    ("enqueue_single_per_s", "enqueue, one call per task (tasks/s)", True),
    ("enqueue_bulk_per_s", "enqueue, bulk API (tasks/s)", True),
    ("drain_per_s", "drain, one worker process (tasks/s)", True),
    ("drain_redis_op_per_s", "drain, one Redis round trip per task (tasks/s)", True),
    ("drain_async_redis_op_per_s", "drain, async handler with one Redis round trip (tasks/s)", True),
    ("latency_p50_ms", "idle latency p50 (ms)", False),
    ("latency_p99_ms", "idle latency p99 (ms)", False),
    ("idle_commands_per_s", "Redis commands/s of one idle worker", False),
    ("bytes_per_task", "Redis bytes per queued task, all writes", False),
    ("bytes_per_task_queue_only", "Redis bytes per queued task, queue only", False),
    ("worker_rss_mb", "worker RSS after drain (MB)", False),
]


def sections() -> dict[str, list[str]]:
    """The pinned requirement lines of every "[name]" section of requirements-peers.txt."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            current = found.setdefault(line[1:-1], [])
        elif line and current is not None:
            current.append(line)
    return found


def peer_python(name: str, requirements: list[str]) -> Path:
    """Create (or reuse, if its pins did not change) the peer's virtualenv; return its python."""
    home = PEERS_DIR / name
    python = home / "bin" / "python"
    pins = "\n".join(requirements) + "\n"
    stamp = home / ".installed"
    if stamp.exists() and stamp.read_text() == hashlib.sha256(pins.encode()).hexdigest() and python.exists():
        return python
    print(f"==> installing {name} into {home}", file=sys.stderr, flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(home)
    (home / "requirements.txt").write_text(pins)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
            str(home / "requirements.txt"),
        ],
        check=True,
    )
    stamp.write_text(hashlib.sha256(pins.encode()).hexdigest())
    return python


def run_driver(name: str, python: Path, options: list[str] | None = None, timeout_s: float = 300) -> dict[str, Any]:
    """Run one driver on a private redis-server with `options` (default: every workload); return its JSON line."""
    if options is None:
        options = [*SIZES, "--drain", str(DRAIN_TASKS[name])]
    with redis_server() as server:
        argv = [str(python), str(BENCH_DIR / "peers" / f"{name}.py"), "--redis-url", server.url, *options]
        print(f"==> {name}", file=sys.stderr, flush=True)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{name} driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(ours: float | None, peer: float | None) -> str:
    if not ours or not peer:
        return "n/a"
    return f"{ours / peer:.2f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """A Markdown table: one row per figure, a column per system, and ours/peer ratios."""
    names = list(results)
    peers = [n for n in names if n != "ours"]
    header = ["figure", *(results[n]["system"] for n in names), *(f"ours/{results[n]['system']}" for n in peers)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, label, higher_is_better in FIGURES:
        values = [results[n].get(key) for n in names]
        ratios = [ratio(results["ours"].get(key), results[n].get(key)) for n in peers]
        arrow = " ↑" if higher_is_better else " ↓"
        cells = [label + arrow, *("—" if v is None else f"{v:g}" for v in values), *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_drivers(
    peers: list[str], options: list[str] | None = None, timeout_s: float = 300
) -> dict[str, dict[str, Any]]:
    """Run our driver, then each peer's, with the same `options`; return their JSON lines by name."""
    pins = sections()
    results = {"ours": run_driver("ours", Path(sys.executable), options, timeout_s)}
    for name in peers:
        results[name] = run_driver(name, peer_python(name, pins[name]), options, timeout_s)
    return results


def publish(bench: str, text: str, record: dict[str, Any]) -> None:
    """Print the table `text` on stderr, write it to .run/bench-<bench>.md, and print the JSON line."""
    print(text, file=sys.stderr, flush=True)
    RUN_DIR.mkdir(exist_ok=True)
    (RUN_DIR / f"bench-{bench}.md").write_text(text + "\n")
    emit({"bench": bench, "machine": machine(), **record})


def main() -> None:
    results = run_drivers(PEERS)
    publish("compare", table(results), {"results": results})


if __name__ == "__main__":
    main()
