"""The only code that talks to Redis: key naming, the Lua scripts and one method per operation.

Every key of a queue carries the hash tag ``{queue}``, so each queue script touches one Redis
Cluster slot; every key a script touches is passed to it in KEYS. Two producer scripts
(`enqueue_batch` with many queues or records, `enqueue_one`) span slots on a single server; on
a Redis Cluster each call of `enqueue_batch` holds one queue or one record. See docs/PROTOCOL.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    ConnectionError as RedisConnectionError,
    NoScriptError,
    ReadOnlyError,
    TimeoutError as RedisTimeoutError,
    TryAgainError,
)
from redis.retry import Retry

from tasks_app.protocol import batch_args
from tasks_app.protocol.batch_args import Enqueueable

# tasks_app/lua links to the top-level lua/ in the repository; the wheel holds the files themselves.
LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
# Pushed onto an empty pending list to wake a consumer blocked on it; never a valid Task
# (field number 0 does not exist in protobuf), dropped wherever it is met.
WAKE_TOKEN = b"\x00wake"
# Each recovery of a task from a dead consumer is counted; past this it is dead-lettered.
MAX_RECOVERIES = 3
REAP_BATCH = 1000
# Ids given by callers are remembered per queue this long and up to this many, so a retry of a
# partly enqueued batch (Redis Cluster) or of one whose reply was lost does not push them twice.
ENQUEUED_IDS_KEEP_MS = 24 * 3600 * 1000
ENQUEUED_IDS_MAX = 100_000
# Type of the envelope that wraps bytes that are not a task in the dead letters (as the executor's).
UNDECODABLE_TYPE = "_undecodable"
# Tombstones examined per reaper pass: the newest page, and one more page in turn.
TOMBSTONE_PAGE = 100
TOMBSTONE_KEEP_MS = 24 * 3600 * 1000
# Width of the buckets counting acknowledged tasks, for the dashboard's throughput.
THROUGHPUT_BUCKET_S = 10
# Redis Cluster: how long a master's WAIT for one replica to have a flush's results may take
# (TASKS_CLUSTER_WAIT_MS), and how often each master's replica count is read again.
CLUSTER_WAIT_MS = 100
REPLICA_CHECK_S = 10.0


def delayed_member(priority: int, raw: bytes) -> bytes:
    """Encode a delayed-set member: the priority (clamped to -100..100) as 4 ASCII characters, then the task."""
    return f"{max(-100, min(100, int(priority))):+04d}".encode() + raw


_DELAYED_PREFIX = re.compile(rb"[+-][0-9]{3}")


def split_delayed_member(member: bytes) -> tuple[int, bytes] | None:
    """Split a delayed-set member into its priority and the serialized task; None if it is not one."""
    prefix = member[:4]
    if not _DELAYED_PREFIX.fullmatch(prefix) or len(member) == 4 or abs(int(prefix)) > 100:
        return None
    return int(prefix), member[4:]


@dataclass(frozen=True)
class Keys:
    """Builds every Redis key; queue keys share the queue's hash tag."""

    prefix: str

    def queue_key(self, queue: str, name: str) -> str:
        """Return the key `name` of `queue`, e.g. ``ts:{default}:pending``."""
        return f"{self.prefix}:{{{queue}}}:{name}"

    def pending(self, queue: str) -> str:
        return self.queue_key(queue, "pending")

    def prioritized(self, queue: str) -> str:
        return self.queue_key(queue, "prioritized")

    def delayed(self, queue: str) -> str:
        return self.queue_key(queue, "delayed")

    def dead(self, queue: str) -> str:
        return self.queue_key(queue, "dead")

    def enqueued(self, queue: str) -> str:
        """Ids given by callers that were recently enqueued to `queue` (id -> server ms)."""
        return self.queue_key(queue, "enqueued")

    def processing(self, queue: str, consumer_id: str) -> str:
        return self.queue_key(queue, f"processing:{consumer_id}")

    def consumers(self, queue: str) -> str:
        return self.queue_key(queue, "consumers")

    def consumer_info(self, queue: str) -> str:
        return self.queue_key(queue, "consumer_info")

    def reaped(self, queue: str) -> str:
        return self.queue_key(queue, "reaped")

    def recoveries(self, queue: str) -> str:
        return self.queue_key(queue, "recoveries")

    def suspects(self, queue: str) -> str:
        return self.queue_key(queue, "suspects")

    def fence(self, queue: str) -> str:
        """Counter issuing the fencing tokens of runs of `queue`'s tasks (see claim.lua)."""
        return self.queue_key(queue, "fence")

    def primary(self, queue: str) -> str:
        """Marker of the node serving this queue's slot and since when (reaping waits after a change)."""
        return self.queue_key(queue, "primary")

    def completed(self, queue: str, bucket: int) -> str:
        """Counter of tasks acknowledged in one THROUGHPUT_BUCKET_S-long bucket (bucket = epoch s // width)."""
        return self.queue_key(queue, f"completed:{bucket}")

    def queues(self) -> str:
        return f"{self.prefix}:queues"

    def result(self, task_id: str) -> str:
        return f"{self.prefix}:result:{task_id}"

    def rate(self, task_type: str) -> str:
        return f"{self.prefix}:rate:{{{task_type}}}"


