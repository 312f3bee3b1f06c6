"""The arguments of lua/enqueue_batch.lua: tasks in one section per queue, READY records in groups."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol


class Batchable(Protocol):
    """What a section or a record group needs of a task (see broker.Enqueueable)."""

    @property
    def queue(self) -> str: ...
    @property
    def raw(self) -> bytes: ...
    @property
    def priority(self) -> int: ...
    @property
    def delay_ms(self) -> int: ...
    @property
    def result_key_fields(self) -> dict[str, str]: ...
    @property
    def task_id(self) -> str: ...
    @property
    def idempotent(self) -> bool: ...
    @property
    def plain(self) -> bool: ...


def by_queue[T: Batchable](items: Sequence[T]) -> dict[str, list[T]]:
    """Group tasks by queue, keeping their order within each queue."""
    grouped: dict[str, list[T]] = {}
    for item in items:
        grouped.setdefault(item.queue, []).append(item)
    return grouped


def queue_section(queue: str, items: Sequence[Batchable]) -> list[Any]:
    """One queue's section: its name, the plain tasks, then (id, priority, delay ms, task) of the others."""
    plain = [item.raw for item in items if item.plain]
    others: list[Any] = []
    for item in items:
        if not item.plain:
            others += (item.task_id if item.idempotent else "", item.priority, max(0, item.delay_ms), item.raw)
    return [queue, len(plain), *plain, len(others) // 4, *others]


def record_groups(items: Sequence[Batchable], result_ttl_s: int) -> list[Any]:
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
