"""Which of the keys a connection read were changed since by another client: Redis client-side tracking.

A consumer claims on one connection with tracking on (`CLIENT TRACKING ON REDIRECT <id> NOLOOP`): every
key its claim scripts read is remembered by Redis, which tells a second connection, subscribed to
`__redis__:invalidate`, when another client changes it (an enqueue, a promotion of due delayed tasks,
a resume). A key is told once, then forgotten until read again, so the messages are bounded by the
claims. Idle, neither sends more than a health check every 30 s. Single server only: Redis Cluster
tracks per node.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

INVALIDATE_CHANNEL = "__redis__:invalidate"
# How long a wait for changes lasts at most, so that its thread looks whether it is told to stop.
CHANGE_WAIT_S = 0.5
# What a connection to the same server as another client's takes from it.
SERVER_OPTIONS = {
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "health_check_interval",
}


class KeyChanges:
    """A tracked client for claims, and the keys other clients changed among those it read."""

    def __init__(self, client: redis.Redis) -> None:
        """Two connections of their own to the server of `client` (see `trackable`)."""
        pool = client.connection_pool
        options = {k: v for k, v in pool.connection_kwargs.items() if k in SERVER_OPTIONS or k.startswith("ssl")}
        options["connection_class"] = pool.connection_class
        # RESP2: redirected invalidations arrive as Pub/Sub messages (RESP3 makes them push replies).
        self._listener = redis.Redis(connection_pool=redis.ConnectionPool(**{**options, "protocol": 2}))
        self._pubsub: Any = None
        self._listener_id = 0
        self._everything = True  # every key may have changed unseen: (re)connected, or Redis flushed
        # One connection, used by one thread; tracking is set at each (re)connect: a new one tracks nothing yet.
        self._pool = redis.ConnectionPool(
            **{**options, "max_connections": 1, "redis_connect_func": self._track, "retry": Retry(NoBackoff(), 0)}
        )
        self.client = redis.Redis(connection_pool=self._pool)

    @staticmethod
    def trackable(client: Any) -> bool:
        """Whether `client` talks to one real Redis server (not a Redis Cluster, not an in-process fake)."""
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
        """Connect the listener if it is not; True if it was not."""
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