# The fields a READY record may leave out, and the value each then has; the id is the key's suffix.
# The producer stores only what differs (see results.ready_fields); get_result fills these back in.
READY_RECORD_DEFAULTS = {"status": "READY", "priority": "0", "args": "[]", "kwargs": "{}", "attempts": "0"}


@dataclass(frozen=True)
class Claim:
    """What one claim moved into a consumer's processing list."""

    tasks: list[bytes]
    took_suspect: bool  # the first task is a suspect: recovered from a consumer that died holding it
    suspects_waiting: int  # suspects still in the queue's suspects list
    first_fence: int = 0  # fencing token of tasks[0]; tasks[i] holds first_fence + i
    lease_expired: bool = False  # nothing was claimed: the lease lapsed and has not been renewed


class Promotion(NamedTuple):
    """What one promote_due call did."""

    moved: int
    next_due_ms: int  # -1: nothing delayed
    now_ms: int  # the server's clock
    malformed: int  # due members that were not "<priority><task>", dead-lettered


@dataclass(frozen=True)
class ReapOutcome:
    """What one reap call did to one consumer's processing list."""

    status: int  # 1 reaped, -1 lease alive, -2 Redis restarted or failed over recently, -3 unknown consumer
    requeued: int
    remaining: int
    dead_lettered: list[bytes]


# Replies of a master that is failing over, moved a slot or was demoted: write the results again.
_NODE_STATE_REPLIES = (AskError, ClusterDownError, TryAgainError, ReadOnlyError, BusyLoadingError)


class AckReport(NamedTuple):
    """What a batch of result writes and acks did."""

    flags: dict[tuple[str, str], list[bool]]  # per (queue, consumer): whether each task was still held
    refused: dict[int, Exception]  # result writes Redis refused, by index
    unreplicated_masters: int = 0  # Redis Cluster: masters whose replica did not confirm the results in time


@dataclass(frozen=True)
class QueueStats:
    """Sizes of one queue's parts and its live consumers."""

    queue: str
    pending: int
    processing: int
    delayed: int
    dead: int
    consumers: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "pending": self.pending,
            "processing": self.processing,
            "delayed": self.delayed,
            "dead": self.dead,
            "consumers": self.consumers,
        }


# A line "-- include: NAME" in a script is replaced by lua/include/NAME.lua (helpers shared by scripts).
_INCLUDE = re.compile(rb"^-- include: ([a-z_]+)$", re.MULTILINE)


def _expand_includes(source: bytes, directory: Path) -> bytes:
    return _INCLUDE.sub(lambda match: (directory / "include" / f"{match[1].decode()}.lua").read_bytes(), source)


class Scripts:
    """The Lua scripts of lua/, loaded once and run by SHA (reloaded after a Redis restart)."""

    def __init__(self, directory: Path = LUA_DIR) -> None:
        self.sources = {
            path.stem: _expand_includes(path.read_bytes(), directory) for path in sorted(directory.glob("*.lua"))
        }
        self.shas = {name: hashlib.sha1(src).hexdigest() for name, src in self.sources.items()}

    def run(self, client: Any, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run script `name` on `client`, loading it first if the server does not have it."""
        try:
            return client.evalsha(self.shas[name], len(keys), *keys, *args)
        except NoScriptError:
            return client.eval(self.sources[name], len(keys), *keys, *args)
        except RedisConnectionError:
            _replace_dead_default_node(client)
            raise

    def queue(self, pipe: Any, name: str, keys: Sequence[str], args: Sequence[Any], *, by_source: bool = False) -> None:
        """Add a run of script `name` to a pipeline (see `execute`); `by_source` sends EVAL, not EVALSHA."""
        # Remember the call by its position, so `execute` can re-run it without reading
        # redis-py internals (a Redis Cluster pipeline keeps its commands elsewhere).
        vars(pipe).setdefault(_QUEUED_SCRIPTS, {})[len(pipe)] = (name, tuple(keys), tuple(args))
        # Through execute_command: ClusterPipeline blocks its evalsha() method, yet routes an
        # EVALSHA by its keys like any other command (all keys of a script share one slot).
        if by_source:
            pipe.execute_command("EVAL", self.sources[name], len(keys), *keys, *args)
        else:
            pipe.execute_command("EVALSHA", self.shas[name], len(keys), *keys, *args)

    def execute(self, pipe: Any, client: Any, raise_on_error: bool = True) -> list[Any]:
        """Execute a pipeline; re-run by source just those scripts the server did not have.

        With `raise_on_error` False, a command's error is returned in its place instead.
        """
        queued: dict[int, tuple[str, tuple[str, ...], tuple[Any, ...]]] = vars(pipe).pop(_QUEUED_SCRIPTS, {})
        try:
            results: list[Any] = pipe.execute(raise_on_error=False)
        except RedisConnectionError:
            _replace_dead_default_node(client)
            raise
        for index, outcome in enumerate(results):
            if isinstance(outcome, NoScriptError):
                name, keys, args = queued[index]
                try:
                    results[index] = client.eval(self.sources[name], len(keys), *keys, *args)
                except redis.ResponseError as exc:  # run every re-run before raising: the others are not undone
                    results[index] = exc
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
    """Open a Redis (or Redis Cluster) client for `url`; with `resend=False` it never re-sends a command.

    redis-py's default `Retry` (on Cluster: re-resolve the slots, send again) silently re-sends a
    command whose reply was lost: a claim or BLMOVE then moves tasks twice and the first call's
    tasks sit unknown in the consumer's list, an LPUSH enqueues twice. The consumer's clients do
    not re-send (it retries with backoff itself and knows what a lost reply means).
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": min(5.0, timeout_s),
        "health_check_interval": 30,
    }
    if not resend:
        options["retry"] = Retry(NoBackoff(), 0)
    if cluster:
        return redis.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


