"""Redis Cluster result writes: each master that took a flush's results WAITs for a replica before the acks."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait as wait_for
from typing import Any, NamedTuple

import redis
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

from tasks_app.protocol import history
from tasks_app.protocol.minutes import KEEP_MINUTES, MinuteOps, counter_fields
from tasks_app.protocol.replies import ResultUpdate

# Redis Cluster: how long a master's WAIT for one replica to have a flush's results may take
# (TASKS_CLUSTER_WAIT_MS), and how often each master's replica count is read again.
CLUSTER_WAIT_MS = 100

REPLICA_CHECK_S = 10.0

# At most how many records one record_result call writes (on one server): a call holds Redis
# for its whole length.
RECORDS_PER_CALL = 128


class Held(NamedTuple):
    """The condition of a run's record write (one server only): the settling consumer still holds its task."""

    processing: str  # its processing list
    consumer_info: str  # its queue's consumer info hash, where no other instance may have registered it
    raw: bytes
    consumer_id: str
    instance: str
    consumers: str = ""  # its queue's consumers zset: while the id is there, it was not reaped

    @property
    def settler(self) -> tuple[str, str, str, str, str]:
        """What the check reads besides the task: its three keys (list, consumer info, consumers), id and instance."""
        return self.processing, self.consumer_info, self.consumers, self.consumer_id, self.instance


class Place(NamedTuple):
    """Where a result write's reply is: the position of its call in a pipeline, its index in that call's reply."""

    position: int
    offset: int


def _raising_the_first_failure(replies: list[Any]) -> list[Any]:
    """The replies, unless one is an error: then raise it."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def replies_at(sent: Sequence[Any], places: Sequence[Place]) -> list[Any]:
    """Each result write's reply: 1, 0, 2 or its error (the error of its whole call, if that failed)."""
    return [
        sent[place.position] if isinstance(sent[place.position], Exception) else sent[place.position][place.offset]
        for place in places
    ]


# What record_result answers for a held write whose task the consumer no longer holds (not written).
NOT_HELD = 3
# What record_result answers for a write the record already holds (sent again after a lost reply).
WRITTEN_AGAIN = 4

# Replies of a master that is failing over, moved a slot or was demoted: write the results again.
_NODE_STATE_REPLIES = (AskError, ClusterDownError, TryAgainError, ReadOnlyError, BusyLoadingError)


