"""django-vtasks tasks for the benchmark (module-level, so the worker can import them by path)."""

from django_vtasks import task

import probe


@task
def noop() -> bool:
    """Do nothing."""
    return probe.noop()


@task
def record_start(enqueued_at: float) -> bool:
    """Record this task's start latency."""
    return probe.record_start(enqueued_at)


@task
def redis_op() -> bool:
    """One Redis round trip on this thread's client."""
    return probe.redis_op()


@task
async def async_redis_op() -> bool:
    """One Redis round trip on the worker loop's redis.asyncio client."""
    return await probe.async_redis_op()
