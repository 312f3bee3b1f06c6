"""The workloads every queue runs the same way: enqueue, footprint, drains, latency and idle cost.

The drains empty a backlog of no-ops, of tasks making one Redis round trip (INCR on a client
the worker thread keeps) and, where the system runs `async def` tasks, of the same round trip
from an async task (see probe.py for what each task does).

A system under test (ours or a peer) implements `System`; its driver script runs the workloads
with its own virtualenv's Python and prints one JSON line. Needs redis-py (every venv has it).
With `--profile`, py-spy records the workers of the drains (bench/profile_drain.py runs that).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from probe import CHORD_KEY, LATENCY_KEY, OPS_KEY
from spy import DEFAULT_RATE, SpyOptions, profiled
from support import Worker, emit, median, percentile, wait_for

LATENCY_TASKS = 200
LATENCY_GAP_S = 0.020
# An idle worker's Redis commands are counted over this long, once it has settled for IDLE_SETTLE_S.
IDLE_WINDOW_S = 10.0
# What bench_idle and bench_queues count an idle consumer over: two leases of its default 30 s, so that every
# period of its own (heartbeat, reaper, full claim, audit) shows whole.
IDLE_COST_WINDOW_S = 60.0
IDLE_SETTLE_S = 2.0


@dataclass
class Sizes:
    """How many tasks each workload uses."""

    single: int = 3000
    bulk: int = 50000
    batch: int = 1000
    footprint: int = 20000
    drain: int = 5000
    memory: int = 1000000  # the memory workload's largest backlog (its levels: 10,000, 100,000, ... up to it)
    chord: int = 1000  # members of the chord workload's chord


class System:
    """A task queue under test: how to enqueue a task of each kind, run a worker, see progress."""

    name = "?"
    has_bulk = True
    has_chord = False
    # The kinds of task (probe.py's function names) the system runs; "async_redis_op" where it runs `async def`.
    kinds: frozenset[str] = frozenset({"noop", "redis_op"})

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def enqueue_task(self, kind: str = "noop") -> None:
        """Enqueue one task of `kind` (a no-op by default) with one call of the system's enqueue API."""
        raise NotImplementedError

    def enqueue_tasks(self, count: int, kind: str = "noop") -> None:
        """Enqueue `count` tasks of `kind` with one call of the bulk API (one round trip)."""
        raise NotImplementedError

    def enqueue_probe(self, enqueued_at: float) -> None:
        """Enqueue a task whose handler records its start time minus `enqueued_at` (see probe.py)."""
        raise NotImplementedError

    def enqueue_chord(self, members: int) -> None:
        """Enqueue a chord of `members` no-op tasks whose callback is probe.chord_done (where `has_chord`)."""
        raise NotImplementedError

    def start_worker(self) -> Worker:
        """Start one worker process with 8 threads (or the system's default concurrency)."""
        raise NotImplementedError

    def outstanding(self, client: redis.Redis, total: int) -> int:
        """How many of `total` enqueued tasks are not yet done, acknowledged and recorded."""
        raise NotImplementedError

    def queue_bytes(self, client: redis.Redis) -> int:
        """MEMORY USAGE of the structures that hold queued tasks (excluding result records)."""
        raise NotImplementedError


def _flush(client: redis.Redis) -> None:
    client.flushall()


def enqueue_backlog(system: System, count: int, batch: int, kind: str = "noop") -> None:
    """Enqueue `count` tasks of `kind`, in bulk batches where the system has them."""
    if system.has_bulk:
        for start in range(0, count, batch):
            system.enqueue_tasks(min(batch, count - start), kind)
    else:
        for _ in range(count):
            system.enqueue_task(kind)


