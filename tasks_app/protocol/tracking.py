"""Which keys another client changed since a connection read them: Redis client-side tracking.

A consumer claims on a connection with tracking on (`REDIRECT <listener> NOLOOP`); Redis tells the
listener, subscribed to `__redis__:invalidate`, once per key read, so messages are bounded by claims.
On Redis Cluster every primary broadcasts changes to the watched keys instead (`BCAST PREFIX`).
"""

from __future__ import annotations

import queue as queue_module
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

INVALIDATE_CHANNEL = "__redis__:invalidate"
# Longest wait for changes, so its thread sees a stop soon.
CHANGE_WAIT_S = 0.5
# How often a cluster watch pings its tracking connection (Redis says nothing if it drops), and how
# often the watches are matched to the cluster's primaries again.
WATCH_CHECK_S, TOPOLOGY_CHECK_S = 5.0, 10.0
# What a connection to the same server as another client's takes from it: where, who, and timeouts.
SERVER_OPTIONS = {"host", "port", "path", "db", "username", "password"}
SERVER_OPTIONS |= {"socket_timeout", "socket_connect_timeout", "health_check_interval"}


def server_options(connection_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a connection of our own to the server of `connection_kwargs` takes from them."""
    return {k: v for k, v in connection_kwargs.items() if k in SERVER_OPTIONS or k.startswith("ssl")}


class KeyChanges:
    """A tracked client for claims, and the keys other clients changed among those it read."""

    def __init__(self, client: redis.Redis) -> None:
        """Two connections of their own to the server of `client` (see `trackable`)."""
        pool = client.connection_pool
        options = {**server_options(pool.connection_kwargs), "connection_class": pool.connection_class}
        # RESP2: redirected invalidations arrive as Pub/Sub messages (RESP3 makes them push replies).
        self._listener = redis.Redis(connection_pool=redis.ConnectionPool(**{**options, "protocol": 2}))
        self._pubsub: Any = None
        self._listener_id = 0
        self._everything = True  # every key may have changed unseen: (re)connected, or Redis flushed
        # One connection for one thread; tracking is set at each (re)connect.
        self._pool = redis.ConnectionPool(
            **{**options, "max_connections": 1, "redis_connect_func": self._track, "retry": Retry(NoBackoff(), 0)}
        )
        self.client = redis.Redis(connection_pool=self._pool)

    @staticmethod
    def trackable(client: Any) -> bool:
        """Whether `client` talks to one real Redis server (not a cluster, not a fake)."""
        connection_classes = (redis.Connection, redis.SSLConnection, redis.UnixDomainSocketConnection)
        return isinstance(client, redis.Redis) and client.connection_pool.connection_class in connection_classes

    def _track(self, connection: Any) -> None:
        connection.on_connect()
        self._listen()
        connection.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", self._listener_id, "NOLOOP")
        connection.read_response()
        self._everything = True

    def changed(self, timeout_s: float) -> set[bytes] | None:
        """The keys changed by others, waiting up to `timeout_s` for the first; None if any key may have."""
        if self._listen():
            self._pool.disconnect()  # tracks again, redirected to the new listener, at its next command
        keys: set[bytes] = set()
        try:
            message = self._pubsub.get_message(timeout=timeout_s)
            while message is not None:
                if message["type"] == "message":
                    if message["data"] is None:  # FLUSHALL, FLUSHDB, or the tracking table evicted keys at once
                        self._everything = True
                    else:
                        keys.update(message["data"])
                message = self._pubsub.get_message(timeout=0)
        except redis.RedisError:
            self._pubsub.close()
            self._pubsub = None
            raise
        if self._everything:
            self._everything = False
            return None
        return keys

    def _listen(self) -> bool:
        if self._pubsub is not None:
            return False
        pubsub = self._listener.pubsub()
        try:
            pubsub.execute_command("CLIENT", "ID")
            self._listener_id = int(pubsub.parse_response(timeout=5))
            pubsub.subscribe(INVALIDATE_CHANNEL)
        except redis.RedisError:
            pubsub.close()
            raise
        self._pubsub = pubsub
        self._everything = True
        return True

    def close(self) -> None:
        """Close both connections."""
        if self._pubsub is not None:
            self._pubsub.close()
        self._pool.disconnect()


class ClusterKeyChanges:
    """On Redis Cluster: the keys among `watched` that any client changed, told by every primary node."""

    def __init__(self, client: redis.RedisCluster, watched: Iterable[str]) -> None:
        self.client = client
        self._prefixes = sorted(set(watched))
        self._told: queue_module.SimpleQueue[set[bytes] | None] = queue_module.SimpleQueue()
        self._watches: dict[tuple[str, int], _NodeWatch] = {}
        self._checked_at = float("-inf")

    def changed(self, timeout_s: float) -> set[bytes] | None:
        """The watched keys changed since the last call, waiting up to `timeout_s` for one; None: any may have."""
        if time.monotonic() - self._checked_at >= TOPOLOGY_CHECK_S:
            self._match_primaries()
        keys: set[bytes] = set()
        everything = False
        try:
            told = self._told.get(timeout=timeout_s)
            while True:
                if told is None:
                    everything = True
                else:
                    keys |= told
                told = self._told.get_nowait()
        except queue_module.Empty:
            pass
        return None if everything else keys

    def _match_primaries(self) -> None:
        self._checked_at = time.monotonic()
        primaries = {(node.host, int(node.port)) for node in self.client.get_primaries()}
        for address in set(self._watches) - primaries:
            self._watches.pop(address).stop()
        server = server_options(self.client.nodes_manager.connection_kwargs)
        for address in primaries - set(self._watches):
            node = {**server, "host": address[0], "port": address[1]}
            self._watches[address] = _NodeWatch(node, self._prefixes, self._told)

    def close(self) -> None:
        """Stop every watch (their threads end within CHANGE_WAIT_S)."""
        for watch in self._watches.values():
            watch.stop()


class _NodeWatch:
    """One primary's changes to the watched keys: a listener, a connection that set broadcast tracking, a thread."""

    def __init__(
        self, server: dict[str, Any], prefixes: list[str], told: queue_module.SimpleQueue[set[bytes] | None]
    ) -> None:
        self.server = server
        self.prefixes = prefixes
        self.told = told  # the keys changed (None: any may have)
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=f"tracking-{server['host']}:{server['port']}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            listener = tracker = None
            try:
                listener, tracker = self._connect()
                self.told.put(None)  # anything may have changed while it was not watching
                self._watch(listener, tracker)
            except redis.RedisError:
                self.told.put(None)
                self._stop.wait(1.0)  # the node may be failing over: the next topology check may stop this watch
            finally:
                for connection in (listener, tracker):
                    if connection is not None:
                        connection.close()

    def _connect(self) -> tuple[Any, redis.Redis]:
        listener = redis.Redis(**{**self.server, "protocol": 2, "single_connection_client": True}).pubsub()
        listener.execute_command("CLIENT", "ID")
        listener_id = int(listener.parse_response(timeout=5))
        listener.subscribe(INVALIDATE_CHANNEL)
        tracker = redis.Redis(**{**self.server, "single_connection_client": True})
        prefixes = [arg for prefix in self.prefixes for arg in ("PREFIX", prefix)]
        tracker.execute_command("CLIENT", "TRACKING", "ON", "REDIRECT", listener_id, "BCAST", *prefixes)
        return listener, tracker

    def _watch(self, listener: Any, tracker: redis.Redis) -> None:
        checked_at = time.monotonic()
        while not self._stop.is_set():
            message = listener.get_message(timeout=CHANGE_WAIT_S)
            if message is not None and message["type"] == "message":
                self.told.put(None if message["data"] is None else set(message["data"]))
            if time.monotonic() - checked_at >= WATCH_CHECK_S:
                tracker.ping()  # tracking ends with its connection, silently: a dropped one raises here
                checked_at = time.monotonic()


# What a loop waits on for changes: one server's tracking, or every primary's broadcasts on Redis Cluster.
Changes = KeyChanges | ClusterKeyChanges
