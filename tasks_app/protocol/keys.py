"""Every Redis key of the protocol, built in `Keys`, the encodings of members, and the rule for names."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Pushed onto an empty pending list to wake a consumer blocked on it; never a valid Task
# (field number 0 does not exist in protobuf), dropped wherever it is met.
WAKE_TOKEN = b"\x00wake"


def waiting_mark_value(queue: str, task_type: str) -> str:
    """The value of a waiting task's mark: its queue and type, a space between (names never hold one)."""
    return f"{queue} {task_type}"


def split_waiting_mark(value: bytes) -> tuple[str, str]:
    """The queue and type a waiting mark's value names."""
    queue, _, task_type = value.decode(errors="backslashreplace").partition(" ")
    return queue, task_type


# Type of the envelope that wraps bytes that are not a task in the dead letters (as the executor's).
UNDECODABLE_TYPE = "_undecodable"


def delayed_member(priority: int, raw: bytes) -> bytes:
    """Encode a delayed-set member: the priority (clamped to -100..100) as 4 ASCII characters, then the task."""
    return f"{max(-100, min(100, int(priority))):+04d}".encode() + raw


_DELAYED_PREFIX = re.compile(rb"[+-][0-9]{3}")


def split_delayed_member(member: bytes) -> tuple[int, bytes] | None:
    """Split a delayed-set member into its priority and the serialized task; None if it is not one."""
    prefix = member[:4]
    if not _DELAYED_PREFIX.fullmatch(prefix) or len(member) == 4 or abs(int(prefix)) > 100:
        return None
    return int(prefix), member[4:]


def _queue_key(name: str) -> Callable[[Keys, str], str]:
    """The method of `Keys` building a queue's key `name`."""

    def key(self: Keys, queue: str) -> str:
        return self.queue_key(queue, name)

    return key


