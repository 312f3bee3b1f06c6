"""Consumer leases on Redis: heartbeats, giving a lease up, deregistering, and reaping dead consumers' tasks."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.scripts import Role, ScriptClient

# Recoveries of a task from dead consumers before it is dead-lettered.
MAX_RECOVERIES = 3
REAP_BATCH = 1000
# Tombstones examined per reaper pass: the newest page, and one more page in turn.
TOMBSTONE_PAGE = 100
TOMBSTONE_KEEP_MS = 24 * 3600 * 1000
# A turn at a chore lasts this share of the chore's period.
TURN_SHARE = 0.9


@dataclass(frozen=True)
class LeaseHolder:
    """A consumer id's lease entry on one queue: how long it holds yet, and what its holder registered."""

    queue: str
    ms_left: int  # 0 or less once the lease lapsed (the holder is presumed dead)
    info: dict[str, Any]


@dataclass(frozen=True)
class ReapOutcome:
    """What one reap call did to one consumer's processing list."""

    status: int  # 1 reaped, -1 lease alive, -2 Redis restarted or failed over recently, -3 unknown consumer
    requeued: int
    remaining: int
    dead_lettered: list[bytes]


class Leases(Role):
    """Consumer leases: heartbeats, registering, giving a lease up, and reaping dead consumers' tasks."""

    def __init__(self, redis: ScriptClient) -> None:
        super().__init__(redis)
        # (consumer id, instance, queue) -> the deadline (ms) its last renewal here wrote; queue -> the replication id
        # under which a heartbeat last checked its primary marker. A renewal that finds both unchanged is one write.
        self._deadlines: dict[tuple[str, str, str], int] = {}
        self._marked: dict[str, bytes] = {}

    def heartbeat(
        self, queues: Sequence[str], consumer_id: str, lease_ms: int, register_info: dict[str, Any] | None = None
    ) -> bool:
        """Register or renew this consumer's lease on every queue; False if any was lost or had lapsed."""
        return not self.renew_leases(queues, consumer_id, lease_ms, register_info=register_info)

    def renew_leases(
        self,
        queues: Sequence[str],
        consumer_id: str,
        lease_ms: int,
        instance: str = "",
        *,
        register_info: dict[str, Any] | None = None,
    ) -> list[str]:
        """Renew (or register, listing the queues in the queue set) the lease on every queue; return those lost."""
        info = json.dumps(register_info) if register_info is not None else ""
        # Only the same process (its instance) may take the one-write renewal its last renewal left it.
        renewer = (consumer_id, instance or str((register_info or {}).get("instance", "")))
        calls = self._calls(queues)
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            keys = [key for queue in call for key in self.keys.queue_keys(queue, "consumers consumer_info primary")]
            if self.indexed:
                keys.append(self.keys.leases())
            # What this process's last renewal left, passed where it is one for the whole call (see heartbeat.lua).
            deadlines = {self._deadlines.get((*renewer, queue), "") for queue in call}
            marked = {self._marked.get(queue, b"") for queue in call}
            last_deadline = deadlines.pop() if len(deadlines) == 1 else ""
            args = [consumer_id, lease_ms, info, instance, last_deadline, marked.pop() if len(marked) == 1 else b""]
            self.scripts.queue(pipe, "heartbeat", keys, args)
        if register_info is not None:
            self.redis.announce(pipe, queues)
        lost: list[str] = []
        for call, reply in zip(calls, self.scripts.execute(pipe, self.client)[: len(calls)], strict=True):
            *held, deadline_ms, replid = reply
            for queue, holds in zip(call, held, strict=True):
                self._marked[queue] = replid
                if holds:
                    self._deadlines[(*renewer, queue)] = int(deadline_ms)
                else:
                    self._deadlines.pop((*renewer, queue), None)
                    lost.append(queue)
        return lost

    def _calls(self, queues: Sequence[str]) -> list[list[str]]:
        """The queues of each call of a script taking several queues' keys: all at once, or one a call on a cluster."""
        return [list(queues)] if not isinstance(self.client, redis.RedisCluster) else [[queue] for queue in queues]

    @property
    def indexed(self) -> bool:
        """Whether heartbeats keep the lease index, which spares reapers their look at every queue (one server)."""
        return not isinstance(self.client, redis.RedisCluster)

    def lapsed_recently(self, window_ms: int) -> int:
        """How many consumers' latest lease deadlines passed within the last `window_ms` (the lease index)."""
        return int(self.redis.run("lapsed_leases", [self.keys.leases()], [window_ms, TOMBSTONE_KEEP_MS]))

    def take_turn(self, chore: str, queues: Sequence[str], period_ms: int) -> bool:
        """Whether this consumer does `chore`, due every `period_ms`, now for every consumer of exactly `queues`."""
        # Held for most of a period: the next period's turn goes to whichever consumer asks first after it.
        hold_ms = max(1, int(period_ms * TURN_SHARE))
        return bool(self.client.set(self.keys.turn(chore, queues), 1, nx=True, px=hold_ms))

    def unlist(self, consumer_id: str) -> None:
        """Drop a consumer that left every queue cleanly from the lease index: no reaper need look for it."""
        if self.indexed:
            self.client.zrem(self.keys.leases(), consumer_id)

    def register_leases(
        self, queues: Sequence[str], consumer_id: str, lease_ms: int, register_info: dict[str, Any]
    ) -> None:
        """Register this consumer's lease on every queue, and list them in the queue set."""
        self.renew_leases(queues, consumer_id, lease_ms, register_info=register_info)

    def list_queues(self, queues: Sequence[str]) -> None:
        """Add `queues` to the queue set again (registering lists them too: this is for a set deleted since)."""
        self.redis.run("announce_queues", [self.keys.queues()], sorted(queues))

    def lease_holders(self, queues: Sequence[str], consumer_id: str) -> list[LeaseHolder]:
        """The lease entries `consumer_id` holds on `queues` (none where it holds no entry)."""
        calls = [([self.keys.consumers(queue), self.keys.consumer_info(queue)], [consumer_id]) for queue in queues]
        entries = self.redis.run_many("lease_holder", calls)
        return [
            LeaseHolder(queue, int(ms_left), json.loads(info) if info else {})
            for queue, (held, ms_left, info) in zip(queues, entries, strict=True)
            if int(held)
        ]

    def abandon(self, queues: Sequence[str], consumer_id: str) -> None:
        """Tombstone an id whose lease was lost, so reapers sweep its lists (a blocking claim may still fill them)."""
        now_ms = int(time.time() * 1000)
        self.redis.each(queues, lambda pipe, queue: pipe.zadd(self.keys.reaped(queue), {consumer_id: now_ms}, nx=True))

    def deregister(self, queue: str, consumer_id: str, instance: str = "") -> int:
        """Leave cleanly: put back what is held, uncounted, and drop the lease (-1: another instance has the id)."""
        names = "consumers consumer_info processing pending recoveries suspects prioritized staging"
        keys = self.keys.queue_keys(queue, names, consumer_id)
        return int(self.redis.run("deregister", keys, [consumer_id, instance, WAKE_TOKEN]))

    def reap_candidate_pages(
        self, queues: Sequence[str], tombstone_offsets: Sequence[int]
    ) -> list[tuple[list[str], list[str], int]]:
        """Per queue: expired consumers, reaped ids with tasks left (a page of tombstones per call), the next offset."""
        calls = self._calls(queues)
        offsets = dict(zip(queues, tombstone_offsets, strict=True))
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            keys = [key for queue in call for key in (self.keys.consumers(queue), self.keys.reaped(queue))]
            args = [TOMBSTONE_PAGE, TOMBSTONE_KEEP_MS, *(offsets[queue] for queue in call)]
            self.scripts.queue(pipe, "reap_candidates", keys, args)
        pages = [page for reply in self.scripts.execute(pipe, self.client) for page in reply]
        return [self._candidates(queue, offsets[queue], out) for queue, out in zip(queues, pages, strict=True)]

    def _candidates(self, queue: str, tombstone_offset: int, out: list[Any]) -> tuple[list[str], list[str], int]:
        ids, count = [item.decode() for item in out[:-2]], int(out[-1])
        split = ids.index("")
        expired = [cid for cid in ids[:split] if cid]
        tombstones = list(dict.fromkeys(cid for cid in ids[split + 1 :] if cid))
        if tombstones:
            # What a blocking claim in flight as its consumer froze moved there (staged, or on into processing).
            lists = [
                key for cid in tombstones for key in (self.keys.processing(queue, cid), self.keys.staging(queue, cid))
            ]
            lengths = self.redis.each(lists, lambda pipe, key: pipe.llen(key))
            tombstones = [
                cid for cid, held, staged in zip(tombstones, lengths[::2], lengths[1::2], strict=True) if held or staged
            ]
        next_offset = tombstone_offset + TOMBSTONE_PAGE
        return expired, tombstones, next_offset if next_offset < count else 0

    def reap(
        self, queue: str, consumer_id: str, default_lease_ms: int, *, own_earlier_run: bool = False
    ) -> ReapOutcome:
        """Return a dead consumer's tasks to the suspects list, REAP_BATCH at most (`own_earlier_run`: lease or not)."""
        names = "consumers consumer_info reaped processing pending dead recoveries suspects primary staging"
        keys = self.keys.queue_keys(queue, names, consumer_id)
        args = [consumer_id, MAX_RECOVERIES, REAP_BATCH, WAKE_TOKEN, default_lease_ms, "1" if own_earlier_run else "0"]
        out = self.redis.run("reap", keys, args)
        return ReapOutcome(status=int(out[0]), requeued=int(out[1]), remaining=int(out[2]), dead_lettered=list(out[3:]))
