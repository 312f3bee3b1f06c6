"""Task and queue control from Python: `tasks_app.cancel(id)`, `tasks_app.cancel_many(ids)` and `set_queue_paused`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

# Re-exported (`X as X`) for the callers that cancel: the replies' outcomes and what cancel() raises.
from tasks_app.exceptions import TaskAlreadyFinished as TaskAlreadyFinished, TaskNotFound as TaskNotFound
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import is_utf8_encodable
from tasks_app.protocol.history import (
    CANCELLED as CANCELLED,
    FINISHED as FINISHED,
    REQUESTED as REQUESTED,
    UNKNOWN,
    CancelReply,
)

logger = logging.getLogger(__name__)

# Longest `cancelled_by` stored (characters).
MAX_CANCELLED_BY_CHARS = 200


def cancel_many(
    task_ids: Sequence[str], *, cancelled_by: str = "", force: bool = False, broker: Broker | None = None
) -> list[CancelReply]:
    """Cancel tasks by id in one round trip (two if some run); never raises for an id: read each reply's outcome."""
    ids = [str(task_id) for task_id in task_ids]
    if not ids:
        return []
    by = cancelled_by[:MAX_CANCELLED_BY_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
    # An id that is not valid Unicode (a lone surrogate: non-UTF-8 bytes on a command line) names no task.
    storable = [task_id for task_id in dict.fromkeys(ids) if is_utf8_encodable(task_id)]
    replies = (broker or get_broker()).control.cancel_many(storable, by, force) if storable else []
    by_id = {reply.task_id: reply for reply in replies}
    return [by_id.get(task_id) or CancelReply(task_id, UNKNOWN, "", "", 0) for task_id in ids]


def cancel(task_id: str, *, cancelled_by: str = "", force: bool = False, broker: Broker | None = None) -> CancelReply:
    """Cancel one task: CANCELLED if it had not started, REQUESTED if it runs; raise if unknown or finished."""
    [reply] = cancel_many([task_id], cancelled_by=cancelled_by, force=force, broker=broker)
    if reply.outcome == UNKNOWN:
        raise TaskNotFound(f"no task {task_id!r} (unknown, or its record has expired)")
    if reply.outcome == FINISHED:
        raise TaskAlreadyFinished(f"task {task_id!r} already finished ({reply.status}): nothing to cancel")
    return reply


def set_queue_paused(queue: str, paused: bool, *, by: str = "", broker: Broker | None = None) -> bool:
    """Pause or resume `queue`, logging a warning when that changes it; False if it already was so."""
    broker = broker or get_broker()
    changed = broker.control.pause(queue, by=by) if paused else broker.control.resume(queue)
    if changed:
        logger.warning("queue %s %s by %s", queue, "paused" if paused else "resumed", by or "an operator")
    return changed