@dataclass(frozen=True)
class Keys:
    """Builds every Redis key (docs/PROTOCOL.md, "Keys"); queue keys share the queue's hash tag."""

    prefix: str

    def queue_key(self, queue: str, name: str) -> str:
        """Return the key `name` of `queue`, e.g. ``ts:{default}:pending``."""
        return f"{self.prefix}:{{{queue}}}:{name}"

    def queue_keys(self, queue: str, names: str, consumer_id: str = "") -> list[str]:
        """The keys of `queue` named in `names` ("pending dead"), in order; "processing", "staging": `consumer_id`'s."""
        of_consumer = {"processing": self.processing, "staging": self.staging}
        return [
            of_consumer[n](queue, consumer_id) if n in of_consumer else self.queue_key(queue, n) for n in names.split()
        ]

    pending = _queue_key("pending")
    prioritized = _queue_key("prioritized")
    delayed = _queue_key("delayed")
    dead = _queue_key("dead")
    enqueued = _queue_key("enqueued")
    consumers = _queue_key("consumers")
    consumer_info = _queue_key("consumer_info")
    reaped = _queue_key("reaped")
    recoveries = _queue_key("recoveries")
    suspects = _queue_key("suspects")
    fence = _queue_key("fence")
    cancel_requests = _queue_key("cancel_requests")
    cancel_forced = _queue_key("cancel_forced")
    history = _queue_key("history")
    history_ids = _queue_key("history:ids")
    disabled_types = _queue_key("disabled_types")
    paused = _queue_key("paused")

    def processing(self, queue: str, consumer_id: str) -> str:
        return self.queue_key(queue, f"processing:{consumer_id}")

    def staging(self, queue: str, consumer_id: str) -> str:
        """Where a blocking claim moves a task, for the script behind it to move on into processing (one server)."""
        return self.queue_key(queue, f"staging:{consumer_id}")

    def completed(self, queue: str, bucket: int) -> str:
        """Counter of tasks acknowledged in one THROUGHPUT_BUCKET_S-long bucket (bucket = epoch s // width)."""
        return self.queue_key(queue, f"completed:{bucket}")

    def unique(self, queue: str, digest: str) -> str:
        return self.queue_key(queue, f"unique:{digest}")

    def history_status(self, queue: str, status: str) -> str:
        return self.queue_key(queue, f"history:{status}")

    def minute(self, queue: str, minute: int) -> str:
        """Hash of `queue`'s chart counters over one minute (minute = epoch s // 60)."""
        return self.queue_key(queue, f"minute:{minute}")

    def periodic(self, queue: str, schedule: str) -> str:
        return self.queue_key(queue, f"periodic:{schedule}")

    def periodic_claim(self, schedule: str) -> str:
        """Slot claim of periodic schedule `schedule`, under a hash tag of its own."""
        return f"{self.prefix}:periodic:{{{schedule}}}"

    def disabled(self, queue: str, task_type: str) -> str:
        return self.queue_key(queue, f"disabled:{task_type}")

    def queues(self) -> str:
        return f"{self.prefix}:queues"

    def turn(self, chore: str, queues: Sequence[str]) -> str:
        """Held by the consumer doing `chore` now for every consumer of exactly `queues` (in any order)."""
        digest = hashlib.sha1("\n".join(sorted(queues)).encode()).hexdigest()[:16]
        return f"{self.prefix}:turn:{chore}:{digest}"

    def leases(self) -> str:
        """Every consumer's latest lease deadline, whatever its queues: what a reaper looks at first (one server)."""
        return f"{self.prefix}:leases"

    def result(self, task_id: str) -> str:
        return f"{self.prefix}:result:{task_id}"

    def waiting(self, bucket: str) -> str:
        """A bucket hash of waiting marks, `bucket` 4 hex digits."""
        return f"{self.prefix}:waiting:{bucket}"

    def waiting_mark(self, task_id: str) -> tuple[str, bytes]:
        """The bucket hash and field of a waiting task's mark (docs/PROTOCOL.md, "Waiting marks")."""
        digest = hashlib.sha1(task_id.encode("utf-8", "surrogatepass"), usedforsecurity=False).digest()
        return self.waiting(digest[:2].hex()), digest[2:10]

    def workflow(self, workflow_id: str) -> list[str]:
        """The keys of one workflow, under a hash tag of its own, in the order of WORKFLOW_KEYS."""
        base = f"{self.prefix}:wf:{{{workflow_id}}}"
        return [base, *(f"{base}:{name}" for name in WORKFLOW_KEYS[1:])]

    def rate(self, task_type: str, key_token: str | None = None) -> str:
        """The GCRA state of a type, or of one value of its `rate_limit_key` (see `limit_key_token`)."""
        return f"{self.prefix}:rate:{{{_limit_tag(task_type, key_token)}}}"

    def running(self, task_type: str, key_token: str | None = None) -> str:
        """Holders of a capped type's (or key value's) slots."""
        return f"{self.prefix}:running:{{{_limit_tag(task_type, key_token)}}}"

    def rate_queues(self, task_type: str, key_token: str | None = None) -> str:
        return f"{self.rate(task_type, key_token)}:queues"

    def rate_follow_ups(self, task_type: str, key_token: str | None = None) -> str:
        return f"{self.rate(task_type, key_token)}:follow_ups"

    def rate_keyed(self, task_type: str) -> str:
        return f"{self.rate(task_type)}:keyed"

    def rate_follower(self, task_type: str, key_token: str | None = None) -> str:
        return f"{self.rate(task_type, key_token)}:follower"

    def running_waiters(self, task_type: str, key_token: str | None = None) -> str:
        return f"{self.running(task_type, key_token)}:waiters"

    def running_waiting(self, task_type: str, key_token: str | None = None) -> str:
        return f"{self.running(task_type, key_token)}:waiting"


# The keys of a workflow (`Keys.workflow`), as its scripts take them (lua/include/workflow.lua).
WORKFLOW_KEYS = ("meta", "nodes", "steps", "starts", "results", "outcomes", "failed", "fired")


def _limit_tag(task_type: str, key_token: str | None) -> str:
    return task_type if key_token is None else f"{task_type}|{key_token}"


# A key value used as it is in a key when it looks like this; any other is hashed.
_PLAIN_KEY_VALUE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MISSING_KEY_TOKEN = "#missing"
# Every token `limit_key_token` returns, and nothing else.


def limit_key_token(kwargs: Mapping[str, Any], name: str) -> str:
    """The part of a keyed limit's key for kwarg `name`'s value: short ones as they are, else "#" and a hash."""
    if name not in kwargs:
        return MISSING_KEY_TOKEN
    value = kwargs[name]
    if isinstance(value, int | str) and not isinstance(value, bool) and _PLAIN_KEY_VALUE.fullmatch(str(value)):
        return str(value)
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
    return "#" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
NAME_RULE = "1-100 characters from A-Z, a-z, 0-9 and _ . : -"


class InvalidName(ValueError):
    """A queue or task type name that breaks the naming rule."""


def validate_name(value: str, what: str = "name") -> str:
    """Return `value` if it is a valid queue or type name, else raise InvalidName."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidName(f"invalid {what} {value!r}: use {NAME_RULE}")
    return value
