"""Concurrency slots of capped task types (`max_running`), held under their consumer's lease.

A type's (or one key value's) slots live in one hash slot of their own (lua/include/slots.lua):
each script touches that slot only, and moving a woken waiter's task from delayed to pending is
a second call, on its queue's slot. docs/PROTOCOL.md ("Concurrency caps") describes the keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tasks_app.protocol.keys import UNDECODABLE_TYPE, WAKE_TOKEN, delayed_member
from tasks_app.protocol.names import NAME_PATTERN
from tasks_app.protocol.scripts import ScriptClient

# How long a slot handed to a woken waiter is kept for it before anyone may take it.
WAKE_RESERVE_MS = 5000


class SlotSet(NamedTuple):
    """Which slots: a capped type, with the token of its `max_running_key` value (None: not keyed)."""

    task_type: str
    key_token: str | None
    limit: int


class Waiter(NamedTuple):
    """A task waiting in its queue's delayed set for a slot."""

    queue: str
    member: bytes  # its delayed-set member

    @classmethod
    def of(cls, queue: str, priority: int, raw: bytes) -> Waiter:
        """The waiter a task deferred with `retry_later(..., raw, raw, priority, ...)` is."""
        return cls(queue, delayed_member(priority, raw))

    @property
    def entry(self) -> bytes:
        return self.queue.encode() + b"\n" + self.member

    @property
    def id(self) -> str:
        return hashlib.sha1(self.entry).hexdigest()

    @classmethod
    def parse(cls, entry: bytes) -> Waiter | None:
        """Read a woken waiter; None for one no consumer of ours wrote (its queue is not a valid name)."""
        queue, sep, member = entry.partition(b"\n")
        name = queue.decode(errors="replace")
        # A foreign name ("}x") may spread the queue's keys over a cluster's slots: no wake could move it.
        return cls(name, member) if sep and member and NAME_PATTERN.fullmatch(name) else None


class SlotOps(ScriptClient):
    """Acquire, release, renew and wait for concurrency slots; wake waiters."""

    def _slot_keys(self, slots: SlotSet) -> list[str]:
        return [
            self.keys.running(slots.task_type, slots.key_token),
            self.keys.running_waiters(slots.task_type, slots.key_token),
            self.keys.running_waiting(slots.task_type, slots.key_token),
        ]

    def acquire_slot(
        self, slots: SlotSet, holder: str, waiter: Waiter, lease_ms: int, idle_ms: int
    ) -> tuple[bool, list[Waiter]]:
        """Take a slot for a run (held until `lease_ms` from now unless renewed); and the waiters woken."""
        args = [slots.limit, holder, waiter.id, lease_ms, WAKE_RESERVE_MS, idle_ms]
        taken, *woken = self._script("acquire_slot", self._slot_keys(slots), args)
        return bool(int(taken)), _waiters(woken)

    def wait_for_slot(self, slots: SlotSet, waiter: Waiter, order_ms: int, idle_ms: int, lease_ms: int) -> list[Waiter]:
        """Queue a deferred task for the next free slot; return the waiters handed one now (maybe itself)."""
        args = [slots.limit, waiter.id, waiter.entry, order_ms, WAKE_RESERVE_MS, idle_ms, lease_ms]
        return _waiters(self._script("wait_for_slot", self._slot_keys(slots), args))

    def release_slot(self, slots: SlotSet, holder: str, idle_ms: int, lease_ms: int) -> list[Waiter]:
        """Give a run's slot back; return the waiters woken (one per free slot)."""
        args = [holder, slots.limit, WAKE_RESERVE_MS, idle_ms, lease_ms]
        return _waiters(self._script("release_slot", self._slot_keys(slots), args))

    def renew_slots(self, held: Mapping[tuple[str, str | None], Sequence[str]], lease_ms: int, idle_ms: int) -> int:
        """Extend every slot this consumer's runs hold (per (type, key token): holder tokens), in one round trip."""
        if not held:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for (task_type, key_token), holders in held.items():
            self.scripts.queue(
                pipe, "renew_slots", [self.keys.running(task_type, key_token)], [lease_ms, idle_ms, *holders]
            )
        return sum(int(renewed) for renewed in self.scripts.execute(pipe, self.client))

    def wake(self, waiter: Waiter) -> bool:
        """Make a waiter's task due now and move it to pending; False if it was no longer delayed."""
        delayed = self.keys.delayed(waiter.queue)
        keys = [
            delayed,
            self.keys.pending(waiter.queue),
            self.keys.prioritized(waiter.queue),
            self.keys.recoveries(waiter.queue),
            self.keys.suspects(waiter.queue),
            self.keys.dead(waiter.queue),
        ]
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(delayed, {waiter.member: 0}, xx=True, ch=True)
        self.scripts.queue(pipe, "promote_due", keys, [100, WAKE_TOKEN, waiter.queue, UNDECODABLE_TYPE])
        changed, _ = self.scripts.execute(pipe, self.client)
        return bool(changed)

    def slots_in_use(self, slots: SlotSet) -> int:
        """How many of a slot set's slots are held or reserved now (expired holders included until evicted)."""
        return int(self.client.zcard(self.keys.running(slots.task_type, slots.key_token)))


def _waiters(entries: Sequence[Any]) -> list[Waiter]:
    return [waiter for waiter in map(Waiter.parse, entries) if waiter is not None]
