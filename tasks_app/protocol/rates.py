"""Rate limits of task types: one decision per task (`rate_limit.lua`), mixed into `Broker`.

docs/PROTOCOL.md ("Rate limits") describes the hash `P:rate:{T}` and the algorithms. When a
decision finds the hash written under another emission interval (the type's limit was changed
in the admin), the script moves the reserved slots to the new spacing and says so; the tasks
holding them are then brought to their new slots by `rate_deferrals.reschedule_deferred`.
"""

from __future__ import annotations

from typing import NamedTuple

from tasks_app.protocol.scripts import ScriptClient


class RateDecision(NamedTuple):
    """One decision: 0 µs to wait (start now) or the wait until the task's slot; whether the slots were rescaled."""

    wait_us: int
    rescaled: bool


class RateOps(ScriptClient):
    """Rate-limit decisions."""

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
    ) -> RateDecision:
        """Decide whether a task of `task_type` (of one key value, if keyed) may start now."""
        args = [algorithm, task_id, limit, period_us, emission_us, tolerance_us]
        wait_us, rescaled = self._script("rate_limit", [self.keys.rate(task_type, key_token)], args)
        return RateDecision(int(wait_us), bool(rescaled))
