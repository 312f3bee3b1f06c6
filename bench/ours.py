"""Run one of the shared workloads (bench/workloads.py) against our queue on a private Redis."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from peers.ours import Ours
from support import redis_server
from workloads import Sizes, System

Workload = Callable[[System, redis.Redis, Sizes], dict[str, Any]]


@contextmanager
def our_system() -> Iterator[tuple[Ours, redis.Redis]]:
    """Our queue on a private redis-server and a throwaway database, and a client for it."""
    with redis_server() as server:
        yield Ours(server.url), redis.Redis.from_url(server.url)


def run(workload: Workload, sizes: Sizes) -> dict[str, Any]:
    """Run one workload against our queue; return its figures."""
    with our_system() as (system, client):
        return workload(system, client, sizes)
