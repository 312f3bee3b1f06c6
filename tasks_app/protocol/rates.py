"""Rate limits of task types: one decision per task (`rate_limit.lua`), mixed into `Broker`.

docs/PROTOCOL.md ("Rate limits") describes the hash `P:rate:{T}` and the algorithms. When a
decision finds the hash written under another emission interval (the type's limit was changed
in the admin), the script moves the reserved slots to the new spacing and lists the queues whose
deferred tasks hold them (`P:rate:{T}:follow_ups`); `rate_deferrals.follow_up` then brings those
tasks to their new slots, once, whichever consumer gets to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from tasks_app.protocol.scripts import ScriptClient


class RateDecision(NamedTuple):
    """One decision: 0 µs to wait (start now) or the wait until the task's slot; whether the slots were rescaled."""

    wait_us: int
    rescaled: bool


class RateOps(ScriptClient):
    """Rate-limit decisions, and the list of queues whose deferred tasks follow a changed limit."""

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
        """Decide whether a task of `task_type` (of one key value, if keyed) on `queue` may start now.

        `type_queue`, the type's own queue, is listed for a follow-up beside the recorded ones if
        this call rescales the slots.
        """
        args = [algorithm, task_id, limit, period_us, emission_us, tolerance_us, queue, type_queue]
        wait_us, rescaled = self._script("rate_limit", self._limiter_keys(task_type, key_token), args)
        return RateDecision(int(wait_us), bool(rescaled))

    def rate_removed(self, task_type: str, key_token: str | None, type_queue: str) -> int:
        """List every queue holding deferred tasks of a limiter just removed as due now; how many are listed.

        The type's own queue `type_queue` is listed while slots are reserved, recorded or not.
        """
        return int(self._script("rate_removed", self._limiter_keys(task_type, key_token), [type_queue]))

    def rate_deferred(self, task_type: str, key_token: str | None, task_id: str, queue: str) -> tuple[int, int]:
        """A task the limiter denied has landed in `queue`'s delayed set: when it is due, and the server's now (µs).

        Due at its slot as the limiter holds it (moved if the limit changed since the denial), or
        now if the limiter holds it no more; its queue stays listed for the next follow-up.
        """
        keys = self._limiter_keys(task_type, key_token)[:2]
        due_us, now_us = self._script("rate_deferred", keys, [task_id, queue])
        return int(due_us), int(now_us)

    def rate_keyed(self, task_type: str, key_token: str, holds_us: int, most: int) -> bool:
        """Note a value of a keyed limit whose limiter holds slots for `holds_us` from now; False if `most` are."""
        return bool(self._script("rate_keyed", [self.keys.rate_keyed(task_type)], [key_token, holds_us, most]))

    def rate_keyed_values(self, task_type: str) -> list[str]:
        """The key tokens of the values noted by `rate_keyed` (some may have expired since)."""
        return [member.decode() for member in self.client.zrange(self.keys.rate_keyed(task_type), 0, -1)]

    def rate_follow_ups(self, task_type: str, key_token: str | None) -> dict[str, str]:
        """The queues whose deferred tasks have yet to follow a changed limit, each with "slots" or "now"."""
        follow_ups = self.client.hgetall(self.keys.rate_follow_ups(task_type, key_token))
        return {queue.decode(): mode.decode() for queue, mode in follow_ups.items()}

    def rate_followed(self, task_type: str, key_token: str | None, queue: str, mode: str, since_us: int) -> bool:
        """Take `queue` off the list once its tasks followed in `mode` by a scan begun at `since_us` (server clock).

        False if it was listed again meanwhile.
        """
        keys = self._limiter_keys(task_type, key_token)
        return bool(self._script("rate_followed", keys, [queue, mode, since_us]))

    def rate_follower(self, task_type: str, key_token: str | None, token: str, hold_ms: int) -> bool:
        """Take or keep (`hold_ms` > 0) or give back (0) the lease of following a limiter's change."""
        return bool(self._script("rate_follower", [self.keys.rate_follower(task_type, key_token)], [token, hold_ms]))

    def bring_forward(self, queue: str, due_ms: Mapping[bytes, int]) -> int:
        """Make delayed members of `queue` due at the given ms, never later; how many moved.

        XX: a task promoted or claimed meanwhile is not added back.
        """
        if not due_ms:
            return 0
        return int(self.client.zadd(self.keys.delayed(queue), dict(due_ms), xx=True, lt=True, ch=True))

    def _limiter_keys(self, task_type: str, key_token: str | None) -> list[str]:
        keys = self.keys
        return [
            keys.rate(task_type, key_token),
            keys.rate_queues(task_type, key_token),
            keys.rate_follow_ups(task_type, key_token),
        ]
