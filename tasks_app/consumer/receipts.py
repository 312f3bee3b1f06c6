"""Claim receipts: what lets a worker start a claimed task without waiting for its RUNNING write.

A cancel is decided on the task's record (`cancel.lua`), and so is the start of a run. Right
after a claim, the claimer writes a receipt to the record of each task it moved, all in one
round trip (`claim_receipts.lua`): Redis refuses the receipt of a task already cancelled (the
worker drops it unrun), and a cancel that comes after an accepted receipt is a request to this
consumer: a task that waited here unstarted for CANCEL_CHECK_S or more asks for one before its
gates and its start (and is dropped unrun if it was cancelled), and a running handler sees it as
`context.cancelled`. The RUNNING write that follows carries the receipt's token, so it is never
refused: it goes out with the next flush, usually merged with the run's outcome into one write.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from tasks_app.consumer.claimed import Claimed
from tasks_app.protocol import results
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, UndecodableTask, decode_task
from tasks_app.protocol.replies import ResultUpdate

logger = logging.getLogger(__name__)

# What claim_receipts answers for a record that is not a hash: no receipt (the RUNNING write decides).
NOT_A_RECORD = -1


def with_receipts(broker: Broker, claimed: Sequence[Claimed], result_ttl_s: int) -> list[Claimed]:
    """Write the receipts of freshly claimed tasks; return them decoded, each with its record's answer.

    A task that cannot be decoded gets no receipt (its worker dead-letters it). If Redis cannot
    be reached, no task has one: their workers then wait for their RUNNING writes instead.
    """
    tasks = [_decoded(item.raw) for item in claimed]
    claims = [(task.id, item.fence) for item, task in zip(claimed, tasks, strict=True) if task is not None]
    try:
        replies = iter(broker.claim_receipts(claims, result_ttl_s) if claims else ())
    except RedisError as exc:
        logger.warning(
            "could not write the claim receipts of %d task(s) (%s); they start unreceipted", len(claims), exc
        )
        replies = iter([NOT_A_RECORD] * len(claims))
    return [
        Claimed(  # not dataclasses.replace: this is per task, and replace costs twice as much
            item.queue,
            item.consumer_id,
            item.raw,
            item.suspect,
            item.fence,
            task,
            _receipt(next(replies)) if task is not None else None,
            item.claimed_at_s,
        )
        for item, task in zip(claimed, tasks, strict=True)
    ]


def withdrawals(claimed: Sequence[Claimed], result_ttl_s: int) -> list[ResultUpdate]:
    """The writes that withdraw the receipts of claimed tasks going back to wait unstarted."""
    return [
        update for item in claimed if item.task is not None and (update := withdrawal(item, item.task, result_ttl_s))
    ]


def withdrawal(claimed: Claimed, task: Task, ttl_s: int) -> ResultUpdate | None:
    """The write that withdraws the receipt of one claimed task (`task`, decoded) going back unstarted; None if none."""
    return results.receipt_withdrawn(task, claimed.fence, ttl_s) if claimed.receipt is not None else None


def _receipt(reply: int) -> int | None:
    return None if reply == NOT_A_RECORD else reply


def _decoded(raw: bytes) -> Task | None:
    try:
        return decode_task(raw)
    except UndecodableTask:
        return None
