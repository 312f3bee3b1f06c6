"""Periodic schedules on Redis: firing one slot (`fire_periodic.lua`) and reading a schedule's state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import redis

from tasks_app.protocol import history
from tasks_app.protocol.enqueue import Enqueueable, Enqueuer, record_only_args
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.scripts import Role, ScriptClient, reply_text

PUSHED_OUTCOMES = frozenset({"fired", "caught_up", "fired_and_caught_up"})
# The slot is claimed for another queue (`FireReply.queue`): fire it there.
ELSEWHERE = "elsewhere"


class SlotFiring(NamedTuple):
    """One slot to fire: when it is, the slot before it, how late it may run as itself, the policy."""

    slot_ms: int
    previous_ms: int  # 0: no slot before it
    on_time_ms: int
    catch_up: str  # "skip" or "once"
    saved_ms: int = 0  # when the schedule was last saved: slots up to then are never caught up


class FireReply(NamedTuple):
    """What the fire script did with a slot, on the Redis server's clock."""

    outcome: str
    now_ms: int
    handled_slot_ms: int  # the last slot handled (fired or skipped); -1 if none
    fired_slot_ms: int  # the last slot a run was pushed for; -1 if none
    queue: str = ""  # ELSEWHERE: the queue the slot is claimed for

    @property
    def pushed(self) -> bool:
        """True if this call pushed a run (regular or catch-up)."""
        return self.outcome in PUSHED_OUTCOMES


class PeriodicState(NamedTuple):
    """A schedule's state in Redis: the last slot handled and the last run pushed (ms; None if none)."""

    handled_slot_ms: int | None
    fired_slot_ms: int | None
    task_id: str
    fired_at_ms: int | None


class Periodic(Role):
    """Firing periodic slots and reading their state."""

    def __init__(self, redis: ScriptClient, enqueuer: Enqueuer) -> None:
        super().__init__(redis)
        self.enqueuer = enqueuer  # its queue announcements and history cap

    def fire_periodic(
        self, schedule: str, firing: SlotFiring, regular: Enqueueable, catch_up: Enqueueable | None, result_ttl_s: int
    ) -> FireReply:
        """Claim one slot of `schedule` and push its run (and a due catch-up run) into `regular.queue`."""
        queue = regular.queue
        keys = [self.keys.periodic(queue, schedule), self.keys.pending(queue), self.keys.prioritized(queue)]
        keys += history.index_keys(self.keys, queue)
        on_cluster = isinstance(self.client, redis.RedisCluster)
        elsewhere_ms = 0
        if on_cluster:  # the slot claim lies in a hash slot of its own: claimed first
            outcome, claimed, before_ms, now_ms = self.redis.run(
                "claim_periodic", [self.keys.periodic_claim(schedule)], [firing.slot_ms, queue]
            )
            outcome, claimed = reply_text(outcome), reply_text(claimed)
            if outcome == "claimed" and claimed != queue:
                return FireReply(ELSEWHERE, int(now_ms), -1, -1, claimed)
            if outcome != "claimed":  # "early", or "done": a later slot was claimed
                return FireReply(outcome, int(now_ms), firing.slot_ms if outcome == "done" else -1, -1)
            elsewhere_ms = int(before_ms)
        else:
            keys += [self.keys.result(regular.task_id), self.keys.result(catch_up.task_id if catch_up else "-")]
            keys.append(self.keys.periodic_claim(schedule))
        args: list[Any] = [firing.slot_ms, firing.previous_ms, firing.on_time_ms, firing.catch_up, WAKE_TOKEN]
        args += [regular.priority, regular.task_id, regular.raw]
        args += [catch_up.task_id, catch_up.raw] if catch_up else ["", ""]
        args += [result_ttl_s, firing.saved_ms, regular.queue, elsewhere_ms]
        args += history.header_args(self.enqueuer.history_max, result_ttl_s * 1000)
        for name, value in regular.result_key_fields.items():
            args += (name, value)
        reply = _reply(self.redis.run("fire_periodic", keys, args))
        if reply.pushed and queue not in self.enqueuer.announced:
            self.redis.run("announce_queues", [self.keys.queues()], [queue])
            self.enqueuer.announced.add([queue])
        # Redis Cluster: the records lie in other slots than the queue, written after the push.
        for item in _pushed(reply.outcome, regular, catch_up) if on_cluster else ():
            self.redis.run("enqueue_batch", [self.keys.result(item.task_id)], record_only_args(item, result_ttl_s))
        return reply

    def skip_periodic(self, queue: str, schedule: str, slot_ms: int) -> FireReply:
        """Record one slot of `schedule` (firing into `queue`) as handled without pushing a run: refused, not missed."""
        return _reply(self.redis.run("skip_periodic", [self.keys.periodic(queue, schedule)], [slot_ms]))

    def periodic_states(self, schedules: Sequence[tuple[str, str]]) -> list[PeriodicState]:
        """The state of each (queue, schedule) in one round trip."""
        keys = [self.keys.periodic(queue, schedule) for queue, schedule in schedules]
        return [_state(fields) for fields in self.redis.each(keys, lambda pipe, key: pipe.hgetall(key))]


def _reply(reply: Sequence[Any]) -> FireReply:
    outcome, now_ms, handled_ms, fired_ms, *claimed = reply
    return FireReply(
        reply_text(outcome), int(now_ms), int(handled_ms), int(fired_ms), reply_text(claimed[0]) if claimed else ""
    )


def _pushed(outcome: str, regular: Enqueueable, catch_up: Enqueueable | None) -> list[Enqueueable]:
    runs = [catch_up] if catch_up is not None and outcome in ("caught_up", "fired_and_caught_up") else []
    return [*runs, regular] if outcome in ("fired", "fired_and_caught_up") else runs


def _state(fields: Mapping[bytes, bytes]) -> PeriodicState:
    def ms(name: bytes) -> int | None:
        return int(fields[name]) if name in fields else None

    task_id = fields.get(b"task_id", b"").decode(errors="backslashreplace")
    return PeriodicState(ms(b"slot_ms"), ms(b"fired_slot_ms"), task_id, ms(b"fired_at_ms"))
