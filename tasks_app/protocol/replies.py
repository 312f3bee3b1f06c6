"""What broker operations take and return: result updates, claims, reaps, keys to free, ack reports, stats."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

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


@dataclass(frozen=True)
class Claim:
    """What one claim moved into a consumer's processing list."""

    tasks: list[bytes]
    took_suspect: bool  # the first task is a suspect: recovered from a consumer that died holding it
    suspects_waiting: int  # suspects still in the queue's suspects list
    first_fence: int = 0  # fencing token of tasks[0]; tasks[i] holds first_fence + i
    lease_expired: bool = False  # nothing was claimed: the lease lapsed and has not been renewed
    paused: bool = False  # nothing was claimed: the queue is paused


class Promotion(NamedTuple):
    """What one promote_due call did."""

    moved: int
    next_due_ms: int  # -1: nothing delayed
    now_ms: int  # the server's clock
    malformed: int  # due members that were not "<priority><task>", dead-lettered


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


class UniqueRelease(NamedTuple):
    """A uniqueness key that settling a claimed task frees (unique_until = finished), if the task is still held."""

    digest: str
    task_id: str
    after_ms: int = 0  # 0: now; else in that many ms (a process that gave up on a hung run frees it once gone)


Holder = tuple[tuple[str, str], bytes]
"""The task whose run wrote a result: its (queue, consumer) processing list and its bytes as claimed."""


class AckReport(NamedTuple):
    """What a batch of result writes and acks did."""

    flags: dict[tuple[str, str], list[bool]]  # per (queue, consumer): whether each task was still held
    refused: dict[int, Exception]  # result writes Redis refused, by index
    unreplicated_masters: int = 0  # Redis Cluster: masters whose replica did not confirm the results in time
    written: tuple[Any, ...] = ()  # each result write's reply (1 written, 0 ignored, 2 refused: cancelled, 3 not held)


@dataclass(frozen=True)
class QueueStats:
    """Sizes of one queue's parts and its live consumers."""

    queue: str
    pending: int
    processing: int
    delayed: int
    dead: int
    consumers: list[dict[str, Any]]
    paused: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "queue": self.queue,
            "pending": self.pending,
            "processing": self.processing,
            "delayed": self.delayed,
            "dead": self.dead,
            "consumers": self.consumers,
        }


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
