"""Enqueueing on Redis Cluster: `ClusterEnqueueOps`, mixed into `ProducingOps`.

A task's READY record lies in another slot than its queue, so no one script holds both. A call
with ids chosen by the caller first claims each id on its record (`enqueue_batch` with records
alone leaves a record naming another queue alone and says so), then pushes the tasks whose ids
are free: two round trips. A call of generated ids only takes one: their records are written
beside the pushes. Rarely a third: the records of unique duplicates go, and a caller's id given
to several tasks of unique types gets the record of the one pushed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from tasks_app.protocol import batch_args, history
from tasks_app.protocol.batch_args import ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, Enqueueable
from tasks_app.protocol.control import ControlOps, UniqueEnqueueable
from tasks_app.protocol.keys import WAKE_TOKEN


class IdClaims(NamedTuple):
    """What claiming a call's caller ids on their records found."""

    written: dict[str, bool]  # per id claimed: whether its record was written (else a run or cancel touched it)
    taken: set[str]  # ids whose record names another queue: nothing is pushed under them
    refused: list[Exception]  # errors of the claims Redis refused: their ids are not pushed either


class ClusterEnqueueOps(ControlOps):
    """Enqueueing on Redis Cluster: one call per queue and per record; some may be pushed when an error is raised."""

    def _enqueue_on_cluster(
        self,
        items: Sequence[Enqueueable],
        uniques: Sequence[UniqueEnqueueable],
        result_ttl_s: int,
        new_queues: set[str],
    ) -> list[str | None]:
        """Per task of `items`, then of `uniques`: None (pushed) or the id of the task enqueued in its place.

        A claim Redis refuses (its node out of memory, failing over) keeps its id's tasks back; the
        others are pushed, then its error is raised.
        """
        claims, whole_later = batch_args.id_claims(items, [unique.item for unique in uniques])
        claimed = self._claim_ids(claims, result_ttl_s) if claims else IdClaims({}, set(), [])
        blocked = claimed.taken | {item.task_id for item in claims if item.task_id not in claimed.written}
        outcomes = [item.task_id if item.idempotent and item.task_id in blocked else None for item in items]
        holders = [item.task_id if item.idempotent and item.task_id in blocked else None for item, *_ in uniques]
        recorded = self._push(items, uniques, result_ttl_s, new_queues, outcomes, holders, claimed)
        self._settle_unique_records(uniques, holders, recorded, whole_later, result_ttl_s)
        if claimed.refused:
            raise claimed.refused[0]
        return [*outcomes, *holders]

    def _claim_ids(self, claims: Sequence[Enqueueable], result_ttl_s: int) -> IdClaims:
        """Write the records claiming caller's ids, one call each, in one round trip.

        A record is written only where no run or cancel touched it; one naming another queue is
        left alone and its id is taken: another task's, nothing of this call is pushed under it.
        """
        pipe = self.client.pipeline(transaction=False)
        for item in claims:
            self._queue_record(pipe, item, result_ttl_s)
        claimed = IdClaims({}, set(), [])
        for item, reply in zip(claims, self.scripts.execute(pipe, self.client, raise_on_error=False), strict=True):
            if isinstance(reply, Exception):
                claimed.refused.append(reply)
            elif len(reply) > 2:
                claimed.taken.add(item.task_id)
            else:
                claimed.written[item.task_id] = bool(int(reply[1]))
        return claimed

    def _push(
        self,
        items: Sequence[Enqueueable],
        uniques: Sequence[UniqueEnqueueable],
        result_ttl_s: int,
        new_queues: set[str],
        outcomes: list[str | None],
        holders: list[str | None],
        claimed: IdClaims,
    ) -> list[bool]:
        """Push the tasks whose `outcomes` and `holders` are None, filling them in; return per unique task
        whether its record was written (by its claim or beside its push)."""
        free = [at for at, outcome in enumerate(outcomes) if outcome is None]
        free_uniques = [at for at, holder in enumerate(holders) if holder is None]
        pipe = self.client.pipeline(transaction=False)
        for item in items:
            if item.result_key_fields and not item.idempotent:  # a generated id: its record beside its push
                self._queue_record(pipe, item, result_ttl_s)
        first_section, sections = self._queue_sections(pipe, [items[at] for at in free], result_ttl_s)
        claimed_ids = claimed.written.keys() | claimed.taken
        calls = self.queue_uniques(pipe, [uniques[at] for at in free_uniques], result_ttl_s, recorded=claimed_ids)
        if new_queues:
            self.queue_announce(pipe, new_queues)
        replies = self.scripts.execute(pipe, self.client)
        self._announced_queues.add(calls.new_queues)
        for section, reply in zip(sections, replies[first_section:], strict=False):
            for position in batch_args.not_pushed(reply, section.others_at):
                outcomes[free[position]] = items[free[position]].task_id
        recorded = [claimed.written.get(unique.item.task_id, False) for unique in uniques]
        for at, holder, record_at in zip(free_uniques, self.unique_holders(replies, calls), calls.records, strict=True):
            holders[at] = holder
            recorded[at] = recorded[at] or (record_at >= 0 and bool(int(replies[record_at][1])))
        return recorded

    def _queue_sections(
        self, pipe: Any, items: Sequence[Enqueueable], result_ttl_s: int
    ) -> tuple[int, list[batch_args.Section]]:
        """Queue an enqueue_batch call per queue of `items` (no records); return the first's place and the sections."""
        head = [WAKE_TOKEN, ENQUEUED_IDS_KEEP_MS, ENQUEUED_IDS_MAX, "0"]
        shape = history.header_args(self.history_max, result_ttl_s * 1000)
        sections = batch_args.sections(items)
        first = len(pipe)
        for queue, section in sections.items():
            keys = self._queue_section_keys(queue)
            self.scripts.queue(pipe, "enqueue_batch", keys, [*head, 1, *shape, *section.args(queue)])
        return first, list(sections.values())

    def _queue_section_keys(self, queue: str) -> list[str]:
        return [
            self.keys.pending(queue),
            self.keys.prioritized(queue),
            self.keys.delayed(queue),
            self.keys.enqueued(queue),
            *history.index_keys(self.keys, queue),
        ]

    def _settle_unique_records(
        self,
        uniques: Sequence[UniqueEnqueueable],
        holders: Sequence[str | None],
        recorded: Sequence[bool],
        whole_later: set[str],
        result_ttl_s: int,
    ) -> None:
        """Delete the records written for unique tasks not pushed; write whole those that named only a queue.

        A record stays under an id that a task of the call pushed, or that names a task enqueued
        before (a retried request shares its record; a taken id's is another task's).
        """
        pairs = list(zip(uniques, holders, strict=True))
        kept = {unique.item.task_id for unique, holder in pairs if holder in (None, unique.item.task_id)}
        doomed = {unique.item.task_id for unique, wrote in zip(uniques, recorded, strict=True) if wrote} - kept
        whole = [unique.item for unique, holder in pairs if holder is None and unique.item.task_id in whole_later]
        if not (doomed or whole):
            return
        pipe = self.client.pipeline(transaction=False)
        for task_id in doomed:
            pipe.delete(self.keys.result(task_id))
        for item in whole:
            self._queue_record(pipe, item, result_ttl_s)
        self.scripts.execute(pipe, self.client)
