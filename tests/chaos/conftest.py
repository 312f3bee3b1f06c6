"""Chaos fixtures: private Redis servers (single, or a 3-master cluster with or without replicas) that the test owns."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from tasks_app.protocol.broker import Broker, get_broker
from tests.chaos.servers import RedisClusterServers, RedisServer


def _point_at(settings: object, url: str, cluster: bool) -> None:
    settings.REDIS_URL = url  # type: ignore[attr-defined]
    settings.REDIS_CLUSTER = cluster  # type: ignore[attr-defined]


@pytest.fixture
def start_redis(settings: object, key_prefix: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Factory: start a private redis-server with extra options and point this test (and its consumers) at it."""
    original = (django_settings.REDIS_URL, django_settings.REDIS_CLUSTER)
    servers: list[RedisServer] = []

    def start(*options: str) -> RedisServer:
        server = RedisServer(tmp_path, *options).start()
        servers.append(server)
        _point_at(settings, server.url, False)
        return server

    yield start
    # The key_prefix fixture cleans up on the original Redis after this; point it back first.
    _point_at(settings, *original)
    for server in servers:
        server.remove()


@pytest.fixture
def chaos_broker(start_redis: Callable[..., RedisServer]) -> Broker:
    """A broker on a fresh private redis-server (no persistence) that consumers share."""
    start_redis("--appendonly", "no")
    return get_broker()


@contextlib.contextmanager
def _on_cluster(settings: object, tmp_path: Path, replicas: int) -> Iterator[tuple[RedisClusterServers, Broker]]:
    original = (django_settings.REDIS_URL, django_settings.REDIS_CLUSTER)
    cluster = RedisClusterServers(tmp_path, replicas=replicas, node_timeout_ms=2000 if replicas else 5000).start()
    _point_at(settings, cluster.url, True)
    try:
        yield cluster, get_broker()
    finally:
        _point_at(settings, *original)
        cluster.remove()


@pytest.fixture
def cluster_broker(settings: object, key_prefix: str, tmp_path: Path) -> Iterator[Broker]:
    """A broker on a private 3-master Redis Cluster on loopback (REDIS_CLUSTER=1)."""
    with _on_cluster(settings, tmp_path, replicas=0) as (_, broker):
        yield broker


@pytest.fixture
def replicated_cluster(
    settings: object, key_prefix: str, tmp_path: Path
) -> Iterator[tuple[RedisClusterServers, Broker]]:
    """A private Redis Cluster of 3 masters and 3 replicas (node timeout 2 s) and a broker on it."""
    with _on_cluster(settings, tmp_path, replicas=1) as cluster_and_broker:
        yield cluster_and_broker
