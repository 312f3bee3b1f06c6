"""Throttles on Redis: rate limits, the tasks they defer, concurrency caps' slots, and disabled types.

docs/PROTOCOL.md ("Rate limits", "Concurrency caps") describes the keys. Tasks deferred while their
type is disabled are noted, so enabling it makes them due at once.
"""

from __future__ import annotations

import hashlib
import math
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from itertools import batched
from typing import NamedTuple

from tasks_app.protocol.codec import UndecodableTask, decode_task
from tasks_app.protocol.keys import UNDECODABLE_TYPE, WAKE_TOKEN, delayed_member, split_delayed_member
from tasks_app.protocol.queue import PROMOTE_DUE_KEYS
from tasks_app.protocol.scripts import Role

# How long a slot handed to a woken waiter is kept for it before anyone may take it.
WAKE_RESERVE_MS = 5000
WAKE_BATCH = 1000
RESCHEDULE_BATCH = 1000
# How long a follower holds its lease without renewing it (it renews at every batch).
FOLLOWER_LEASE_MS = 30_000


class RateDecision(NamedTuple):
    """One decision: 0 µs to wait (start now) or the wait until the task's slot; whether the slots were rescaled."""

    wait_us: int
    rescaled: bool


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


class Limits(Role):
    """Rate-limit decisions and their follow-ups, concurrency slots, and the tasks of disabled types."""

    def rate_limit(
        self,
        task_type: str,
        algorithm: str,
        task_id: str,
        limit: int,
        period_us: int,
        emission_us: int,
        tolerance_us: int,
        key_token: str | None = None,
        *,
        queue: str = "",
        type_queue: str = "",
    ) -> RateDecision:
        """Decide whether a task of `task_type` (of one key value) on `queue` may start now (`type_queue`: its own)."""
        args = [algorithm, task_id, limit, period_us, emission_us, tolerance_us, queue, type_queue]
        wait_us, rescaled = self.redis.run("rate_limit", self._limiter_keys(task_type, key_token), args)
        return RateDecision(int(wait_us), bool(rescaled))

    def rate_removed(self, task_type: str, key_token: str | None, type_queue: str) -> int:
        """List the queues holding deferred tasks of a limiter just removed, to be due now; how many are listed."""
        return int(self.redis.run("rate_removed", self._limiter_keys(task_type, key_token), [type_queue]))

    def rate_deferred(self, task_type: str, key_token: str | None, task_id: str, queue: str) -> tuple[int, int]:
        """When a denied task in `queue`'s delayed set is due (its slot, or now if none), and the server's now (µs)."""
        keys = self._limiter_keys(task_type, key_token)[:2]
        due_us, now_us = self.redis.run("rate_deferred", keys, [task_id, queue])
        return int(due_us), int(now_us)

    def rate_keyed(self, task_type: str, key_token: str, holds_us: int, most: int) -> bool:
        """Note a value of a keyed limit whose limiter holds slots for `holds_us` from now; False if `most` are."""
        return bool(self.redis.run("rate_keyed", [self.keys.rate_keyed(task_type)], [key_token, holds_us, most]))

    def rate_keyed_values(self, task_type: str) -> list[str]:
        """The key tokens of the values noted by `rate_keyed` (some may have expired since)."""
        return [member.decode() for member in self.client.zrange(self.keys.rate_keyed(task_type), 0, -1)]

    def rate_follow_ups(self, task_type: str, key_token: str | None) -> dict[str, str]:
        """The queues whose deferred tasks have yet to follow a changed limit, each with "slots" or "now"."""
        follow_ups = self.client.hgetall(self.keys.rate_follow_ups(task_type, key_token))
        return {queue.decode(): mode.decode() for queue, mode in follow_ups.items()}

    def rate_followed(self, task_type: str, key_token: str | None, queue: str, mode: str, since_us: int) -> bool:
        """Take `queue` off the follow-ups once followed by a scan begun at `since_us`; False if listed again since."""
        keys = self._limiter_keys(task_type, key_token)
        return bool(self.redis.run("rate_followed", keys, [queue, mode, since_us]))

    def rate_follower(self, task_type: str, key_token: str | None, token: str, hold_ms: int) -> bool:
        """Take or keep (`hold_ms` > 0) or give back (0) the lease of following a limiter's change."""
        return bool(self.redis.run("rate_follower", [self.keys.rate_follower(task_type, key_token)], [token, hold_ms]))

    def bring_forward(self, queue: str, due_ms: Mapping[bytes, int]) -> int:
        """Make delayed members of `queue` due at the given ms, never later, never added back; how many moved."""
        return int(self.client.zadd(self.keys.delayed(queue), dict(due_ms), xx=True, lt=True, ch=True)) if due_ms else 0

    def follow_up(
        self, task_type: str, key_token: str | None, give_up: threading.Event, lease_ms: int = FOLLOWER_LEASE_MS
    ) -> int:
        """Bring the deferred tasks of every queue listed to the limiter's change; how many moved."""
        token, followed = uuid.uuid4().hex, 0
        keep = partial(self.rate_follower, task_type, key_token, token, lease_ms)
        while self.rate_follow_ups(task_type, key_token):
            if not keep():
                if give_up.wait(lease_ms / 10_000):  # another follows: wait for it to finish, or to die
                    break
                continue
            try:
                # Read again under the lease: the last holder may have done them all meanwhile.
                for queue, mode in self.rate_follow_ups(task_type, key_token).items():
                    since_us = self.redis.server_time_us()
                    followed += self._reschedule(queue, task_type, key_token, now=mode == "now", keep=keep)
                    self.rate_followed(task_type, key_token, queue, mode, since_us)
            finally:
                self.rate_follower(task_type, key_token, token, 0)
        return followed

    def _reschedule(
        self, queue: str, task_type: str, key_token: str | None, *, now: bool, keep: Callable[[], object]
    ) -> int:
        """Bring `task_type`'s delayed tasks on `queue` to their limiter's slots (`now`: due now)."""
        rate_key = self.keys.rate(task_type, key_token)
        if not self.client.exists(rate_key):  # no limiter: no task holds a slot of it
            return 0
        now_ms = self.redis.server_time_us() // 1000 if now else None
        moved = 0
        scan = (member for member, _ in self.client.zscan_iter(self.keys.delayed(queue), count=RESCHEDULE_BATCH))
        for members in batched(scan, RESCHEDULE_BATCH):
            keep()
            ids = _ids_of_type(members, task_type)
            if not ids:
                continue
            slots_us = self.client.hmget(rate_key, [f"r:{task_id}" for task_id in ids.values()])
            due_ms = {
                member: now_ms if now_ms is not None else math.ceil(int(slot_us) / 1000)
                for member, slot_us in zip(ids, slots_us, strict=True)
                if slot_us is not None
            }
            moved += self.bring_forward(queue, due_ms)
        return moved

    def _limiter_keys(self, task_type: str, key_token: str | None) -> list[str]:
        keys = self.keys
        return [key(task_type, key_token) for key in (keys.rate, keys.rate_queues, keys.rate_follow_ups)]

    def acquire_slot(
        self, slots: SlotSet, holder: str, waiter: Waiter, lease_ms: int, idle_ms: int
    ) -> tuple[bool, list[Waiter]]:
        """Take a slot for a run (held until `lease_ms` from now unless renewed); and the waiters woken."""
        args = [slots.limit, holder, waiter.id, lease_ms, WAKE_RESERVE_MS, idle_ms]
        taken, *woken = self.redis.run("acquire_slot", self._slot_keys(slots), args)
        return bool(int(taken)), _waiters(woken)

    def wait_for_slot(self, slots: SlotSet, waiter: Waiter, order_ms: int, idle_ms: int, lease_ms: int) -> list[Waiter]:
        """Queue a deferred task for the next free slot; return the waiters handed one now (maybe itself)."""
        args = [slots.limit, waiter.id, waiter.entry, order_ms, WAKE_RESERVE_MS, idle_ms, lease_ms]
        return _waiters(self.redis.run("wait_for_slot", self._slot_keys(slots), args))

    def release_slot(self, slots: SlotSet, holder: str, idle_ms: int, lease_ms: int) -> list[Waiter]:
        """Give a run's slot back; return the waiters woken (one per free slot)."""
        args = [holder, slots.limit, WAKE_RESERVE_MS, idle_ms, lease_ms]
        return _waiters(self.redis.run("release_slot", self._slot_keys(slots), args))

    def renew_slots(self, held: Mapping[tuple[str, str | None], Sequence[str]], lease_ms: int, idle_ms: int) -> int:
        """Extend every slot this consumer's runs hold (per (type, key token): holder tokens), in one round trip."""
        if not held:
            return 0
        calls = [([self.keys.running(*limiter)], [lease_ms, idle_ms, *holders]) for limiter, holders in held.items()]
        return sum(int(renewed) for renewed in self.redis.run_many("renew_slots", calls))

    def wake(self, waiter: Waiter) -> bool:
        """Make a waiter's task due now and move it to pending; False if it was no longer delayed."""
        keys = self.keys.queue_keys(waiter.queue, PROMOTE_DUE_KEYS)
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(keys[0], {waiter.member: 0}, xx=True, ch=True)
        self.scripts.queue(pipe, "promote_due", keys, [100, WAKE_TOKEN, waiter.queue, UNDECODABLE_TYPE])
        changed, _ = self.scripts.execute(pipe, self.client)
        return bool(changed)

    def _slot_keys(self, slots: SlotSet) -> list[str]:
        keys = self.keys
        return [
            key(slots.task_type, slots.key_token) for key in (keys.running, keys.running_waiters, keys.running_waiting)
        ]

    def note_disabled(self, queue: str, task_type: str, priority: int, raw: bytes, ttl_ms: int) -> None:
        """Note `raw`, just deferred on `queue` because `task_type` is disabled."""
        keys = [self.keys.disabled_types(queue), self.keys.disabled(queue, task_type)]
        self.redis.run("note_disabled", keys, [task_type, delayed_member(priority, raw), ttl_ms])

    def wake_enabled(self, queue: str, disabled: Callable[[str], bool]) -> int:
        """Make due now the noted tasks of `queue` whose types are no longer `disabled`; how many were still delayed."""
        woken, types_key = 0, self.keys.disabled_types(queue)
        names = self.client.smembers(types_key)
        for name in names:
            task_type = name.decode()
            if disabled(task_type):
                continue
            keys = [types_key, self.keys.disabled(queue, task_type), self.keys.delayed(queue)]
            taken = WAKE_BATCH
            while taken == WAKE_BATCH:
                taken, due = self.redis.run("wake_enabled", keys, [name, WAKE_BATCH])
                woken += due
        return woken


def _ids_of_type(members: Iterable[bytes], task_type: str) -> dict[bytes, str]:
    """The task id of each delayed member that is a task of `task_type` (other members skipped)."""
    ids = {}
    for member in members:
        split = split_delayed_member(member)
        if split is None:
            continue
        try:
            task = decode_task(split[1])
        except UndecodableTask:
            continue
        if task.type == task_type:
            ids[member] = task.id
    return ids


def _waiters(entries: Sequence[bytes]) -> list[Waiter]:
    """The woken waiters of their entries ("<queue>\\n<member>")."""
    return [Waiter(queue.decode(), member) for queue, _, member in (entry.partition(b"\n") for entry in entries)]
