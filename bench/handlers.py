"""Handlers the benchmarks enqueue: a no-op and a latency probe (TASK_HANDLER_MODULES=bench.handlers)."""
from tasks_app import handler

from bench.probe import noop, record_start

handler("bench.noop")(noop)
handler("bench.probe")(record_start)
