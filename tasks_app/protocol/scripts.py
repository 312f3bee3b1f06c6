"""The Lua scripts of lua/ (includes expanded), run by SHA, and the Redis connections they run on."""

from __future__ import annotations

import hashlib
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterError,
    ConnectionError as RedisConnectionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TimeoutError as RedisTimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from tasks_app.protocol.keys import Keys

# Idle connections kept for the next calls; more are closed when given back.
SPARE_MAX = 64


class DirectCalls:
    """Commands sent on connections of a lock-free stack, not through the client's pool and retry layers."""

    # redis-py's pool locks on every get and release and wraps each call in retry and event hooks: a
    # third of a single enqueue's CPU. A connection goes back on the stack only after its whole reply.

    __slots__ = ("_connection_class", "_connection_kwargs", "_pid", "_spare")

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._connection_class = pool.connection_class
        self._connection_kwargs = dict(pool.connection_kwargs)
        self._spare: deque[Any] = deque()
        self._pid = os.getpid()

    @classmethod
    def of(cls, client: Any) -> DirectCalls | None:
        """Direct calls on `client`; None for Redis Cluster (commands routed by slot) or a client that re-sends."""
        if not isinstance(client, redis.Redis):
            return None
        pool = client.connection_pool
        sample = pool.connection_class(**pool.connection_kwargs)  # not connected: only its retry policy is read
        return cls(client) if sample.retry.get_retries() == 0 else None

    def call(self, *args: Any) -> Any:
        """Send one command and return its reply; errors raise as in redis-py."""
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
            if connection.can_read():  # the server closed it: start afresh
                connection.disconnect()
        except (RedisConnectionError, RedisTimeoutError, OSError):
            connection.disconnect()
        return connection

    def _give_back(self, connection: Any) -> None:
        if len(self._spare) < SPARE_MAX:
            self._spare.append(connection)
        else:
            connection.disconnect()


# tasks_app/lua links to the top-level lua/ in the repository; the wheel holds the files themselves.
LUA_DIR = Path(__file__).resolve().parent.parent / "lua"

# A line "-- include: NAME" in a script is replaced by lua/include/NAME.lua (helpers shared by scripts).
_INCLUDE = re.compile(rb"^-- include: ([a-z_]+)$", re.MULTILINE)

# Errors of a server (or cluster) state that passes: anything else fails the same way every time.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    TryAgainError,
    ReadOnlyError,
    OutOfMemoryError,
    SlotNotCoveredError,
)
TRANSIENT_REPLY_PREFIXES = ("LOADING", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "OOM", "NOREPLICAS")


def is_transient(exc: BaseException) -> bool:
    """True for errors that trying again later can cure (Redis away or busy), False for the rest."""
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(TRANSIENT_REPLY_PREFIXES)


class MisconfiguredKey(ResponseError):
    """A script failed for what a key of ours holds (a wrong type, say); the message names the script and its keys."""


def _misconfigured(read_type: Callable[[str], Any], name: str, keys: Sequence[str], exc: ResponseError) -> Exception:
    """`exc` as MisconfiguredKey naming script `name` and the type of each of `keys`; a transient error as is."""
    if is_transient(exc) or isinstance(exc, MisconfiguredKey):
        return exc
    types = []
    for key in keys:
        try:
            kind = read_type(key)
        except Exception as type_exc:  # must not hide the error it reports
            kind = f"unknown ({type_exc})"
        types.append(f"{key} ({kind.decode() if isinstance(kind, bytes) else kind})")
    return MisconfiguredKey(f"script {name} failed: {exc}; its keys: {', '.join(types) or 'none'}")


