"""Tasks deferred while their type is disabled: noted as they are deferred, made due at once when it is enabled.

Without the note, a disabled type's backlog is claimed and deferred again at every recheck, at a
cost in proportion to the backlog (a million tasks every few seconds starve the queue's other
types); with it, the recheck can be long, and enabling the type still brings its tasks back at once.
"""

from __future__ import annotations

from collections.abc import Callable

from tasks_app.protocol.keys import delayed_member
from tasks_app.protocol.scripts import ScriptClient

# Members taken from a type's set per call of wake_enabled.
WAKE_BATCH = 1000


class DisabledOps(ScriptClient):
    """Noting the tasks a disabled type deferred, and waking them once it is enabled."""

    def note_disabled(self, queue: str, task_type: str, priority: int, raw: bytes, ttl_ms: int) -> None:
        """Note `raw`, just deferred on `queue` because `task_type` is disabled."""
        keys = [self.keys.disabled_types(queue), self.keys.disabled(queue, task_type)]
        self._script("note_disabled", keys, [task_type, delayed_member(priority, raw), ttl_ms])

    def wake_enabled(self, queue: str, disabled: Callable[[str], bool]) -> int:
        """Make due now the noted tasks of `queue` whose types are no longer `disabled`; how many were still delayed.

        A name in the set that is not UTF-8 names no type: its tasks are woken too.
        """
        woken, types_key = 0, self.keys.disabled_types(queue)
        names = self.client.smembers(types_key)
        for name in names:
            task_type = name.decode(errors="replace")
            if disabled(task_type):
                continue
            keys = [types_key, self.keys.disabled(queue, task_type), self.keys.delayed(queue)]
            taken = WAKE_BATCH
            while taken == WAKE_BATCH:
                taken, due = self._script("wake_enabled", keys, [name, WAKE_BATCH])
                woken += due
        return woken
