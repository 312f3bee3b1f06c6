"""Idle latency: 200 tasks enqueued 20 ms apart to an idle consumer; start minus enqueue, p50/p99 (ms)."""

from ours import run
from support import emit
from workloads import Sizes, run_latency

if __name__ == "__main__":
    emit({"bench": "latency", **run(run_latency, Sizes())})
