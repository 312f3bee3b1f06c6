"""Drain: N no-op tasks queued, one `runconsumer` (default concurrency); tasks/s until all are acked."""

from ours import run
from support import emit
from workloads import Sizes, run_drain

if __name__ == "__main__":
    emit({"bench": "drain", **run(run_drain, Sizes(drain=30000))})
