"""The Dramatiq broker and actors (Redis broker, results stored on Redis)."""

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

import probe

broker = RedisBroker(url=os.environ["BENCH_REDIS_URL"])
broker.add_middleware(Results(backend=RedisBackend(url=os.environ["BENCH_REDIS_URL"])))
dramatiq.set_broker(broker)
noop = dramatiq.actor(probe.noop, actor_name="noop", store_results=True)
record_start = dramatiq.actor(probe.record_start, actor_name="record_start", store_results=True)
