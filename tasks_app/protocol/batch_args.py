"""Tasks to enqueue, and the arguments of lua/enqueue_batch.lua: a section per queue, READY records in groups."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple


class Enqueueable(NamedTuple):
    """A serialized task ready to push, with where it goes, when (from Redis's now) and its READY record."""

    queue: str
    raw: bytes
    priority: int = 0
    delay_ms: int = 0
    result_key_fields: Mapping[str, str] = MappingProxyType({})  # a NamedTuple: built per task, fast
    task_id: str = ""
    # The caller chose the id: a task with this id enqueued to this queue recently is not pushed again.
    idempotent: bool = False

    @property
    def plain(self) -> bool:
        """Priority 0, due now, no id to check: pushed as is."""
        return not (self.priority or self.delay_ms > 0 or self.idempotent)


# Ids given by callers are remembered per queue this long and up to this many, so a retry of a
# partly enqueued batch (Redis Cluster) or of one whose reply was lost does not push them twice.
ENQUEUED_IDS_KEEP_MS = 24 * 3600 * 1000
ENQUEUED_IDS_MAX = 100_000


@dataclass
class Section:
    """One queue's tasks: plain ones (pushed as they are), the others as (id, priority, delay ms, task),
    and the ids of those with a record (added to the queue's history)."""

    plain: list[bytes] = field(default_factory=list)
    others: list[Any] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    # The positions in the batch of the tasks in `others`, in order: the script names by them those it did not push.
    others_at: list[int] = field(default_factory=list)

    def args(self, queue: str, with_plain: bool = True) -> list[Any]:
        """The section's ARGV: queue name, plain tasks (if `with_plain`, else none), the others, the history ids."""
        plain = self.plain if with_plain else []
        return [queue, len(plain), *plain, len(self.others) // 4, *self.others, len(self.history), *self.history]


def sections(items: Sequence[Enqueueable]) -> dict[str, Section]:
    """Split tasks into one section per queue, keeping their order."""
    by_queue: dict[str, Section] = {}
    for position, item in enumerate(items):
        section = by_queue.get(item.queue)
        if section is None:
            section = by_queue[item.queue] = Section()
        if item.priority or item.delay_ms > 0 or item.idempotent:  # not item.plain, inlined: runs per task
            section.others += (item.task_id if item.idempotent else "", item.priority, item.delay_ms, item.raw)
            section.others_at.append(position)
        else:
            section.plain.append(item.raw)
        if item.result_key_fields:
            section.history.append(item.task_id)
    return by_queue


def not_pushed(reply: Sequence[Any], others_at: Sequence[int]) -> list[int]:
    """The positions in the batch of the tasks an enqueue_batch call did not push, from its reply and `others_at`."""
    return [others_at[int(number) - 1] for number in reply[2:]]


def in_section_order(items: Sequence[Enqueueable], by_queue: Mapping[str, Section]) -> list[Enqueueable]:
    """The tasks with a READY record, by section and then in order: the order of the sections' history ids."""
    recorded = [item for item in items if item.result_key_fields]
    if len(by_queue) == 1:
        return recorded
    order = {queue: number for number, queue in enumerate(by_queue)}
    return sorted(recorded, key=lambda item: order[item.queue])


def id_claims(items: Sequence[Enqueueable], uniques: Sequence[Enqueueable]) -> tuple[list[Enqueueable], set[str]]:
    """Redis Cluster: per caller's id of a call, the READY record that claims it for its queue before any push.

    The record of the id's first task of `items` (those are pushed before `uniques`), else of its
    one task of `uniques`. An id given to several tasks of `uniques` alone gets a record naming
    only its queue, as which of them is pushed is known only after the push: those ids are
    returned too, for the record of the one pushed to be written whole then.
    """
    claims: dict[str, Enqueueable] = {}
    for item in items:
        if item.idempotent and item.result_key_fields and item.task_id not in claims:
            claims[item.task_id] = item
    of_items, repeated = set(claims), set()
    for item in uniques:
        if not (item.idempotent and item.result_key_fields) or item.task_id in of_items:
            continue
        if item.task_id in claims:
            claims[item.task_id] = item._replace(result_key_fields={"queue": item.queue})
            repeated.add(item.task_id)
        else:
            claims[item.task_id] = item
    return list(claims.values()), repeated


def record_groups(items: Sequence[Enqueueable], result_ttl_s: int) -> list[Any]:
    """READY records as groups (keys, ttl s, pairs, pairs...): tasks sharing one fields dict share a group.

    A record outlives its task's due time: its time to live is result_ttl_s plus the delay.
    """
    args: list[Any] = []
    shared: Mapping[str, str] | None = None
    count_at = 0
    for item in items:
        if not item.result_key_fields:
            continue
        if item.result_key_fields is shared:  # the producer shares one dict between identical tasks
            args[count_at] += 1
            continue
        shared, count_at = item.result_key_fields, len(args)
        args += (1, result_ttl_s + math.ceil(max(0, item.delay_ms) / 1000), len(shared))
        for name, value in shared.items():
            args += (name, value)
    return args


def record_only_args(item: Enqueueable, result_ttl_s: int) -> list[Any]:
    """The ARGV of an enqueue_batch call that writes `item`'s READY record alone (its own slot on Redis Cluster)."""
    # No queue section and no history index: the wake token and the id memory are never read.
    return ["", 0, 1, "0", 0, 0, 1, 1, *record_groups([item], result_ttl_s)]
