"""The Dramatiq broker and actors (Redis broker, results stored on Redis, an event loop thread for async actors)."""

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware.asyncio import AsyncIO
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

import probe

broker = RedisBroker(url=os.environ["BENCH_REDIS_URL"])
broker.add_middleware(Results(backend=RedisBackend(url=os.environ["BENCH_REDIS_URL"])))
broker.add_middleware(AsyncIO())
dramatiq.set_broker(broker)
noop = dramatiq.actor(probe.noop, actor_name="noop", store_results=True)
record_start = dramatiq.actor(probe.record_start, actor_name="record_start", store_results=True)
redis_op = dramatiq.actor(probe.redis_op, actor_name="redis_op", store_results=True)
async_redis_op = dramatiq.actor(probe.async_redis_op, actor_name="async_redis_op", store_results=True)
