"""Pausing a queue: while its paused key exists, claims of it are refused (lua/claim.lua); enqueues go on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tasks_app.protocol.replies import stored_int
from tasks_app.protocol.scripts import ScriptClient


class PauseOps(ScriptClient):
    """Pause and resume queues, and read whether they are."""

    def pause(self, queue: str, by: str = "") -> bool:
        """Pause `queue` (kept in Redis, so it survives consumer restarts); False if it already was."""
        seconds, micros = self.client.time()
        state = json.dumps({"since_ms": int(seconds) * 1000 + int(micros) // 1000, "by": by})
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.paused(queue), state, nx=True)
        self.queue_announce(pipe, [queue])
        created, _ = self.scripts.execute(pipe, self.client)
        return bool(created)

    def resume(self, queue: str) -> bool:
        """Resume `queue`; False if it was not paused. Claimers see it at their next pause re-check."""
        return bool(self.client.delete(self.keys.paused(queue)))

    def is_paused(self, queue: str) -> bool:
        """True while `queue` is paused."""
        return bool(self.client.exists(self.keys.paused(queue)))

    def pause_states(self, queues: Sequence[str]) -> dict[str, dict[str, Any] | None]:
        """Per queue, its pause state ({"since_ms", "by"}) or None when it runs."""
        if not queues:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            pipe.get(self.keys.paused(queue))
        return {queue: _state(raw) for queue, raw in zip(queues, pipe.execute(), strict=True)}


def _state(raw: bytes | None) -> dict[str, Any] | None:
    """A paused key's state as we write it: `since_ms` an integer or None, `by` text."""
    if raw is None:
        return None
    state = json.loads(raw) if raw else {}
    return {"since_ms": stored_int(state.get("since_ms")), "by": state.get("by") or ""}