class ReplicatedWrites(MinuteOps):
    """Writes results on each master and waits for one of its replicas to have them."""

    cluster_wait_ms: int
    _replica_checks: dict[str, tuple[bool, float]]
    _masters_pool: ThreadPoolExecutor | None
    _masters_with_scripts: set[str]
    instance: str

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
            places = self._queue_results(pipe, [updates[index] for index in todo], by_source=by_source)
            if waits:
                pipe.execute_command("WAIT", 1, self.cluster_wait_ms)
            sent = self._execute_on_master(node, pipe, waits)
            timed_out = 1 if waits and int(sent[-1]) < 1 else timed_out
            for index, reply in zip(todo, replies_at(sent, places), strict=True):
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

    def _queue_results(
        self, pipe: Any, updates: Sequence[ResultUpdate], *, by_source: bool = False, holds: Sequence[Held | None] = ()
    ) -> list[Place]:
        """Queue the record_result calls of `updates`; return where each one's reply will be.

        On one server a call writes up to RECORDS_PER_CALL records of one queue and files their
        tasks in its history (see history.py), each only while its hold (beside it in `holds`, if
        given) holds; on Redis Cluster a call writes one record.
        """
        places: list[Place] = [Place(0, 0)] * len(updates)
        for queue, indexes in self._result_groups(updates):
            for start in range(0, len(indexes), RECORDS_PER_CALL):
                chunk = indexes[start : start + RECORDS_PER_CALL]
                for offset, index in enumerate(chunk):
                    places[index] = Place(len(pipe), offset)
                chunk_holds = [holds[index] for index in chunk] if holds else []
                self._queue_record_call(pipe, queue, [updates[index] for index in chunk], by_source, chunk_holds)
        return places

    def _result_groups(self, updates: Sequence[ResultUpdate]) -> list[tuple[str, list[int]]]:
        """The updates' indexes by the queue whose history their call files them in ("": none).

        Every update of a run carries its queue, so the writes of one task keep their order.
        """
        if isinstance(self.client, redis.RedisCluster):
            return [("", [index]) for index in range(len(updates))]
        groups: dict[str, list[int]] = {}
        for index, update in enumerate(updates):
            groups.setdefault(update.queue, []).append(index)
        return list(groups.items())

    def _queue_record_call(
        self, pipe: Any, queue: str, updates: Sequence[ResultUpdate], by_source: bool, holds: Sequence[Held | None]
    ) -> None:
        """Queue one record_result call; given a queue (one server), it files and counts the writes it takes."""
        keys: list[str] = []
        args: list[Any] = [0]
        if queue:
            keys = [*history.index_keys(self.keys, queue), self.keys.minute(queue, int(time.time()) // 60)]
            args = [len(history.STATUSES), *history.STATUSES, KEEP_MINUTES * 60]
        lists = {hold.settler: 0 for hold in holds if hold is not None}
        args.append(len(lists))
        for number, settler in enumerate(lists, start=1):
            lists[settler] = number
            keys += settler[:3]
            args += settler[3:]
        for update, hold in zip(updates, holds or [None] * len(updates), strict=True):
            if lists:
                args += (0, "") if hold is None else (lists[hold.settler], hold.raw)
            keys.append(self.keys.result(update.task_id))
            args += (
                update.ttl_s,
                update.append_worker_id or "",
                json.dumps(update.append_error) if update.append_error else "",
                update.fence or "",
                update.task_id,
            )
            if queue:
                counted = counter_fields(update)
                args += (len(counted), *counted)
            args.append(len(update.fields))
            for name, value in update.fields.items():
                args += (name, value)
        self.scripts.queue(pipe, "record_result", keys, args, by_source=by_source)

    def _holds(self, updates: Sequence[ResultUpdate]) -> list[Held | None]:
        """The hold of each update (None: not held), the keys of each processing list built once."""
        owners: dict[tuple[str, str], Held] = {}
        holds: list[Held | None] = []
        for update in updates:
            if update.held_by is None:
                holds.append(None)
                continue
            owner, raw = update.held_by
            of_owner = owners.get(owner) or owners.setdefault(owner, self._held(owner, raw))
            keys = (of_owner.processing, of_owner.consumer_info)
            holds.append(Held(*keys, raw, of_owner.consumer_id, of_owner.instance, of_owner.consumers))
        return holds

    def _held(self, owner: tuple[str, str], raw: bytes) -> Held:
        """The hold of a write of the run that settles `raw` from the processing list of `owner`."""
        queue, consumer_id = owner
        keys = self.keys
        return Held(
            keys.processing(queue, consumer_id),
            keys.consumer_info(queue),
            raw,
            consumer_id,
            self.instance,
            keys.consumers(queue),
        )

    def _acked(
        self, raws_by_owner: Mapping[tuple[str, str], Sequence[bytes]], flags: dict[Any, list[bool]]
    ) -> set[Held]:
        """The tasks an ack found, as the holds of their runs' writes."""
        return {
            self._held(owner, raw)
            for owner, raws in raws_by_owner.items()
            for raw, flag in zip(raws, flags[owner], strict=True)
            if flag
        }

    def _write_again_settled(
        self, updates: Sequence[ResultUpdate], holds: Sequence[Held | None], written: list[Any], settled: set[Held]
    ) -> None:
        """Write again, unheld, each held write answered NOT_HELD whose task the script after it settled.

        A held write goes before its task's settle script in one MULTI: one whose task was reaped
        (or whose consumer id another instance took) writes nothing, answered NOT_HELD, and the
        script finds nothing either. A write answered so while the script settled its task ran
        after it, re-run by source after a NOSCRIPT (an ack batch runs by SHA, not to send the
        source every flush): the script found the task, so the run held it. Only then does this
        take a round trip. Fills in the new replies in `written`.
        """
        again = [i for i, hold in enumerate(holds) if hold in settled and written[i] == NOT_HELD]
        if not again:
            return
        pipe = self.client.pipeline(transaction=False)
        places = self._queue_results(pipe, [updates[index] for index in again])
        sent = self.scripts.execute(pipe, self.client, raise_on_error=False)
        for index, reply in zip(again, replies_at(sent, places), strict=True):
            written[index] = reply

    def _with_results(self, first: Any, updates: Sequence[ResultUpdate]) -> list[Any]:
        """One round trip: what `first` queues, the result writes, then their side writes; raises the first failure."""
        pipe = self.client.pipeline(transaction=False)
        first(pipe)
        firsts = len(pipe)
        sent, written = self._execute_with_results(pipe, updates, self._queue_results(pipe, updates))
        return _raising_the_first_failure([*sent[:firsts], *written])

    def record_results_replicated(self, updates: Sequence[ResultUpdate]) -> tuple[list[Any], int]:
        """Redis Cluster: write records that a push about to follow relies on; return each write's reply
        (its error, if Redis refused it: it stops no other) and how many masters' replica WAITs timed out.

        Each master that takes some WAITs for a replica to have them, as before acks: a failover after
        the push cannot bring back the records they replace.
        """
        written, unreplicated = self._write_results_replicated(updates)
        _, written = self._execute_with_results(self.client.pipeline(transaction=False), updates, [], written)
        return written, unreplicated

    def _execute_with_results(
        self, pipe: Any, updates: Sequence[ResultUpdate], places: Sequence[Place], earlier: Sequence[Any] = ()
    ) -> tuple[list[Any], list[Any]]:
        """Queue the Redis Cluster side writes of `updates` and execute `pipe`. Returns every reply of
        `pipe`, and each update's (`earlier`: the replies of updates written before, all of them)."""
        cluster = isinstance(self.client, redis.RedisCluster)
        minute = int(time.time()) // 60
        if cluster:
            self._queue_cluster_side_writes(pipe, updates, earlier, minute)
        sent = self.scripts.execute(pipe, self.client, raise_on_error=False)
        written = [*earlier, *replies_at(sent, places)]
        if cluster and not earlier:
            self._uncount_unwritten(updates, written, minute)
        return sent, written

    def _queue_cluster_side_writes(
        self, pipe: Any, updates: Sequence[ResultUpdate], earlier: Sequence[Any], minute: int
    ) -> None:
        """Queue, last in a pipeline, what a Redis Cluster record write cannot do itself (the record lies in a
        slot of its own): the history moves and the chart counts, of the writes the records took when their
        replies are in (a move also of a write sent again); else of all of them, and the counts of writes
        not taken are taken back after."""
        moved = updates
        if earlier:
            moved = [update for update, reply in zip(updates, earlier, strict=True) if reply in (1, WRITTEN_AGAIN)]
            updates = [update for update, reply in zip(updates, earlier, strict=True) if reply == 1]
        for update in moved:
            if history.indexed(update):
                keys = history.index_keys(self.keys, update.queue)
                self.scripts.queue(pipe, "history_move", keys, history.move_args(update))
        self._queue_minute_counts(pipe, updates, minute)
