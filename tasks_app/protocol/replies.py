"""What result writes take and record reads return: result updates, record fields as text, stored numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

# The fields a READY record may leave out, and the value each then has; the id is the key's suffix.
# The producer stores only what differs (see results.ready_fields); get_result fills these back in.
READY_RECORD_DEFAULTS = {"status": "READY", "priority": "0", "args": "[]", "kwargs": "{}", "attempts": "0"}


def stored_int(raw: bytes | str | int | None) -> int | None:
    """A whole number our own scripts or commands stored (INCRBY, HSET, JSON); None for an absent key or field."""
    return None if raw is None else int(raw)


def json_object(raw: bytes) -> dict[str, Any]:
    """Parse a consumer's info as it registered it ("": none)."""
    return json.loads(raw) if raw else {}


def record_text_fields(task_id: str, record: dict[bytes, bytes] | Exception) -> dict[str, str] | None:
    """A result hash (HGETALL's reply) as text fields with the defaults filled in; None if there is none."""
    if isinstance(record, redis.ResponseError) and str(record).startswith("WRONGTYPE"):
        return None  # a key a producer wrote as another type under the record's name is no record (as cancel.lua)
    if isinstance(record, Exception):
        raise record
    if not record:
        return None
    # Bytes a foreign producer wrote need not be UTF-8: shown with escapes, never an error.
    fields = {
        key.decode(errors="backslashreplace"): value.decode(errors="backslashreplace") for key, value in record.items()
    }
    # The key names the task: an `id` field naming another (a foreign writer's) must not send a cancel there.
    return {**READY_RECORD_DEFAULTS, **fields, "id": task_id}


Holder = tuple[tuple[str, str], bytes]
"""The task whose run wrote a result: its (queue, consumer) processing list and its bytes as claimed."""


# Not frozen: several are built per run, and a frozen dataclass costs four times as much to build.
@dataclass(slots=True)
class ResultUpdate:
    """Fields to set on a task's result record, and items to append to its JSON lists."""

    task_id: str
    fields: dict[str, str]
    ttl_s: int
    append_worker_id: str | None = None
    append_error: dict[str, str] | None = None
    # Fencing token of the run this update belongs to (0: not of a run, written unconditionally);
    # ignored once a run with a higher token wrote to the record.
    fence: int = 0
    # Not written to the record: where the history index and the charts file the update.
    queue: str = ""
    task_type: str = ""
    run_s: float | None = None  # how long the run took, for the duration charts
    # Nor this: the task whose ack this write goes with, on one server written only while its
    # consumer holds it (see Broker.ack_many_reporting).
    held_by: Holder | None = None
