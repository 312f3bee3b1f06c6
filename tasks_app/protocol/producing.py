"""Producing: `ProducingOps`, mixed into `Broker`, pushes tasks, their READY records and unique tasks.

Two of its scripts (`enqueue_batch` with many queues or records, `enqueue_one`) span slots on a
single server; on a Redis Cluster each call of `enqueue_batch` holds one queue or one record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from tasks_app.protocol import batch_args, history
from tasks_app.protocol.batch_args import ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, Enqueueable
from tasks_app.protocol.cluster_enqueue import ClusterEnqueueOps
from tasks_app.protocol.control import UniqueEnqueueable
from tasks_app.protocol.keys import WAKE_TOKEN


class ProducingOps(ClusterEnqueueOps):
    """Enqueueing, all or nothing on a single Redis server."""

    def enqueue(
        self, items: Sequence[Enqueueable], result_ttl_s: int, uniques: Sequence[UniqueEnqueueable] = ()
    ) -> list[str | None]:
        """Write each task's READY record (kept result_ttl_s past its due time) and push the tasks,
        and the `uniques` as `enqueue_unique` does. Per task of `items`, then of `uniques`: None
        (pushed), or the id of the task enqueued in its place, nothing pushed nor written for it:
        its own, for a caller's id enqueued to its queue lately or earlier in the call, or whose
        record names another queue; the holder of its key, for a unique one.

        On a single Redis server all or nothing (see `_enqueue_on_server`). On Redis Cluster one
        call per queue and per record (see `ClusterEnqueueOps`): some may be pushed when an error is raised.
        """
        if not uniques and len(items) == 1 and self._enqueue_one(items[0], result_ttl_s):
            return [None]
        new_queues = self._announced_queues.missing(item.queue for item in items)
        if isinstance(self.client, redis.RedisCluster):
            outcomes = self._enqueue_on_cluster(items, uniques, result_ttl_s, new_queues)
        else:
            outcomes = self._enqueue_on_server(items, result_ttl_s, new_queues, uniques)
        self._announced_queues.add(new_queues)
        return outcomes

    def _enqueue_on_server(
        self,
        items: Sequence[Enqueueable],
        result_ttl_s: int,
        new_queues: set[str],
        uniques: Sequence[UniqueEnqueueable],
    ) -> list[str | None]:
        # One enqueue_batch call, atomic on its own. Plain tasks are cheaper as native LPUSHes
        # (no copy into Lua), and unique tasks need a script each: then the LPUSHes and the
        # scripts (the first of each by source, so NOSCRIPT cannot split them) run in
        # MULTI/EXEC, which Redis refuses whole when it is out of memory.
        sections, keys, args = self._batch_call(items, result_ttl_s, new_queues)
        others_at = [position for section in sections.values() for position in section.others_at]
        if not uniques and not any(section.plain for section in sections.values()):
            missed = batch_args.not_pushed(self._script("enqueue_batch", keys, args), others_at)
            return _in_place(items, missed)
        pipe = self.client.pipeline(transaction=True)
        for queue, section in sections.items():
            if section.plain:
                pipe.lpush(self.keys.pending(queue), *section.plain)
        batch_at = len(pipe)
        if items:
            pipe.eval(self.scripts.sources["enqueue_batch"], len(keys), *keys, *args)
        calls = self.queue_uniques(pipe, uniques, result_ttl_s, first_by_source=True)
        replies = pipe.execute()
        missed = batch_args.not_pushed(replies[batch_at], others_at) if items else []
        holders = self.unique_holders(replies, calls)
        self._announced_queues.add(calls.new_queues)
        return [*_in_place(items, missed), *holders]

    def _batch_call(
        self, items: Sequence[Enqueueable], result_ttl_s: int, new_queues: set[str]
    ) -> tuple[dict[str, batch_args.Section], list[str], list[Any]]:
        """The sections of `items`, and the KEYS and ARGV of one enqueue_batch call (plain tasks left out)."""
        sections = batch_args.sections(items)
        records = batch_args.in_section_order(items, sections)
        keys = [key for queue in sections for key in self._queue_section_keys(queue)]
        keys += [self.keys.queues()] if new_queues else []
        keys += [self.keys.result(item.task_id) for item in records]
        args: list[Any] = [
            WAKE_TOKEN,
            ENQUEUED_IDS_KEEP_MS,
            ENQUEUED_IDS_MAX,
            "1" if new_queues else "0",
            len(sections),
            *history.header_args(self.history_max, result_ttl_s * 1000),
        ]
        for queue, section in sections.items():
            args += section.args(queue, with_plain=False)
        args += batch_args.record_groups(records, result_ttl_s)
        return sections, keys, args

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
        keys = [
            self.keys.result(item.task_id),
            self.keys.pending(item.queue),
            *history.index_keys(self.keys, item.queue),
        ]
        args: list[Any] = [result_ttl_s, item.raw, len(history.STATUSES), item.task_id, self.history_max]
        args += history.STATUSES
        for name, value in item.result_key_fields.items():
            args += (name, value)
        self._script_direct("enqueue_one", keys, args)
        return True


def _in_place(items: Sequence[Enqueueable], missed: Sequence[int]) -> list[str | None]:
    """Per task of `items`: None (pushed), or its own id for one at a position in `missed` (enqueued before)."""
    skipped = set(missed)
    return [item.task_id if position in skipped else None for position, item in enumerate(items)]
