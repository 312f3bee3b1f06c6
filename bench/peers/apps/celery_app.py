"""The Celery app both the Celery driver and its worker import (broker and results on Redis)."""

import os

from celery import Celery

import probe

app = Celery("bench", broker=os.environ["BENCH_REDIS_URL"], backend=os.environ["BENCH_REDIS_URL"])
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)
noop = app.task(name="noop")(probe.noop)
record_start = app.task(name="record_start")(probe.record_start)
redis_op = app.task(name="redis_op")(probe.redis_op)
chord_done = app.task(name="chord_done")(probe.chord_done)