class Broker:
    """Queue operations on Redis, each one round trip or one script."""

    def __init__(
        self, client: Any, prefix: str, scripts: Scripts | None = None, *, cluster_wait_ms: int = CLUSTER_WAIT_MS
    ) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.scripts = scripts or Scripts()
        self.cluster_wait_ms = cluster_wait_ms
        # Redis Cluster: per master name, whether it had a replica and when that was read.
        self._replica_checks: dict[str, tuple[bool, float]] = {}
        self._masters_pool: ThreadPoolExecutor | None = None
        self._masters_with_scripts: set[str] = set()
        # Queues this process already added to the queue set: one SADD per queue, not per enqueue.
        self._announced_queues: set[str] = set()

    @classmethod
    def from_settings(cls, *, prefix: str | None = None, timeout_s: float = 15.0, resend: bool = True) -> Broker:
        """Build a broker, with a connection pool of its own, from Django settings (see `connect`)."""
        from django.conf import settings

        client = connect(settings.REDIS_URL, settings.REDIS_CLUSTER, timeout_s=timeout_s, resend=resend)
        return cls(client, prefix or settings.TASKS_KEY_PREFIX, cluster_wait_ms=settings.TASKS_CLUSTER_WAIT_MS)

    def _script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self.scripts.run(self.client, name, keys, args)

    # --- producing -------------------------------------------------------------------------
    def enqueue(self, items: Sequence[Enqueueable], result_ttl_s: int) -> None:
        """Write each task's READY record (kept result_ttl_s past its due time) and push the tasks.

        On a single Redis server all or nothing (see `_enqueue_on_server`). On Redis Cluster one
        call per queue and per record in one round trip: some may be pushed when an error is raised.
        """
        if len(items) == 1 and self._enqueue_one(items[0], result_ttl_s):
            return
        new_queues = {item.queue for item in items} - self._announced_queues
        if isinstance(self.client, redis.RedisCluster):
            self._enqueue_on_cluster(items, result_ttl_s, new_queues)
        else:
            self._enqueue_on_server(items, result_ttl_s, new_queues)
        self._announced_queues |= new_queues

    def _enqueue_on_server(self, items: Sequence[Enqueueable], result_ttl_s: int, new_queues: set[str]) -> None:
        # One enqueue_batch call, atomic on its own. Plain tasks are cheaper as native LPUSHes
        # (no copy into Lua): then LPUSH and the script (by source, so NOSCRIPT cannot split
        # them) run in MULTI/EXEC, which Redis refuses whole when it is out of memory.
        sections = batch_args.sections(items)
        records = [item for item in items if item.result_key_fields]
        keys = [key for queue in sections for key in self._queue_section_keys(queue)]
        keys += [self.keys.queues()] if new_queues else []
        keys += [self.keys.result(item.task_id) for item in records]
        args: list[Any] = [
            WAKE_TOKEN,
            ENQUEUED_IDS_KEEP_MS,
            ENQUEUED_IDS_MAX,
            "1" if new_queues else "0",
            len(sections),
        ]
        for queue, section in sections.items():
            args += section.args(queue, with_plain=False)
        args += batch_args.record_groups(records, result_ttl_s)
        if not any(section.plain for section in sections.values()):
            self._script("enqueue_batch", keys, args)
            return
        pipe = self.client.pipeline(transaction=True)
        for queue, section in sections.items():
            if section.plain:
                pipe.lpush(self.keys.pending(queue), *section.plain)
        pipe.eval(self.scripts.sources["enqueue_batch"], len(keys), *keys, *args)
        pipe.execute()

    def _enqueue_on_cluster(self, items: Sequence[Enqueueable], result_ttl_s: int, new_queues: set[str]) -> None:
        # Result keys and queues lie in different slots: one call per record, then one per queue.
        pipe = self.client.pipeline(transaction=False)
        head = [WAKE_TOKEN, ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, "0"]
        for item in items:
            if item.result_key_fields:
                self.scripts.queue(
                    pipe,
                    "enqueue_batch",
                    [self.keys.result(item.task_id)],
                    [*head, 0, *batch_args.record_groups([item], result_ttl_s)],
                )
        for queue, section in batch_args.sections(items).items():
            self.scripts.queue(pipe, "enqueue_batch", self._queue_section_keys(queue), [*head, 1, *section.args(queue)])
        if new_queues:
            pipe.sadd(self.keys.queues(), *new_queues)
        self.scripts.execute(pipe, self.client)

    def _queue_section_keys(self, queue: str) -> list[str]:
        return [
            self.keys.pending(queue),
            self.keys.prioritized(queue),
            self.keys.delayed(queue),
            self.keys.enqueued(queue),
        ]

    def _enqueue_one(self, item: Enqueueable, result_ttl_s: int) -> bool:
        # The common single enqueue as a script call without the batch's sections (~15 % more
        # tasks/s than a pipeline of two commands: the round trip is most of its cost). Its keys
        # lie in different slots, so not on Redis Cluster. False: not applicable, nothing written.
        if (
            not item.plain
            or not item.result_key_fields
            or item.queue not in self._announced_queues
            or isinstance(self.client, redis.RedisCluster)
        ):
            return False
        args: list[Any] = [result_ttl_s, item.raw]
        for name, value in item.result_key_fields.items():
            args += (name, value)
        self._script("enqueue_one", [self.keys.result(item.task_id), self.keys.pending(item.queue)], args)
        return True

    # --- claiming --------------------------------------------------------------------------
    def claim(self, queue: str, consumer_id: str, max_tasks: int, *, drop_wake: bool = False) -> list[bytes] | None:
        """Move up to `max_tasks` (no suspect) into this consumer's list; None if its lease was lost."""
        claimed = self.claim_with_suspect(queue, consumer_id, max_tasks, drop_wake=drop_wake, allow_suspect=False)
        return None if claimed is None else claimed.tasks

    # The claim methods below must not run on a client that re-sends after a lost reply (see
    # `connect`): a claim whose outcome is unknown is reconciled by the caller against `held_by`.

    def claim_with_suspect(
        self, queue: str, consumer_id: str, max_tasks: int, *, drop_wake: bool = False, allow_suspect: bool = True
    ) -> Claim | None:
        """Like `claim`, first taking one suspect if allowed; None if this consumer's lease was lost.

        Claims only under a live lease: one that lapsed (deadline passed, not yet reaped) claims
        nothing and says so (`lease_expired`) until a renewal succeeds.
        """
        keys = [
            self.keys.pending(queue),
            self.keys.prioritized(queue),
            self.keys.processing(queue, consumer_id),
            self.keys.consumers(queue),
            self.keys.suspects(queue),
            self.keys.fence(queue),
        ]
        claimed = self._script(
            "claim",
            keys,
            [consumer_id, max_tasks, WAKE_TOKEN, "1" if drop_wake else "0", "1" if allow_suspect else "0"],
        )
        if claimed is None:
            return None
        took_suspect, suspects_waiting, first_fence, *tasks = claimed
        if took_suspect == -1:
            return Claim([], False, 0, lease_expired=True)
        return Claim(tasks, bool(took_suspect), int(suspects_waiting), int(first_fence))

    def mark_started(self, queue: str, raw: bytes) -> None:
        """Record that a suspect task is starting, so a death while it runs counts against it."""
        self.client.hset(self.keys.recoveries(queue), f"s:{hashlib.sha1(raw).hexdigest()}", 1)

    def claim_blocking(self, queue: str, consumer_id: str, timeout_s: float) -> tuple[bytes | None, int]:
        """Block until a task can move from pending into this consumer's list (BLMOVE).

        Returns the task and its fencing token; (WAKE_TOKEN, 0) when woken for a prioritized
        task, (None, 0) on timeout.
        """
        raw = self.client.blmove(
            self.keys.pending(queue), self.keys.processing(queue, consumer_id), timeout_s, "RIGHT", "LEFT"
        )
        if raw is None or raw == WAKE_TOKEN:
            return raw, 0
        return raw, self.issue_fence(queue)

    def issue_fence(self, queue: str) -> int:
        """Issue one fencing token of `queue`: higher than every token issued before it."""
        return int(self._script("issue_fence", [self.keys.fence(queue)], [1]))

    # --- finishing -------------------------------------------------------------------------
    def ack(
        self, queue: str, consumer_id: str, raws: Sequence[bytes], results: Sequence[ResultUpdate] = ()
    ) -> list[bool]:
        """Record results, then acknowledge tasks, in one round trip; flags say which were still held."""
        return self.ack_many(results, {(queue, consumer_id): raws})[(queue, consumer_id)]

    def ack_many(
        self, results: Sequence[ResultUpdate], raws_by_owner: Mapping[tuple[str, str], Sequence[bytes]]
    ) -> dict[tuple[str, str], list[bool]]:
        """Record results, then acknowledge the tasks of each (queue, consumer) list, in one round trip."""
        report = self.ack_many_reporting(results, raws_by_owner)
        if report.refused:
            raise next(iter(report.refused.values()))
        return report.flags

    def ack_many_reporting(
        self, results: Sequence[ResultUpdate], raws_by_owner: Mapping[tuple[str, str], Sequence[bytes]]
    ) -> AckReport:
        """Like `ack_many`, but a result write Redis refuses stops nothing: its index and error are reported.

        On Redis Cluster the results and the acks live on different nodes, where one pipeline
        gives no order: the results are written first, each master that took some WAITs (on the
        same connection, all masters at once) until a replica has them or `cluster_wait_ms`
        passed, and only then are the tasks acked.
        """
        pipe = self.client.pipeline(transaction=False)
        written: list[Any] = []
        unreplicated = 0
        if isinstance(self.client, redis.RedisCluster) and results and raws_by_owner:
            written, unreplicated = self._write_results_replicated(results)
        else:
            for update in results:
                self._queue_result(pipe, update)
        bucket = int(time.time()) // THROUGHPUT_BUCKET_S
        for (queue, consumer_id), raws in raws_by_owner.items():
            self.scripts.queue(
                pipe,
                "ack",
                [
                    self.keys.processing(queue, consumer_id),
                    self.keys.recoveries(queue),
                    self.keys.completed(queue, bucket),
                ],
                list(raws),
            )
        written += self.scripts.execute(pipe, self.client, raise_on_error=False)
        refused = {
            index: outcome for index, outcome in enumerate(written[: len(results)]) if isinstance(outcome, Exception)
        }
        outcomes = written[len(results) :]
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        flags = {owner: [bool(flag) for flag in flags] for owner, flags in zip(raws_by_owner, outcomes, strict=True)}
        return AckReport(flags, refused, unreplicated)

    def _write_results_replicated(self, results: Sequence[ResultUpdate]) -> tuple[list[Any], int]:
        """Write results on a cluster, every master at once; return each write's reply and how many WAITs timed out."""
        by_master: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        for index, update in enumerate(results):
            node = self.client.get_node_from_key(self.keys.result(update.task_id))
            nodes[node.name] = node
            by_master.setdefault(node.name, []).append(index)
        jobs = [(nodes[name], [results[index] for index in indexes]) for name, indexes in by_master.items()]
        if len(jobs) == 1:
            done = [self._write_on_master(*jobs[0])]
        else:
            if self._masters_pool is None:
                self._masters_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="results-on-masters")
            futures = [self._masters_pool.submit(self._write_on_master, *job) for job in jobs]
            wait_for(futures)  # every master has answered before an error of one is raised
            done = [future.result() for future in futures]
        written: list[Any] = [None] * len(results)
        for indexes, (replies, _) in zip(by_master.values(), done, strict=True):
            for index, reply in zip(indexes, replies, strict=True):
                written[index] = reply
        return written, sum(timed_out for _, timed_out in done)

    def _write_on_master(self, node: Any, updates: list[ResultUpdate]) -> tuple[list[Any], int]:
        """Write `updates` on `node` and WAIT there for a replica; return the replies and 1 if the WAIT timed out.

        WAIT counts the writes of its own connection, so it goes in the writes' pipeline: on the
        node's own client, never re-sent elsewhere. Scripts a just-promoted master lacks are sent
        again by source with another WAIT. A lost node, a moved slot or a failed WAIT raise
        ClusterError (the slot map is read again), so the caller writes the results again.
        """
        client = self.client.get_redis_connection(node)
        waits = self._has_replica(node.name, client)
        replies: list[Any] = [None] * len(updates)
        todo = list(range(len(updates)))
        timed_out = 0
        # By source first on a master not yet written to here, so a WAIT is not spent on NOSCRIPT.
        for by_source in (False, True) if node.name in self._masters_with_scripts else (True,):
            pipe = client.pipeline(transaction=False)
            for index in todo:
                self._queue_result(pipe, updates[index], by_source=by_source)
            if waits:
                pipe.execute_command("WAIT", 1, self.cluster_wait_ms)
            sent = self._execute_on_master(node, pipe, waits)
            timed_out = 1 if waits and int(sent[-1]) < 1 else timed_out
            for index, reply in zip(todo, sent, strict=False):  # then the WAIT's reply
                replies[index] = reply
            todo = [index for index in todo if isinstance(replies[index], NoScriptError)]
            if not todo:
                self._masters_with_scripts.add(node.name)
                break
        return replies, timed_out

    def _execute_on_master(self, node: Any, pipe: Any, waits: bool) -> list[Any]:
        """Execute a pipeline on one master; ClusterError (after reading the slot map again) if the node failed it."""
        try:
            sent = pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            self.client.nodes_manager.initialize()
            raise ClusterError(f"lost master {node.name} while writing results: {exc}") from exc
        if any(isinstance(reply, _NODE_STATE_REPLIES) for reply in sent) or (waits and isinstance(sent[-1], Exception)):
            self.client.nodes_manager.initialize()
            raise ClusterError(f"master {node.name} answered as in a failover: {sent}")
        return list(sent)

    def _has_replica(self, name: str, client: Any) -> bool:
        """Whether master `name` has a connected replica (read again every REPLICA_CHECK_S)."""
        checked = self._replica_checks.get(name)
        now_s = time.monotonic()
        if checked is None or now_s - checked[1] > REPLICA_CHECK_S:
            checked = (int(client.info("replication").get("connected_slaves", 0)) > 0, now_s)
            self._replica_checks[name] = checked
        return checked[0]

    def retry_later(
        self,
        queue: str,
        consumer_id: str,
        raw: bytes,
        new_raw: bytes,
        priority: int,
        delay_ms: int,
        result: ResultUpdate | None = None,
    ) -> bool:
        """Move a claimed task to the delayed set, due `delay_ms` from now; False if it was lost."""
        keys = [self.keys.processing(queue, consumer_id), self.keys.delayed(queue), self.keys.recoveries(queue)]
        args = [raw, delayed_member(priority, new_raw), max(0, int(delay_ms))]
        return self._with_result("retry_later", keys, args, result)

    def dead_letter(
        self, queue: str, consumer_id: str, raw: bytes, new_raw: bytes, result: ResultUpdate | None = None
    ) -> bool:
        """Move a claimed task to the dead-letter set; False if it was lost."""
        keys = [self.keys.processing(queue, consumer_id), self.keys.dead(queue), self.keys.recoveries(queue)]
        return self._with_result("dead_letter", keys, [raw, new_raw], result)

    def _with_result(self, script: str, keys: list[str], args: list[Any], result: ResultUpdate | None) -> bool:
        if result is None:
            return bool(self._script(script, keys, args))
        pipe = self.client.pipeline(transaction=False)
        self.scripts.queue(pipe, script, keys, args)
        self._queue_result(pipe, result)
        return bool(self.scripts.execute(pipe, self.client)[0])

    def held_by(self, queue: str, consumer_id: str) -> list[bytes]:
        """Return the tasks in a consumer's processing list."""
        return list(self.client.lrange(self.keys.processing(queue, consumer_id), 0, -1))

    def return_unstarted(self, queue: str, consumer_id: str, raws: Sequence[bytes]) -> int:
        """Put claimed, never-started tasks back at the head of pending, first one first."""
        if not raws:
            return 0
        keys = [
            self.keys.processing(queue, consumer_id),
            self.keys.pending(queue),
            self.keys.recoveries(queue),
            self.keys.suspects(queue),
        ]
        return int(self._script("return_unstarted", keys, list(raws)))

    # --- results ---------------------------------------------------------------------------
    def record_result(self, update: ResultUpdate) -> bool:
        """Write one result update; False if it was ignored (a run with a later fence owns the record)."""
        pipe = self.client.pipeline(transaction=False)
        self._queue_result(pipe, update)
        return bool(self.scripts.execute(pipe, self.client)[0])

    def _queue_result(self, pipe: Any, update: ResultUpdate, *, by_source: bool = False) -> None:
        args: list[Any] = [
            update.ttl_s,
            update.append_worker_id or "",
            json.dumps(update.append_error) if update.append_error else "",
            update.fence or "",
        ]
        for name, value in update.fields.items():
            args.extend([name, value])
        self.scripts.queue(pipe, "record_result", [self.keys.result(update.task_id)], args, by_source=by_source)

    def get_result(self, task_id: str) -> dict[str, str] | None:
        """Return a task's result record as text fields (defaults filled in), or None if there is none."""
        record = self.client.hgetall(self.keys.result(task_id))
        if not record:
            return None
        # Bytes a foreign producer wrote need not be UTF-8: shown with escapes, never an error.
        fields = {
            key.decode(errors="backslashreplace"): value.decode(errors="backslashreplace")
            for key, value in record.items()
        }
        return {**READY_RECORD_DEFAULTS, "id": task_id, **fields}

    # --- delayed ---------------------------------------------------------------------------
    def promote_due(self, queue: str, limit: int = 1000) -> Promotion:
        """Move due delayed tasks into pending, and dead-letter due members that are not tasks."""
        keys = [
            self.keys.delayed(queue),
            self.keys.pending(queue),
            self.keys.prioritized(queue),
            self.keys.recoveries(queue),
            self.keys.suspects(queue),
            self.keys.dead(queue),
        ]
        moved, next_due_ms, now_ms, malformed = self._script(
            "promote_due", keys, [limit, WAKE_TOKEN, queue, UNDECODABLE_TYPE]
        )
        return Promotion(int(moved), int(next_due_ms), int(now_ms), int(malformed))

    # --- rate limits -----------------------------------------------------------------------
    def rate_limit(
        self,
        task_type: str,
        algorithm: str,
        task_id: str,
        limit: int,
        period_us: int,
        emission_us: int,
        tolerance_us: int,
    ) -> int:
        """Decide whether a task of `task_type` may start now: 0 if so, else microseconds to wait."""
        args = [algorithm, task_id, limit, period_us, emission_us, tolerance_us]
        return int(self._script("rate_limit", [self.keys.rate(task_type)], args))

    # --- leases and recovery ---------------------------------------------------------------
    def heartbeat(
        self, queues: Sequence[str], consumer_id: str, lease_ms: int, register_info: dict[str, Any] | None = None
    ) -> bool:
        """Register or renew this consumer's lease on every queue; False if any was lost or had lapsed."""
        info = json.dumps(register_info) if register_info is not None else ""
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            keys = [self.keys.consumers(queue), self.keys.consumer_info(queue), self.keys.primary(queue)]
            self.scripts.queue(pipe, "heartbeat", keys, [consumer_id, lease_ms, info])
            if register_info is not None:
                pipe.sadd(self.keys.queues(), queue)
        results = self.scripts.execute(pipe, self.client)
        return all(bool(flag) for flag in results[:: 2 if register_info is not None else 1])

    def abandon(self, queues: Sequence[str], consumer_id: str) -> None:
        """Tombstone an id whose lease was lost, so reapers sweep its lists even if its lease entry is gone.

        A blocking claim in flight can still move a task into such a list, and after a failover
        that lost the lease entry no reaper would otherwise look there.
        """
        now_ms = int(time.time() * 1000)
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            pipe.zadd(self.keys.reaped(queue), {consumer_id: now_ms}, nx=True)
        pipe.execute()

    def deregister(self, queue: str, consumer_id: str) -> int:
        """Leave cleanly: return anything still held to pending uncounted, and drop the lease."""
        keys = [
            self.keys.consumers(queue),
            self.keys.consumer_info(queue),
            self.keys.processing(queue, consumer_id),
            self.keys.pending(queue),
            self.keys.recoveries(queue),
            self.keys.suspects(queue),
        ]
        return int(self._script("deregister", keys, [consumer_id]))

    def reap_candidates(self, queue: str) -> tuple[list[str], list[str]]:
        """Return consumers whose lease expired, and the newest reaped ids whose lists are not empty."""
        expired, tombstones, _ = self.reap_candidate_page(queue, 0)
        return expired, tombstones

    def reap_candidate_page(self, queue: str, tombstone_offset: int) -> tuple[list[str], list[str], int]:
        """Return consumers whose lease expired, reaped ids whose lists are not empty, and the next offset.

        Tombstones are examined a page at a time: the newest page on every call, and the page at
        `tombstone_offset`; pass the returned offset next time to visit every page in turn.
        """
        out = self._script(
            "reap_candidates",
            [self.keys.consumers(queue), self.keys.reaped(queue)],
            [TOMBSTONE_PAGE, TOMBSTONE_KEEP_MS, tombstone_offset],
        )
        ids, count = [_consumer_id(item) for item in out[:-2]], int(out[-1])
        split = ids.index("")
        expired = [cid for cid in ids[:split] if cid]
        tombstones = list(dict.fromkeys(cid for cid in ids[split + 1 :] if cid))
        if tombstones:
            pipe = self.client.pipeline(transaction=False)
            for consumer_id in tombstones:
                pipe.llen(self.keys.processing(queue, consumer_id))
            lengths = pipe.execute()
            tombstones = [cid for cid, length in zip(tombstones, lengths, strict=True) if length]
        next_offset = tombstone_offset + TOMBSTONE_PAGE
        return expired, tombstones, next_offset if next_offset < count else 0

    def reap(
        self, queue: str, consumer_id: str, default_lease_ms: int, *, own_earlier_run: bool = False
    ) -> ReapOutcome:
        """Return a dead consumer's tasks to the suspects list (at most REAP_BATCH per call).

        With `own_earlier_run`, the caller is registering under `consumer_id`: what an earlier
        run under that id left is recovered like a dead consumer's, whatever its lease says.
        """
        keys = [
            self.keys.consumers(queue),
            self.keys.consumer_info(queue),
            self.keys.reaped(queue),
            self.keys.processing(queue, consumer_id),
            self.keys.pending(queue),
            self.keys.dead(queue),
            self.keys.recoveries(queue),
            self.keys.suspects(queue),
            self.keys.primary(queue),
        ]
        args = [consumer_id, MAX_RECOVERIES, REAP_BATCH, WAKE_TOKEN, default_lease_ms, "1" if own_earlier_run else "0"]
        out = self._script("reap", keys, args)
        return ReapOutcome(status=int(out[0]), requeued=int(out[1]), remaining=int(out[2]), dead_lettered=list(out[3:]))

    # --- inspection and admin --------------------------------------------------------------
    def completed_last_minute(self, queue: str) -> int:
        """Count the tasks of `queue` acknowledged in the last minute (whole buckets: 50-60 s)."""
        current = int(time.time()) // THROUGHPUT_BUCKET_S
        buckets = range(current - 60 // THROUGHPUT_BUCKET_S + 1, current + 1)
        counts = self.client.mget([self.keys.completed(queue, bucket) for bucket in buckets])
        return sum(int(count) for count in counts if count is not None)

    def known_queues(self) -> list[str]:
        """Return every queue that has seen a task or a consumer."""
        members = self.client.smembers(self.keys.queues())
        return sorted(member.decode(errors="backslashreplace") for member in members)  # may hold any bytes

    def live_consumers(self, queue: str) -> list[dict[str, Any]]:
        """Return the consumers holding a lease on `queue`, with their info and in-flight count."""
        entries = self.client.zrange(self.keys.consumers(queue), 0, -1, withscores=True)
        if not entries:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.consumer_info(queue))
        for member, _ in entries:
            pipe.llen(self.keys.processing(queue, member.decode(errors="backslashreplace")))
        info_raw, *lengths = pipe.execute()
        infos = {key.decode(errors="backslashreplace"): _json_object(value) for key, value in info_raw.items()}
        consumers = []
        for (member, deadline_ms), in_flight in zip(entries, lengths, strict=True):
            consumer_id = member.decode(errors="backslashreplace")
            info = infos.get(consumer_id, {})
            consumers.append({**info, "id": consumer_id, "lease_deadline_ms": int(deadline_ms), "in_flight": in_flight})
        return consumers

    def queue_stats(self, queue: str) -> QueueStats:
        """Count pending, in-flight, delayed and dead tasks of a queue, and list its consumers."""
        consumers = self.live_consumers(queue)
        tombstones = self._tombstones(queue)
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(self.keys.pending(queue))
        # A wake token is not a task; there is at most one, near the head of pending.
        pipe.lpos(self.keys.pending(queue), WAKE_TOKEN, rank=-1, maxlen=16)
        pipe.zcard(self.keys.prioritized(queue))
        pipe.llen(self.keys.suspects(queue))
        pipe.zcard(self.keys.delayed(queue))
        pipe.zcard(self.keys.dead(queue))
        for consumer_id in tombstones:
            pipe.llen(self.keys.processing(queue, consumer_id))
        pending, wake_token_at, prioritized, suspects, delayed, dead, *orphaned = pipe.execute()
        pending -= wake_token_at is not None
        processing = sum(c["in_flight"] for c in consumers) + sum(orphaned)
        return QueueStats(queue, pending + prioritized + suspects, processing, delayed, dead, consumers)

    def _tombstones(self, queue: str) -> list[str]:
        return [cid for cid in map(_consumer_id, self.client.zrange(self.keys.reaped(queue), 0, -1)) if cid]

    def is_idle(self, queues: Sequence[str]) -> bool:
        """True when none of `queues` has anything pending, in flight or delayed."""
        for queue in queues:
            stats = self.queue_stats(queue)
            if stats.pending or stats.processing or stats.delayed:
                return False
        return True

    def list_dead(self, queue: str, offset: int = 0, limit: int = 100) -> list[tuple[bytes, int]]:
        """Return dead-lettered tasks of a queue, newest first, with the time (ms) they died."""
        entries = self.client.zrange(self.keys.dead(queue), offset, offset + limit - 1, desc=True, withscores=True)
        return [(member, int(score)) for member, score in entries]

    def requeue_dead(self, queue: str, entries: Sequence[tuple[bytes, int, bytes]]) -> int:
        """Move dead tasks (stored member, priority, task to push) back to pending or prioritized."""
        if not entries:
            return 0
        args: list[Any] = [WAKE_TOKEN]
        for member, priority, fresh in entries:
            args.extend([member, priority, fresh])
        keys = [self.keys.dead(queue), self.keys.pending(queue), self.keys.prioritized(queue)]
        return int(self._script("requeue_dead", keys, args))

    def trim_dead(self, queue: str, max_count: int, max_age_s: int) -> int:
        """Drop the oldest dead letters beyond `max_count` and those older than `max_age_s`."""
        return int(self._script("trim_dead", [self.keys.dead(queue)], [max_count, max_age_s * 1000]))

    def delete_dead(self, queue: str, members: Sequence[bytes]) -> int:
        """Delete dead-lettered tasks for good; return how many were deleted."""
        return int(self.client.zrem(self.keys.dead(queue), *members)) if members else 0

    def server_time_ms(self) -> int:
        """Return the Redis server's clock in milliseconds."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def ping(self) -> bool:
        """Return True if Redis answers."""
        return bool(self.client.ping())

    def serves_every_slot(self) -> bool:
        """False while a Redis Cluster reports a slot unserved (a failover under way); True on a single server."""
        if not isinstance(self.client, redis.RedisCluster):
            return True
        # With several target nodes redis-py answers one parsed CLUSTER INFO per node.
        replies = cast(dict[Any, dict[str, Any]], self.client.cluster_info(target_nodes=redis.RedisCluster.PRIMARIES))
        return all(info.get("cluster_state") == "ok" for info in replies.values())


def _json_object(raw: bytes) -> dict[str, Any]:
    """Parse a consumer's info; anything but a JSON object (written by something else) reads as empty."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ResultUpdate:
    """Fields to set on a task's result record, and items to append to its JSON lists."""

    task_id: str
    fields: dict[str, str]
    ttl_s: int
    append_worker_id: str | None = None
    append_error: dict[str, str] | None = None
    # Fencing token of the run this update belongs to (0: not of a run, written unconditionally);
    # ignored once a run with a higher token wrote to the record.
    fence: int = 0


def _consumer_id(member: bytes) -> str:
    # A member no consumer of ours could have written (not UTF-8, or not a valid name) is skipped:
    # no key can be built from it, and reaping it must not stop the reaper.
    try:
        consumer_id = member.decode()
    except UnicodeDecodeError:
        return ""
    return consumer_id if _VALID_ID.fullmatch(consumer_id) else ""


_VALID_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
_brokers: dict[tuple[str, bool, str], Broker] = {}


def get_broker() -> Broker:
    """Return the process-wide broker for the current settings (created on first use)."""
    from django.conf import settings

    key = (settings.REDIS_URL, settings.REDIS_CLUSTER, settings.TASKS_KEY_PREFIX)
    broker = _brokers.get(key)
    if broker is None:
        broker = _brokers.setdefault(key, Broker.from_settings())
    return broker
