"""Tasks to enqueue, and the arguments of lua/enqueue_batch.lua: a section per queue, READY records in groups."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Enqueueable:
    """A serialized task ready to push, with where it goes, when (from Redis's now) and its READY record."""

    queue: str
    raw: bytes
    priority: int = 0
    delay_ms: int = 0
    result_key_fields: dict[str, str] = field(default_factory=dict)
    task_id: str = ""
    # The caller chose the id: a task with this id enqueued to this queue recently is not pushed again.
    idempotent: bool = False

    @property
    def plain(self) -> bool:
        """Priority 0, due now, no id to check: pushed as is."""
        return not (self.priority or self.delay_ms > 0 or self.idempotent)


def by_queue(items: Sequence[Enqueueable]) -> dict[str, list[Enqueueable]]:
    """Group tasks by queue, keeping their order within each queue."""
    grouped: dict[str, list[Enqueueable]] = {}
    for item in items:
        grouped.setdefault(item.queue, []).append(item)
    return grouped


def queue_section(queue: str, items: Sequence[Enqueueable]) -> list[Any]:
    """One queue's section: its name, the plain tasks, then (id, priority, delay ms, task) of the others."""
    plain = [item.raw for item in items if item.plain]
    others: list[Any] = []
    for item in items:
        if not item.plain:
            others += (item.task_id if item.idempotent else "", item.priority, max(0, item.delay_ms), item.raw)
    return [queue, len(plain), *plain, len(others) // 4, *others]


def record_groups(items: Sequence[Enqueueable], result_ttl_s: int) -> list[Any]:
    """READY records as groups (keys, ttl s, pairs, pairs...): tasks sharing one fields dict share a group.

    A record outlives its task's due time: its time to live is result_ttl_s plus the delay.
    """
    args: list[Any] = []
    shared: dict[str, str] | None = None
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
