"""`DirectCalls`: one command and its reply on a connection of a small stack of its own, past redis-py's layers."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError, TimeoutError as RedisTimeoutError

# Idle connections kept for the next calls (one per thread enqueueing at once, up to this); more are closed
# when given back, so a burst of threads leaves no more open than this.
SPARE_MAX = 64


class DirectCalls:
    """Commands sent on connections of a lock-free stack, not through the client's pool and retry layers.

    redis-py's pool takes a lock and updates its connection counters on every get and every
    release, and its client wraps each call in retry and event hooks: in a single enqueue that was
    a third of the producer's CPU. A deque's pop and append are atomic, and a connection goes back
    on the stack only after its reply was read whole (redis-py's connection closes itself on any
    other error), so nothing is left unread on one. As the pool does, a connection taken from the
    stack that the server closed meanwhile (idle timeout, restart) is opened again before the call.
    The client's pool never sees these connections: its `close()` leaves them open until they are
    collected. Only for clients whose connections never re-send a command (see `of`).
    """

    __slots__ = ("_connection_class", "_connection_kwargs", "_pid", "_spare")

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._connection_class = pool.connection_class
        self._connection_kwargs = dict(pool.connection_kwargs)
        self._spare: deque[Any] = deque()
        self._pid = os.getpid()

    @classmethod
    def of(cls, client: Any) -> DirectCalls | None:
        """Direct calls on `client`; None for Redis Cluster (commands routed by slot) or a client that re-sends.

        A connection of `connect()`'s clients has no retries: a call whose connection fails raises
        and is never sent twice. A client configured to re-send keeps its own path.
        """
        if not isinstance(client, redis.Redis):
            return None
        pool = client.connection_pool
        sample = pool.connection_class(**pool.connection_kwargs)  # not connected: only its retry policy is read
        return cls(client) if sample.retry.get_retries() == 0 else None

    def call(self, *args: Any) -> Any:
        """Send one command and return its reply; error replies, lost connections and timeouts raise as in redis-py."""
        connection = self._connection()
        try:
            connection.send_command(*args)
            reply = connection.read_response()
        except ResponseError:
            self._give_back(connection)  # the error reply was read whole
            raise
        except BaseException:
            connection.disconnect()  # done already for a lost connection or a timeout; not given back
            raise
        self._give_back(connection)
        return reply

    def _connection(self) -> Any:
        if self._pid != os.getpid():  # a forked child: the parent's sockets are not its own
            self._spare = deque()
            self._pid = os.getpid()
        try:
            connection = self._spare.pop()
        except IndexError:
            return self._connection_class(**self._connection_kwargs)
        try:
            if connection.can_read():  # the server closed it (or, never, left a reply): start afresh
                connection.disconnect()
        except (RedisConnectionError, RedisTimeoutError, OSError):
            connection.disconnect()
        return connection

    def _give_back(self, connection: Any) -> None:
        if len(self._spare) < SPARE_MAX:
            self._spare.append(connection)
        else:
            connection.disconnect()
