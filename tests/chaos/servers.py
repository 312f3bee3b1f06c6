"""Private `redis-server` processes for the chaos tests: a single server or a cluster (with or without replicas)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from bench import private_redis
from bench.private_redis import READY_TIMEOUT_S
from tests.support.ports import free_port

__all__ = ["RedisClusterServers", "RedisServer"]


class RedisServer(private_redis.RedisServer):
    """A private redis-server on a port of this pytest-xdist worker's own block (see ports.py)."""

    def __init__(self, directory: Path, *options: str, port: int | None = None) -> None:
        super().__init__(directory, *options, port=port or free_port(cluster_bus=True))


class RedisClusterServers:
    """A Redis Cluster on loopback (masters, each with `replicas` replicas), joined by `redis-cli --cluster create`."""

    def __init__(self, directory: Path, masters: int = 3, *, replicas: int = 0, node_timeout_ms: int = 5000) -> None:
        self.replicas = replicas
        self.servers = [
            RedisServer(
                directory,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--appendonly",
                "no",
            )
            for _ in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.servers[0].port}"

    def start(self) -> RedisClusterServers:
        """Start every node, create the cluster and wait until every node reports it healthy."""
        for server in self.servers:
            server.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{server.port}" for server in self.servers],
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        for server in self.servers:
            client = redis.Redis(port=server.port)
            while not self._ready(client):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {server.port} never became ready")
                time.sleep(0.1)
            client.close()
        return self

    @staticmethod
    def _ready(client: redis.Redis) -> bool:
        if client.cluster("info").get("cluster_state") != "ok":
            return False
        replication = client.info("replication")
        return replication["role"] == "master" or replication.get("master_link_status") == "up"

    def server_on_port(self, port: int) -> RedisServer:
        """The node listening on `port`."""
        return next(server for server in self.servers if server.port == port)

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A replica of `master` (the cluster has replicas)."""
        for server in self.servers:
            replication = redis.Redis(port=server.port).info("replication")
            if replication["role"] == "slave" and int(replication["master_port"]) == master.port:
                return server
        raise AssertionError(f"node {master.port} has no replica")

    def wait_replicated(self, master: RedisServer, timeout_s: float = 10) -> None:
        """Wait until every write `master` has taken so far has reached its replica."""
        offset = int(redis.Redis(port=master.port).info("replication")["master_repl_offset"])
        replica = redis.Redis(port=self.replica_of(master).port)
        deadline = time.monotonic() + timeout_s
        while int(replica.info("replication").get("slave_repl_offset", -1)) < offset:
            if time.monotonic() > deadline:
                raise AssertionError(f"the replica of {master.port} did not catch up within {timeout_s} s")
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill every node and delete its data."""
        for server in self.servers:
            server.remove()