def run_enqueue(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
    """Tasks/s for one enqueue call per task, and for bulk batches of `sizes.batch`."""
    _flush(client)
    for _ in range(200):  # warm up connections, caches and scripts
        system.enqueue_task()
    started = time.perf_counter()
    for _ in range(sizes.single):
        system.enqueue_task()
    single = sizes.single / (time.perf_counter() - started)
    bulk = None
    if system.has_bulk:
        _flush(client)
        system.enqueue_tasks(sizes.batch)
        started = time.perf_counter()
        enqueue_backlog(system, sizes.bulk, sizes.batch)
        bulk = sizes.bulk / (time.perf_counter() - started)
    _flush(client)
    return {"enqueue_single_per_s": round(single), "enqueue_bulk_per_s": round(bulk) if bulk else None}


def _used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _primed(system: System, client: redis.Redis) -> int:
    """Empty Redis but for one task (the queue's keys exist: a delta counts tasks only); return used_memory."""
    _flush(client)
    system.enqueue_task()
    _flush(client)
    system.enqueue_task()
    return _used_memory(client)


def run_footprint(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
    """Redis bytes per queued no-op task: INFO used_memory delta, and the queue structures alone."""
    before = _primed(system, client)
    enqueue_backlog(system, sizes.footprint, sizes.batch)
    after = _used_memory(client)
    queue_only = system.queue_bytes(client)
    _flush(client)
    return {
        "bytes_per_task": round((after - before) / sizes.footprint, 1),
        "bytes_per_task_queue_only": round(queue_only / (sizes.footprint + 1), 1),
    }


def memory_levels(largest: int) -> list[int]:
    """10,000, 100,000, ... below `largest`, then `largest` itself."""
    levels = []
    level = 10000
    while level < largest:
        levels.append(level)
        level *= 10
    return [*levels, largest]


def run_memory(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
    """Redis bytes per waiting no-op task (INFO used_memory delta) at each of `memory_levels`, in one backlog."""
    before = _primed(system, client)
    per_task: dict[str, float] = {}
    enqueued = 0
    for level in memory_levels(sizes.memory):
        enqueue_backlog(system, level - enqueued, sizes.batch)
        enqueued = level
        per_task[str(level)] = round((_used_memory(client) - before) / level, 1)
    _flush(client)
    return {"memory_bytes_per_task": per_task}


def run_drain(
    system: System, client: redis.Redis, sizes: Sizes, workers: int = 1, kind: str = "noop"
) -> dict[str, Any]:
    """`workers` worker processes drain a backlog of `kind` tasks: tasks/s from the first ack to the last."""
    _flush(client)
    total = sizes.drain
    enqueue_backlog(system, total, sizes.batch, kind)
    started: list[Worker] = []
    spawned = time.perf_counter()
    try:
        started.extend(system.start_worker() for _ in range(workers))
        first_at, left_at_first = _wait_first_progress(system, client, total, started)
        peak_rss = 0
        last_rss_at = 0.0
        while (left := system.outstanding(client, total)) > 0:
            for worker in started:
                worker.check_alive()
            now = time.perf_counter()
            if now - last_rss_at > 0.25:
                peak_rss, last_rss_at = max(peak_rss, max(w.rss_bytes() for w in started)), now
            if now - spawned > 600:
                raise TimeoutError(f"{system.name}: {left} of {total} tasks left after 600 s")
            time.sleep(0.002)
        finished = time.perf_counter()
        peak_rss = max(peak_rss, max(w.rss_bytes() for w in started))
    finally:
        for worker in started:
            worker.stop()
    round_trips = int(client.get(OPS_KEY) or 0)
    _flush(client)
    figures = {
        "drain_tasks": total,
        "drain_per_s": round(left_at_first / (finished - first_at)),
        "drain_wall_s_from_spawn": round(finished - spawned, 3),
        "worker_rss_mb": round(peak_rss / 2**20, 1),
    }
    return figures | ({"round_trips": round_trips} if round_trips else {})


def _wait_first_progress(system: System, client: redis.Redis, total: int, workers: list[Worker]) -> tuple[float, int]:
    deadline = time.perf_counter() + 60
    while True:
        left = system.outstanding(client, total)
        if left < total:
            return time.perf_counter(), left
        for worker in workers:
            worker.check_alive()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{system.name}: no worker finished a task within 60 s:\n{workers[0].tail()}")
        time.sleep(0.001)


@contextmanager
def idle_worker(system: System, client: redis.Redis, settle_s: float) -> Iterator[Worker]:
    """A worker that ran one warm-up probe and then idled `settle_s`; stopped, and Redis flushed, after the block."""
    _flush(client)
    worker = system.start_worker()
    try:
        system.enqueue_probe(time.time())
        wait_for(
            lambda: client.llen(LATENCY_KEY) >= 1 or worker.check_alive(),
            60,
            f"{system.name}: the worker never ran the warm-up probe",
        )
        time.sleep(settle_s)  # let the worker settle into its idle wait
        yield worker
    finally:
        worker.stop()
    _flush(client)


def run_latency(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
    """An idle worker; tasks enqueued 20 ms apart; start minus enqueue (ms), p50 and p99."""
    with idle_worker(system, client, settle_s=1.0):
        client.delete(LATENCY_KEY)
        for _ in range(LATENCY_TASKS):
            system.enqueue_probe(time.time())
            time.sleep(LATENCY_GAP_S)
        wait_for(lambda: client.llen(LATENCY_KEY) >= LATENCY_TASKS, 30, f"{system.name}: probes did not all run")
        samples = [float(value) for value in client.lrange(LATENCY_KEY, 0, -1)]
    return {"latency_p50_ms": round(median(samples), 2), "latency_p99_ms": round(percentile(samples, 0.99), 2)}


def redis_commands(client: redis.Redis) -> int:
    """Commands Redis has run so far, scripts' inner calls included, INFO (the measuring) excluded."""
    stats = client.info("commandstats")
    return sum(int(entry["calls"]) for name, entry in stats.items() if name != "cmdstat_info")


def redis_cpu_s(client: redis.Redis) -> float:
    """CPU seconds the Redis server has used so far."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def idle_cost(client: redis.Redis, workers: list[Worker], window_s: float = IDLE_WINDOW_S) -> dict[str, float]:
    """What idle `workers` cost over `window_s`: Redis commands/s and Redis CPU ms/s, and their own CPU ms/s."""
    commands, redis_cpu = redis_commands(client), redis_cpu_s(client)
    worker_cpu = sum(worker.cpu_seconds() for worker in workers)
    time.sleep(window_s)
    return {
        "commands_per_s": (redis_commands(client) - commands) / window_s,
        "redis_cpu_ms_per_s": 1000 * (redis_cpu_s(client) - redis_cpu) / window_s,
        "worker_cpu_ms_per_s": 1000 * (sum(worker.cpu_seconds() for worker in workers) - worker_cpu) / window_s,
    }


def run_idle(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
    """One idle worker, after a first task: Redis commands per second it causes (over IDLE_WINDOW_S)."""
    with idle_worker(system, client, settle_s=IDLE_SETTLE_S) as worker:
        cost = idle_cost(client, [worker])
    return {
        "idle_commands_per_s": round(cost["commands_per_s"], 1),
        "idle_worker_cpu_ms_per_s": round(cost["worker_cpu_ms_per_s"], 1),
    }


CHORD_ROUNDS = 3


def run_chord(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
    """A chord of `sizes.chord` no-op members and its callback beside as many plain no-ops: Redis bytes per member
    while they wait, and tasks/s from the enqueue to the last one done on a warm worker (best of CHORD_ROUNDS)."""
    if not system.has_chord:
        return {"chord_per_s": None}
    members = sizes.chord
    plain_bytes = _waiting_bytes(client, system, lambda: enqueue_backlog(system, members + 1, sizes.batch))
    chord_bytes = _waiting_bytes(client, system, lambda: system.enqueue_chord(members))
    plain_s, chord_s = [], []
    for _ in range(CHORD_ROUNDS):
        plain_s.append(_on_warm_worker(system, client, lambda: _plain_run(system, client, members + 1, sizes.batch)))
        chord_s.append(_on_warm_worker(system, client, lambda: _chord_run(system, client, members)))
    return {
        "chord_members": members,
        "plain_per_s": round((members + 1) / min(plain_s)),
        "chord_per_s": round((members + 1) / min(chord_s)),
        "plain_bytes_per_task": round(plain_bytes / (members + 1), 1),
        "chord_bytes_per_member": round(chord_bytes / members, 1),
    }


def _waiting_bytes(client: redis.Redis, system: System, enqueue: Callable[[], None]) -> int:
    """Redis bytes (INFO used_memory delta) that `enqueue` adds with no worker running."""
    before = _primed(system, client)
    enqueue()
    added = _used_memory(client) - before
    _flush(client)
    return added


def _on_warm_worker(system: System, client: redis.Redis, timed: Callable[[], float]) -> float:
    """Start a worker on an empty Redis, wait until it has run one task, then run `timed`; its seconds."""
    _flush(client)
    worker = system.start_worker()
    try:
        system.enqueue_task()
        wait_for(lambda: system.outstanding(client, 1) == 0, 60, f"{system.name}: the warm-up task did not run")
        return timed()
    finally:
        worker.stop()
        _flush(client)


def _plain_run(system: System, client: redis.Redis, count: int, batch: int) -> float:
    started = time.perf_counter()
    enqueue_backlog(system, count, batch)
    wait_for(lambda: system.outstanding(client, count + 1) == 0, 120, f"{system.name}: plain tasks left", 0.001)
    return time.perf_counter() - started


def _chord_run(system: System, client: redis.Redis, members: int) -> float:
    started = time.perf_counter()
    system.enqueue_chord(members)
    wait_for(lambda: client.exists(CHORD_KEY) == 1, 120, f"{system.name}: the chord's callback did not run", 0.001)
    elapsed = time.perf_counter() - started
    if int(client.get(CHORD_KEY) or 0) != members:
        raise RuntimeError(f"{system.name}: the callback got {client.get(CHORD_KEY)!r} results, not {members}")
    return elapsed


Workload = Callable[[System, redis.Redis, Sizes], dict[str, Any]]


def drain_of(kind: str) -> Workload:
    """The drain of a backlog of `kind` tasks, figures named drain_<kind>_*; None if the system lacks that task."""

    def run_kind_drain(system: System, client: redis.Redis, sizes: Sizes) -> dict[str, Any]:
        if kind not in system.kinds:
            return {f"drain_{kind}_per_s": None}
        figures = run_drain(system, client, sizes, kind=kind)
        round_trips = figures.get("round_trips", 0)
        if round_trips < figures["drain_tasks"]:
            raise RuntimeError(f"{system.name}: {round_trips} INCRs for {figures['drain_tasks']} {kind} tasks")
        return {f"drain_{kind}_{key.removeprefix('drain_')}": value for key, value in figures.items()}

    return run_kind_drain


WORKLOADS: dict[str, Workload] = {
    "enqueue": run_enqueue,
    "footprint": run_footprint,
    "drain": run_drain,
    "drain_redis_op": drain_of("redis_op"),
    "drain_async_redis_op": drain_of("async_redis_op"),
    "latency": run_latency,
    "idle": run_idle,
    "memory": run_memory,
    "chord": run_chord,
}
# What a driver runs unless told otherwise: the memory workload's million tasks are bench_memory.py's, the chord
# bench_workflow.py's.
DEFAULT_WORKLOADS = [name for name in WORKLOADS if name not in ("memory", "chord")]


def parse_args() -> argparse.Namespace:
    """Command line of a driver: the Redis to use, the workloads and their sizes, and py-spy for the drains."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    for name, default in vars(Sizes()).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    profile = parser.add_argument_group("profiling (drain workloads only; see bench/profile_drain.py)")
    profile.add_argument("--profile", type=Path, help="record each worker with py-spy into this raw file")
    profile.add_argument("--py-spy", type=Path, help="the py-spy executable")
    profile.add_argument("--profile-rate", type=int, default=DEFAULT_RATE, help="samples per second")
    profile.add_argument("--all-threads", action="store_true", help="sample every active thread, not the GIL holder")
    return parser.parse_args()


def profile_workers(system: System, client: redis.Redis, sizes: Sizes, args: argparse.Namespace) -> None:
    """Attach py-spy to every worker `system` starts, from its first finished task of a drain of `sizes.drain`.

    The recording notes the tasks finished and Redis's CPU seconds (INFO cpu) over its span.
    """
    options = SpyOptions(args.py_spy, args.profile, args.profile_rate, gil=not args.all_threads)

    def counters() -> dict[str, float]:
        cpu = client.info("cpu")
        done = sizes.drain - system.outstanding(client, sizes.drain)
        return {"tasks": done, "redis_cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])}

    def finished_one() -> bool:
        return system.outstanding(client, sizes.drain) < sizes.drain

    system.start_worker = profiled(system.start_worker, options, finished_one, counters)


def run(system_factory: Callable[[str], System], args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Run the chosen workloads against one system and print one JSON line with every figure."""
    args = args or parse_args()
    sizes = Sizes(**{name: getattr(args, name) for name in vars(Sizes())})
    system = system_factory(args.redis_url)
    client = redis.Redis.from_url(args.redis_url)
    if args.profile:
        profile_workers(system, client, sizes, args)
    record: dict[str, Any] = {"system": system.name}
    for name in args.workloads.split(","):
        record.update(WORKLOADS[name](system, client, sizes))
    emit(record)
    return record
