"""Process mode and the asyncio lane: drains through `--processes N`, one Redis round trip per task, async handlers."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis

import django_env
from peers.ours import QUEUE, Ours
from support import ROOT, Worker, emit, redis_server
from workloads import Sizes, run_drain

PROCESS_COUNTS = (1, 2, 4)


class OursVariant(Ours):
    """Our queue, its consumer started with extra flags (`--processes N`)."""

    def __init__(self, redis_url: str, flags: tuple[str, ...] = (), processes: int = 0) -> None:
        super().__init__(redis_url)
        self.flags = flags
        self.processes = processes

    def start_worker(self) -> Worker:
        consumer_id = f"bench-{len(self.consumer_ids) + 1}"
        if self.processes:
            self.consumer_ids.extend(f"{consumer_id}-{n}" for n in range(self.processes))
            flags = ("--processes", str(self.processes), *self.flags)
        else:
            self.consumer_ids.append(consumer_id)
            flags = self.flags
        argv = django_env.runconsumer_argv("--queue", QUEUE, "--consumer-id", consumer_id, *flags)
        return Worker(argv, cwd=ROOT, log_name=consumer_id)


def drain(url: str, kind: str, tasks: int, flags: tuple[str, ...] = (), processes: int = 0) -> dict[str, Any]:
    """Drain `tasks` tasks of `kind` (bench.<kind>) with one consumer (or one supervised group); its figures."""
    system = OursVariant(url, flags, processes)
    return run_drain(system, redis.Redis.from_url(url), Sizes(drain=tasks), kind=kind)


def figures(url: str, tasks: int) -> dict[str, Any]:
    """Every figure of this script, on the Redis at `url` (one Django setup: one Redis per process)."""
    by_processes = {str(n): drain(url, "noop", tasks, processes=n)["drain_per_s"] for n in PROCESS_COUNTS}
    return {
        "bench": "process_mode",
        "tasks": tasks,
        "nproc": os.cpu_count(),
        "noop_drain_per_s_by_processes": by_processes,
        "speedup_2_over_1": round(by_processes["2"] / by_processes["1"], 2),
        "thread_mode_noop_drain_per_s": drain(url, "noop", tasks)["drain_per_s"],
        "sync_redis_op_drain_per_s": drain(url, "redis_op", tasks)["drain_per_s"],
        "async_redis_op_drain_per_s": drain(url, "async_redis_op", tasks)["drain_per_s"],
        "async_sleep_50ms_drain_per_s": drain(url, "async_sleep", tasks // 4)["drain_per_s"],
    }


if __name__ == "__main__":
    with redis_server() as server:
        emit(figures(server.url, int(os.environ.get("BENCH_PROCESS_MODE_TASKS", "20000"))))
