"""The queue core: claim, ack, retry, dead-letter, return unstarted tasks, promote due ones (docs/PROTOCOL.md).

Each queue script touches one Redis Cluster slot (the queue's hash tag); a settle's result record,
in another, is written by `Records` in the same round trip.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks_app.protocol.history import NOT_HELD, Place, Records, replies_at
from tasks_app.protocol.keys import UNDECODABLE_TYPE, WAKE_TOKEN, delayed_member
from tasks_app.protocol.records import ResultUpdate
from tasks_app.protocol.scripts import Role, ScriptClient
from tasks_app.protocol.tracking import server_options

PROMOTE_DUE_KEYS = "delayed pending prioritized recoveries suspects dead"
# Width of the buckets counting acknowledged tasks, for the dashboard's throughput.
THROUGHPUT_BUCKET_S = 10
# Longest blocking claim on a connection that can be cut short, and the margin of its socket's timeout.
LONGEST_WAIT_S, SOCKET_MARGIN_S = 30.0, 5.0


class WaitConnection:
    """A connection of its own for one thread's blocking claims, which another thread cuts short (`interrupt`).

    A wait that can be ended at once may be long, so an idle consumer sends few commands and still stops at once.
    """

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        options = {**server_options(pool.connection_kwargs), "connection_class": pool.connection_class}
        self._control = client
        self._client_id: int | None = None
        # No retry inside redis-py: a blocking move re-sent after a lost reply would move a second task.
        own = {"max_connections": 1, "redis_connect_func": self._connected, "retry": Retry(NoBackoff(), 0)}
        own["socket_timeout"] = LONGEST_WAIT_S + SOCKET_MARGIN_S
        self.client = redis.Redis(connection_pool=redis.ConnectionPool(**{**options, **own}))

    def _connected(self, connection: Any) -> None:
        connection.on_connect()
        connection.send_command("CLIENT", "ID")
        self._client_id = int(connection.read_response())

    def interrupt(self) -> None:
        """End the blocking call in progress, if any, as its timeout would."""
        if self._client_id is not None:
            with contextlib.suppress(redis.RedisError):
                self._control.client_unblock(self._client_id)

    def close(self) -> None:
        self.client.connection_pool.disconnect()


@dataclass(frozen=True)
class Claim:
    """What one claim moved into a consumer's processing list."""

    tasks: list[bytes]
    took_suspect: bool  # the first task is a suspect: recovered from a dead consumer
    suspects_waiting: int  # suspects still in the queue's suspects list
    first_fence: int = 0  # fencing token of tasks[0]; tasks[i] holds first_fence + i
    lease_expired: bool = False  # nothing claimed: the lease lapsed
    paused: bool = False  # nothing claimed: the queue is paused


# What claim_staged answers for an envelope whose id it could not read: its receipt is left to claim_receipts.
RECEIPT_UNREAD = -2


class BlockingClaim(NamedTuple):
    """What one blocking claim took: a task (with its fence, and its receipt when written), a wake token, or None."""

    raw: bytes | None
    fence: int = 0
    receipt: int | None = None  # claim_receipts' answer, if the claim wrote it; None: the caller writes it
    queue_open: bool = False  # the claim saw its queue not paused


class Promotion(NamedTuple):
    """What one promote_due call did."""

    moved: int
    next_due_ms: int  # -1: nothing delayed
    now_ms: int  # the server's clock
    malformed: int  # due members that were not "<priority><task>", dead-lettered


class UniqueRelease(NamedTuple):
    """A uniqueness key that settling a claimed task frees (unique_until = finished), if the task is still held."""

    digest: str
    task_id: str
    after_ms: int = 0  # 0: now; else in that many ms (a hung run's key, once its process is gone)


class AckReport(NamedTuple):
    """What a batch of result writes and acks did."""

    flags: dict[tuple[str, str], list[bool]]  # per (queue, consumer): whether each task was still held
    refused: dict[int, Exception]  # result writes Redis refused, by index
    unreplicated_masters: int = 0  # Redis Cluster: masters whose replica did not confirm the results in time
    written: tuple[Any, ...] = ()  # each result write's reply (1 written, 0 ignored, 2 refused: cancelled, 3 not held)


