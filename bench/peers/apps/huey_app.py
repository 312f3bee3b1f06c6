"""The Huey instance (Redis storage, blocking dequeue) and its tasks."""

import os

from huey import RedisHuey

import probe

huey = RedisHuey("bench", url=os.environ["BENCH_REDIS_URL"])
noop = huey.task(name="noop")(probe.noop)
record_start = huey.task(name="record_start")(probe.record_start)
redis_op = huey.task(name="redis_op")(probe.redis_op)