def reply_text(value: Any) -> str:
    """A script's reply as text: bytes decoded (undecodable ones escaped), anything else as `str` has it."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


class Scripts:
    """The Lua scripts of lua/, loaded once and run by SHA (reloaded after a Redis restart)."""

    def __init__(self, directory: Path = LUA_DIR) -> None:
        def include(match: re.Match[bytes]) -> bytes:
            return (directory / "include" / f"{match[1].decode()}.lua").read_bytes()

        self.sources = {path.stem: _INCLUDE.sub(include, path.read_bytes()) for path in sorted(directory.glob("*.lua"))}
        self.shas = {name: hashlib.sha1(src).hexdigest() for name, src in self.sources.items()}

    def run(
        self, client: Any, name: str, keys: Sequence[str], args: Sequence[Any], direct: DirectCalls | None = None
    ) -> Any:
        """Run script `name` on `client` (through `direct` if given), by source if the server does not have it."""
        send = client.execute_command if direct is None else direct.call
        try:
            try:
                return send("EVALSHA", self.shas[name], len(keys), *keys, *args)
            except NoScriptError:
                return send("EVAL", self.sources[name], len(keys), *keys, *args)
        except RedisConnectionError:
            _replace_dead_default_node(client)
            raise
        except ResponseError as exc:
            raise _misconfigured(partial(send, "TYPE"), name, keys, exc) from exc

    def queue(self, pipe: Any, name: str, keys: Sequence[str], args: Sequence[Any], *, by_source: bool = False) -> None:
        """Add a run of script `name` to a pipeline (see `execute`); `by_source` sends EVAL, not EVALSHA."""
        # Remembered by position, so `execute` can re-run it without redis-py internals.
        vars(pipe).setdefault(_QUEUED_SCRIPTS, {})[len(pipe)] = (name, tuple(keys), tuple(args))
        # ClusterPipeline blocks evalsha(), yet routes an EVALSHA sent as a command by its keys.
        command, script = ("EVAL", self.sources[name]) if by_source else ("EVALSHA", self.shas[name])
        pipe.execute_command(command, script, len(keys), *keys, *args)

    def execute(self, pipe: Any, client: Any, raise_on_error: bool = True) -> list[Any]:
        """Execute a pipeline, re-running by source the scripts the server lacked; errors in place unless raised."""
        # A re-run meeting a transient error raises it, sending no later re-run: each may count on those before.
        queued: dict[int, tuple[str, tuple[str, ...], tuple[Any, ...]]] = vars(pipe).pop(_QUEUED_SCRIPTS, {})
        try:
            results: list[Any] = pipe.execute(raise_on_error=False)
            for index, outcome in enumerate(results):
                if isinstance(outcome, NoScriptError):  # run by source; a deterministic error is its reply
                    name, keys, args = queued[index]
                    try:
                        results[index] = outcome = client.eval(self.sources[name], len(keys), *keys, *args)
                    except ResponseError as exc:
                        if is_transient(exc):
                            raise
                        results[index] = outcome = exc
                if isinstance(outcome, ResponseError) and index in queued:
                    results[index] = _misconfigured(client.type, *queued[index][:2], outcome)
        except RedisConnectionError:
            _replace_dead_default_node(client)
            raise
        if raise_on_error:
            for outcome in results:
                if isinstance(outcome, Exception):
                    raise outcome
        return results


def _replace_dead_default_node(client: Any) -> None:
    # redis-py (8.1) asks a cluster's default node for a script's keys (COMMAND GETKEYS) before
    # routing it, and keeps a dead default node after a failover: every later script would fail.
    if isinstance(client, redis.RedisCluster):
        client.replace_default_node()


# Attribute of a pipeline holding the scripts queued on it: position -> (name, keys, args).
_QUEUED_SCRIPTS = "_tasks_queued_scripts"


def connect(url: str, cluster: bool = False, *, timeout_s: float = 15.0, resend: bool = True) -> Any:
    """Open a Redis (or Redis Cluster) client for `url`; with `resend=False` it never re-sends a command."""
    # redis-py's default `Retry` re-sends a command whose reply was lost: a claim would move tasks twice.
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": min(5.0, timeout_s),
        "health_check_interval": 30,
    }
    if not resend:
        options["retry"] = Retry(NoBackoff(), 0)
    return (redis.RedisCluster if cluster else redis.Redis).from_url(url, **options)


class ScriptClient:
    """What every role of the broker shares: the client, the keys and the scripts, and the calls on them."""

    def __init__(self, client: Any, keys: Keys, scripts: Scripts) -> None:
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.direct = DirectCalls.of(client)

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], *, direct: bool = False) -> Any:
        """Run script `name` (see `Scripts.run`); `direct`: past redis-py's pool and retry layers (`DirectCalls`)."""
        return self.scripts.run(self.client, name, keys, args, self.direct if direct else None)

    def run_many(
        self, name: str, calls: Iterable[tuple[Sequence[str], Sequence[Any]]], raise_on_error: bool = True
    ) -> list[Any]:
        """Run script `name` once per (keys, args) of `calls`, in one round trip (see `Scripts.execute`)."""
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            self.scripts.queue(pipe, name, keys, args)
        return self.scripts.execute(pipe, self.client, raise_on_error)

    def each(self, items: Iterable[Any], command: Callable[[Any, Any], object]) -> list[Any]:
        """Queue `command(pipe, item)` for each of `items` on a pipeline; return their replies, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for item in items:
            command(pipe, item)
        return list(pipe.execute())

    def run_on_records(self, name: str, keys: Sequence[str], shared: Sequence[Any], each: Sequence[Any]) -> list[int]:
        """Script `name` on result records (`each`: an argument per record): one call, or one a record on a cluster."""
        if not isinstance(self.client, redis.RedisCluster):
            return [int(reply) for reply in self.run(name, keys, [*shared, *each])]
        replies = self.run_many(name, [([key], [*shared, *each[at : at + 1]]) for at, key in enumerate(keys)])
        return [int(reply[0]) for reply in replies]

    def announce(self, pipe: Any, queues: Iterable[str], *, by_source: bool = False) -> None:
        """Add `queues` to the queue set on `pipe` (`announce_queues`)."""
        self.scripts.queue(pipe, "announce_queues", [self.keys.queues()], sorted(queues), by_source=by_source)

    def server_time_us(self) -> int:
        """Return the Redis server's clock in microseconds (as the scripts' `server_now_us`)."""
        seconds, micros = self.client.time()
        return int(seconds) * 1_000_000 + int(micros)


class Role:
    """A role of the broker: its operations over the shared client, keys and scripts."""

    def __init__(self, redis: ScriptClient) -> None:
        self.redis = redis
        self.client, self.keys, self.scripts = redis.client, redis.keys, redis.scripts