class Queue(Role):
    """Claiming and settling tasks of a queue, each one round trip or one script."""

    def __init__(self, redis: ScriptClient, records: Records) -> None:
        super().__init__(redis)
        self.records = records
        # The token its consumer registers its ids with ("": unchecked): settling a task of an id another
        # instance registered since settles nothing (see lua/include/settle.lua).
        self.instance = ""

    def claim(self, queue: str, consumer_id: str, max_tasks: int, *, drop_wake: bool = False) -> list[bytes] | None:
        """Move up to `max_tasks` (no suspect) into this consumer's list; None if its lease was lost."""
        claimed = self.claim_with_suspect(queue, consumer_id, max_tasks, drop_wake=drop_wake, allow_suspect=False)
        return None if claimed is None else claimed.tasks

    def claim_with_suspect(
        self, queue: str, consumer_id: str, max_tasks: int, *, drop_wake: bool = False, allow_suspect: bool = True
    ) -> Claim | None:
        """Like `claim`, first taking one suspect if allowed; nothing claimed, saying why, if lapsed or paused."""
        names = "pending prioritized processing consumers suspects fence paused"
        keys = self.keys.queue_keys(queue, names, consumer_id)
        args = [consumer_id, max_tasks, WAKE_TOKEN, "1" if drop_wake else "0", "1" if allow_suspect else "0"]
        claimed = self.redis.run("claim", keys, args)
        if claimed is None:
            return None
        took_suspect, suspects_waiting, first_fence, *tasks = claimed
        if took_suspect == -1:
            return Claim([], False, 0, lease_expired=True)
        if took_suspect == -2:
            return Claim([], False, 0, paused=True)
        return Claim(tasks, bool(took_suspect), int(suspects_waiting), int(first_fence))

    def mark_started(self, queue: str, consumer_id: str, raw: bytes) -> bool:
        """Record that a suspect task starts (a death then counts); False if the lease lapsed or the id was taken."""
        keys = self.keys.queue_keys(queue, "consumers consumer_info recoveries")
        return bool(self.redis.run("mark_started", keys, [consumer_id, self.instance, hashlib.sha1(raw).hexdigest()]))

    def claim_blocking(self, queue: str, consumer_id: str, timeout_s: float, result_ttl_s: int) -> BlockingClaim:
        """Block until a task moves from pending to this consumer; with one server, its receipt written too."""
        pending, processing = self.keys.pending(queue), self.keys.processing(queue, consumer_id)
        client: Any = self.client
        if isinstance(self.client, redis.RedisCluster):  # its pipelines retry on their own: two calls
            moved = client.blmove(pending, processing, timeout_s, "RIGHT", "LEFT")
            fence = 0 if moved is None or moved == WAKE_TOKEN else self.issue_fence(queue)
            return BlockingClaim(moved, fence)
        # One round trip: the script after the move runs as soon as it returns (see lua/claim_staged.lua).
        staging = self.keys.staging(queue, consumer_id)
        pipe = client.pipeline(transaction=False)
        pipe.blmove(pending, staging, timeout_s, "RIGHT", "LEFT")
        args = [self.keys.prefix, result_ttl_s, WAKE_TOKEN, queue]
        keys = [staging, processing, self.keys.fence(queue), self.keys.paused(queue)]
        self.scripts.queue(pipe, "claim_staged", keys, args)
        _, staged = self.scripts.execute(pipe, client)
        if not staged or staged[0] == WAKE_TOKEN:
            return BlockingClaim(staged[0] if staged else None)
        raw, fence, receipt, queue_open = staged
        return BlockingClaim(raw, int(fence), None if receipt == RECEIPT_UNREAD else int(receipt), bool(queue_open))

    def issue_fence(self, queue: str) -> int:
        """Issue one fencing token of `queue`: higher than every token issued before it."""
        return int(self.redis.run("issue_fence", [self.keys.fence(queue)], [1]))

    def claim_receipts(
        self, claims: Sequence[tuple[str, int]], result_ttl_s: int, named: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        """Write claimed (id, fence)s' receipts, drop their marks: 1 or 3 held, 0 superseded, 2 cancelled."""
        # `named`: each task's (queue, type), written to a record the receipt creates.
        named = named or [("", "")] * len(claims)
        marks = [self.keys.waiting_mark(task_id) for task_id, _ in claims]
        keys = [self.keys.result(task_id) for task_id, _ in claims]
        if not isinstance(self.client, redis.RedisCluster):
            args: list[Any] = [result_ttl_s, 1]
            for (_, token), (_, mark), (queue, task_type) in zip(claims, marks, named, strict=True):
                args += (token, mark, queue, task_type)
            replies = self.redis.run("claim_receipts", [*keys, *(bucket for bucket, _ in marks)], args)
            return [int(reply) for reply in replies]
        # Redis Cluster: a call per record (its own slot), the marks dropped in the same round trip.
        pipe = self.client.pipeline(transaction=False)
        for key, (_, token), (queue, task_type) in zip(keys, claims, named, strict=True):
            self.scripts.queue(pipe, "claim_receipts", [key], [result_ttl_s, 0, token, "", queue, task_type])
        for bucket, mark in marks:
            pipe.hdel(bucket, mark)
        replies = self.scripts.execute(pipe, self.client)
        return [int(reply[0]) for reply in replies[: len(keys)]]

    def ack(
        self,
        queue: str,
        consumer_id: str,
        raws: Sequence[bytes],
        results: Sequence[ResultUpdate] = (),
        releases: Sequence[UniqueRelease | None] = (),
    ) -> list[bool]:
        """Record results, then acknowledge tasks, in one round trip; flags say which were still held."""
        owner = (queue, consumer_id)
        if len(raws) == 1:
            results = [replace(result, held_by=result.held_by or (owner, raws[0])) for result in results]
        report = self.ack_many_reporting(results, {owner: raws}, releases={owner: releases})
        if report.refused:
            raise next(iter(report.refused.values()))
        return report.flags[owner]

    def ack_many_reporting(
        self,
        results: Sequence[ResultUpdate],
        raws_by_owner: Mapping[tuple[str, str], Sequence[bytes]],
        releases: Mapping[tuple[str, str], Sequence[UniqueRelease | None]] | None = None,
    ) -> AckReport:
        """Record results, then acknowledge the tasks of each (queue, consumer) list; report what each write did."""
        acks = [self._ack_call(owner, raws, (releases or {}).get(owner, ())) for owner, raws in raws_by_owner.items()]
        flags, written, unreplicated = self._settle(results, raws_by_owner, acks)
        refused = {index: outcome for index, outcome in enumerate(written) if isinstance(outcome, Exception)}
        return AckReport(flags, refused, unreplicated, tuple(written))

    def _settle(
        self,
        results: Sequence[ResultUpdate],
        raws_by_owner: Mapping[tuple[str, str], Sequence[bytes]],
        settles: Sequence[tuple[str, list[str], list[Any]]],
    ) -> tuple[dict[tuple[str, str], list[bool]], list[Any], int]:
        """Write `results`, then settle (a call per owner): per owner held flags, each write's reply, unreplicated."""
        # One server: one MULTI, results first, each `held_by` write only if the settle after it finds the task.
        # Redis Cluster: the results go first, each master WAITing for a replica, then the settles.
        cluster = isinstance(self.client, redis.RedisCluster)
        pipe = self.client.pipeline(transaction=not cluster)
        written: list[Any] = []
        places: list[Place] = []
        unreplicated = 0
        if cluster and results and raws_by_owner:
            written, unreplicated = self.records.write_on_masters(results)
        else:
            places = self.records.queue_writes(pipe, results, instance=None if cluster else self.instance)
        calls = len(pipe)
        for name, keys, args in settles:
            self.scripts.queue(pipe, name, keys, args)
        sent, written = self.records.execute_with_writes(pipe, results, places, written)
        outcomes = sent[calls : calls + len(raws_by_owner)]
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        flags = {
            owner: [bool(flag) for flag in (outcome if isinstance(outcome, list) else [outcome])]
            for owner, outcome in zip(raws_by_owner, outcomes, strict=True)
        }
        if not cluster and NOT_HELD in written:
            self._write_again_settled(results, written, raws_by_owner, flags)
        return flags, written, unreplicated

    def _ack_call(
        self, owner: tuple[str, str], raws: Sequence[bytes], releases: Sequence[UniqueRelease | None]
    ) -> tuple[str, list[str], list[Any]]:
        """The ack of one processing list's tasks, with the uniqueness keys their ends free."""
        queue, consumer_id = owner
        bucket = int(time.time()) // THROUGHPUT_BUCKET_S
        keys = [
            self.keys.processing(queue, consumer_id),
            self.keys.recoveries(queue),
            self.keys.completed(queue, bucket),
            self.keys.consumer_info(queue),
        ]
        args: list[Any] = [len(raws), consumer_id, self.instance, *raws]
        for position, release in enumerate(releases, start=1):
            if release is not None:
                keys.append(self.keys.unique(queue, release.digest))
                args += (position, release.task_id, release.after_ms)
        return "ack", keys, args

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
        keys = self.keys.queue_keys(queue, "processing delayed recoveries consumer_info", consumer_id)
        args = [raw, delayed_member(priority, new_raw), max(0, int(delay_ms)), consumer_id, self.instance]
        return self._with_result("retry_later", (queue, consumer_id), raw, keys, args, result)

    def dead_letter(
        self,
        queue: str,
        consumer_id: str,
        raw: bytes,
        new_raw: bytes,
        result: ResultUpdate | None = None,
        release: UniqueRelease | None = None,
    ) -> bool:
        """Move a claimed task to the dead-letter set (freeing `release` with it); False if it was lost."""
        keys = self.keys.queue_keys(queue, "processing dead recoveries consumer_info", consumer_id)
        args: list[Any] = [raw, new_raw, consumer_id, self.instance]
        if release is not None:
            keys.append(self.keys.unique(queue, release.digest))
            args += (release.task_id, release.after_ms)
        return self._with_result("dead_letter", (queue, consumer_id), raw, keys, args, result)

    def _with_result(
        self,
        script: str,
        owner: tuple[str, str],
        raw: bytes,
        keys: list[str],
        args: list[Any],
        result: ResultUpdate | None,
    ) -> bool:
        """Run settle script `script` on task `raw` of `owner`'s list, writing its run's record as an ack does."""
        if result is None:
            return bool(self.redis.run(script, keys, args))
        update = replace(result, held_by=(owner, raw))
        flags, written, _ = self._settle([update], {owner: [raw]}, [(script, keys, args)])
        for reply in written:
            if isinstance(reply, Exception):
                raise reply
        return flags[owner][0]

    def held_by(self, queue: str, consumer_id: str) -> list[bytes]:
        """Return the tasks in a consumer's processing list."""
        return list(self.client.lrange(self.keys.processing(queue, consumer_id), 0, -1))

    def held_and_staged(self, queue: str, consumer_id: str) -> tuple[list[bytes], list[bytes]]:
        """The tasks in a consumer's processing list, and those in its staging list, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.lrange(self.keys.processing(queue, consumer_id), 0, -1)
        pipe.lrange(self.keys.staging(queue, consumer_id), 0, -1)
        held, staged = pipe.execute()
        return list(held), list(staged)

    def return_unstarted(
        self,
        queue: str,
        consumer_id: str,
        raws: Sequence[bytes],
        withdrawn: Sequence[ResultUpdate] = (),
        *,
        staged: bool = False,
    ) -> int:
        """Put claimed, never-started tasks back first among their priority; return how many were held."""
        # `withdrawn`: their claims' receipts, withdrawn in the same round trip so a cancel cancels them outright.
        # `staged`: tasks in the staging list (see claim_blocking) rather than the processing list.
        if not raws:
            return 0
        names = f"{'staging' if staged else 'processing'} pending recoveries suspects consumer_info prioritized"
        keys = self.keys.queue_keys(queue, names, consumer_id)
        args = [consumer_id, self.instance, WAKE_TOKEN, *raws]
        pipe = self.client.pipeline(transaction=False)
        self.scripts.queue(pipe, "return_unstarted", keys, args)
        sent, _ = self.records.execute_with_writes(pipe, withdrawn, self.records.queue_writes(pipe, withdrawn))
        if isinstance(sent[0], Exception):
            raise sent[0]
        return int(sent[0])

    def promote_due(self, queue: str, limit: int = 1000) -> Promotion:
        """Move due delayed tasks into pending, and dead-letter due members that are not tasks."""
        keys = self.keys.queue_keys(queue, PROMOTE_DUE_KEYS)
        moved, next_due_ms, now_ms, malformed = self.redis.run(
            "promote_due", keys, [limit, WAKE_TOKEN, queue, UNDECODABLE_TYPE]
        )
        return Promotion(int(moved), int(next_due_ms), int(now_ms), int(malformed))

    def _write_again_settled(
        self,
        updates: Sequence[ResultUpdate],
        written: list[Any],
        raws_by_owner: Mapping[tuple[str, str], Sequence[bytes]],
        flags: Mapping[tuple[str, str], list[bool]],
    ) -> None:
        """Write again, unheld, each held write answered NOT_HELD whose task the script after it settled."""
        # A held write re-run by source after a NOSCRIPT runs after its settle script, which took the task:
        # the run held it.
        settled = {
            (owner, raw)
            for owner, raws in raws_by_owner.items()
            for raw, took in zip(raws, flags[owner], strict=True)
            if took
        }
        again = [i for i, update in enumerate(updates) if update.held_by in settled and written[i] == NOT_HELD]
        if not again:
            return
        pipe = self.client.pipeline(transaction=False)
        places = self.records.queue_writes(pipe, [updates[index] for index in again])
        sent = self.scripts.execute(pipe, self.client, raise_on_error=False)
        for index, reply in zip(again, replies_at(sent, places), strict=True):
            written[index] = reply
