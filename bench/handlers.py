"""Handlers the benchmarks enqueue: a no-op and a latency probe (TASK_HANDLER_MODULES=bench.handlers)."""

from bench.probe import noop, record_start
from tasks_app import handler

handler("bench.noop")(noop)
handler("bench.probe")(record_start)
