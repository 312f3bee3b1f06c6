"""Result records: what the producer and the consumer write about a task, and how it reads back."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from django.tasks import TaskResultStatus

from tasks_app.exceptions import ResultNotJson, ResultTooLarge
from tasks_app.protocol.codec import Arguments, Task, compact_json, finite, is_utf8_encodable, loads_bounded, scrub_text
from tasks_app.protocol.scripts import reply_text


def datetime_of_ms(ms: float) -> datetime | None:
    """Return epoch ms as a UTC datetime to the µs; None beyond the calendar (a producer's nanosecond score)."""
    try:
        whole_ms = math.floor(ms)
        moment = datetime.fromtimestamp(whole_ms // 1000, tz=UTC)
        return moment + timedelta(milliseconds=whole_ms % 1000, microseconds=round((ms - whole_ms) * 1000))
    except (OverflowError, OSError, ValueError):
        return None


# The largest whole ms a score is read as: a producer's +inf must not overflow int().
MAX_SCORE_MS = 2**63 - 1


def ms_of_score(score: float) -> int:
    """A sorted-set score read as whole epoch ms, an infinite one as the end of the range (never an error)."""
    if math.isfinite(score):
        return int(score)
    return MAX_SCORE_MS if score > 0 else -MAX_SCORE_MS


def ms_of_datetime(moment: datetime) -> int:
    """Return a timezone-aware datetime as epoch milliseconds."""
    return int(moment.timestamp() * 1000)


def now_ms() -> float:
    """The clock as epoch milliseconds with microseconds in the fraction."""
    return time.time_ns() // 1000 / 1000


def ms_text(ms: float) -> str:
    """Epoch ms as a record stores it: a whole number as is, else with its microseconds ("...123.456")."""
    return str(ms) if isinstance(ms, int) else f"{ms:.3f}"


# The fields a READY record may leave out, and the value each then has (get_result fills them in).
READY_RECORD_DEFAULTS = {"status": "READY", "priority": "0", "args": "[]", "kwargs": "{}", "attempts": "0"}


def record_text_fields(task_id: str, record: dict[bytes, bytes] | Exception) -> dict[str, str] | None:
    """A result hash (HGETALL's reply) as text fields with the defaults filled in; None if there is none."""
    if isinstance(record, redis.ResponseError) and str(record).startswith("WRONGTYPE"):
        return None  # a key a producer wrote as another type under the record's name is no record (as cancel.lua)
    if isinstance(record, Exception):
        raise record
    if not record:
        return None
    # A producer's bytes need not be UTF-8; the key, not an `id` field, names the task.
    fields = {reply_text(key): reply_text(value) for key, value in record.items()}
    return {**READY_RECORD_DEFAULTS, **fields, "id": task_id}


# Not frozen: several are built per run, and a frozen dataclass costs four times as much to build.
@dataclass(slots=True)
class ResultUpdate:
    """Fields to set on a task's result record, and items to append to its JSON lists."""

    task_id: str
    fields: dict[str, str]
    ttl_s: int
    append_worker_id: str | None = None
    append_error: dict[str, str] | None = None
    # Fencing token of its run (0: none, written unconditionally); ignored once a higher one wrote.
    fence: int = 0
    # Not written: where the history index and the charts file the update, and the run's duration.
    queue: str = ""
    task_type: str = ""
    run_s: float | None = None
    # Nor this: the (queue, consumer) list and claimed bytes of the task whose settle this write goes
    # with; on one server written only while its consumer holds it (see Queue.ack_many_reporting).
    held_by: tuple[tuple[str, str], bytes] | None = None


READY = TaskResultStatus.READY.value
RUNNING = TaskResultStatus.RUNNING.value
SUCCESSFUL = TaskResultStatus.SUCCESSFUL.value
FAILED = TaskResultStatus.FAILED.value
# Not one of Django's statuses: django.tasks reads it as FAILED with a TaskCancelled error.
CANCELLED = "CANCELLED"
FINISHED = {SUCCESSFUL, FAILED, CANCELLED}
# What record_result answers when a run's first write finds the task cancelled: it must not start.
START_REFUSED = 2
# What claim_receipts and record_result answer when a later claim's token is on the record.
SUPERSEDED = 0
# Set by a claim's receipt (claim_receipts.lua) to its fencing token; empty while no consumer holds the task.
CLAIMED_FENCE = "claimed_fence"
# What claim_receipts answers for a held task whose record it found (its RUNNING write omits the enqueue fields).
RECEIPT_OF_RECORD = 1
# What it answers for one whose record it created, or an earlier receipt did: fences, queue and type alone.
RECEIPT_OF_BARE_RECORD = 3

# The fields a record may hold that only its own page and the API show: megabytes each, at most.
WHOLE_RECORD_FIELDS = ("args", "kwargs", "return_value")
# The fields of a record that a list of tasks reads and shows (all but WHOLE_RECORD_FIELDS).
LISTED_FIELDS = (
    *("id", "type", "queue", "status", "priority", "attempts", "max_attempts", "worker_ids", "errors"),
    *("enqueued_at_ms", "run_after_ms", "started_at_ms", "last_attempted_at_ms", "finished_at_ms"),
    *("dead_reason", "cancelled_by", "cancelled_at_ms", "cancel_requested_at_ms", "progress"),
    *("retry_of", "periodic", "retried_as", "workflow", "workflow_path"),
)

# What a cut text ends with, so that a reader sees it was cut.
TRUNCATED_MARK = "... [truncated]"


def _json(value: Any) -> str:
    text = compact_json(value)
    if is_utf8_encodable(text):
        return text
    # Lone surrogates (a payload's "\ud800") cannot be sent as UTF-8: escaped.
    return compact_json(value, ensure_ascii=True)


def result_json(value: Any, max_bytes: int) -> str:
    """Serialize a handler's return value for its record, failing the run if it cannot be stored."""
    try:
        text = compact_json(value, allow_nan=False)
    except BaseException as exc:  # the value's own code may raise anything (RecursionError, SystemExit)
        raise ResultNotJson(f"return value is not JSON-serializable: {describe_error(exc)}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ResultNotJson(
            f"return value holds text that is not valid Unicode (a lone surrogate, as "
            f"surrogateescape decoding leaves): {exc.object[exc.start : exc.end]!a}"
        ) from None
    if size > max_bytes:
        raise ResultTooLarge(f"return value is {size} bytes of JSON, over TASKS_MAX_RESULT_BYTES ({max_bytes})")
    return text


def describe_error(error: BaseException) -> str:
    """The message of an exception, even one whose __str__ fails."""
    try:
        return str(error)
    except BaseException:  # its __str__ is the failing code's own: it may raise anything, SystemExit too
        return f"<{type(error).__name__} whose message cannot be shown>"


def clean_text(text: str, max_bytes: int) -> str:
    """Make error text storable: lone surrogates shown as backslash escapes, cut to `max_bytes` of UTF-8."""
    data = text.encode("utf-8", errors="backslashreplace")
    if len(data) > max_bytes:
        keep_bytes = max(0, max_bytes - len(TRUNCATED_MARK))
        return data[:keep_bytes].decode("utf-8", errors="ignore") + TRUNCATED_MARK
    return data.decode("utf-8")


def enqueued_fields(task: Task, arguments: Arguments) -> dict[str, str]:
    """Every field of a READY record: what a run's first write or a requeue sets."""
    return {**READY_RECORD_DEFAULTS, "id": task.id, **ready_fields(task, arguments)}


def ready_fields(task: Task, arguments: Arguments) -> dict[str, str]:
    """A READY record's fields but the id and those at their default: what readers cannot fill in."""
    args_json = _json(arguments.args) if arguments.args else ""
    kwargs_json = _json(arguments.kwargs) if arguments.kwargs else ""
    return ready_fields_of_json(task, args_json, kwargs_json)


# Headers a READY record keeps as fields of the same name: a retry's original, the periodic schedule, the workflow.
RETRY_OF_HEADER = "retry_of"
PERIODIC_HEADER = "periodic"
WORKFLOW_HEADER = "workflow"
WORKFLOW_PATH_HEADER = "workflow_path"
RECORDED_HEADERS = (RETRY_OF_HEADER, PERIODIC_HEADER, WORKFLOW_HEADER, WORKFLOW_PATH_HEADER)


def ready_fields_of_json(task: Task, args_json: str, kwargs_json: str) -> dict[str, str]:
    """A READY record's fields but the id and those at their default (~115 B saved per task); JSON texts given."""
    fields = {"type": task.type, "queue": task.queue, "enqueued_at_ms": str(task.enqueued_at_ms)}
    if task.priority:
        fields["priority"] = str(task.priority)
    if args_json:
        fields["args"] = args_json
    if kwargs_json:
        fields["kwargs"] = kwargs_json
    if task.run_after_ms:
        fields["run_after_ms"] = str(task.run_after_ms)
    for header in RECORDED_HEADERS:
        if header in task.headers:
            fields[header] = task.headers[header]
    return fields


def started(
    task: Task,
    arguments: Arguments,
    worker_id: str,
    now_ms: float,
    max_attempts: int,
    ttl_s: int,
    fence: int,
    *,
    receipt: int | None = None,
) -> ResultUpdate:
    """The update claiming the record for the run holding `fence`, with the enqueue fields its record lacks.

    `receipt`: what the claim's receipt answered (None: none was written, the record may hold anything).
    """
    if receipt == RECEIPT_OF_RECORD:
        fields = {}
    elif receipt == RECEIPT_OF_BARE_RECORD:  # the defaults and the id are what readers fill in
        fields = ready_fields(task, arguments)
    else:
        fields = enqueued_fields(task, arguments)
    fields |= {"status": RUNNING, "attempts": str(task.attempt), "max_attempts": str(max_attempts)}
    fields["last_attempted_at_ms"] = ms_text(now_ms)
    if task.attempt == 1:
        fields["started_at_ms"] = ms_text(now_ms)
    return ResultUpdate(
        task.id, fields, ttl_s, append_worker_id=worker_id, fence=fence, queue=task.queue, task_type=task.type
    )


def succeeded(
    task: Task, return_value_json: str, now_ms: float, ttl_s: int, fence: int, run_s: float | None = None
) -> ResultUpdate:
    """The update written when a run returns (ignored if a run with a later fence took the record)."""
    fields = {
        "status": SUCCESSFUL,
        "finished_at_ms": ms_text(now_ms),
        "return_value": return_value_json,
        "attempts": str(task.attempt),
    }
    return ResultUpdate(task.id, fields, ttl_s, fence=fence, queue=task.queue, task_type=task.type, run_s=run_s)


def attempt_failed(
    task: Task,
    error: dict[str, str],
    now_ms: float,
    ttl_s: int,
    *,
    final: bool,
    retry_at_ms: int | None = None,
    dead_reason: str = "",
    fence: int = 0,
    run_s: float | None = None,
) -> ResultUpdate:
    """The update written when an attempt fails: READY again if it will be retried, else FAILED."""
    fields = {"attempts": str(task.attempt)}
    if final:
        fields.update({"status": FAILED, "finished_at_ms": ms_text(now_ms)})
        if dead_reason:
            fields["dead_reason"] = dead_reason
    else:
        fields.update({"status": READY, "run_after_ms": str(retry_at_ms or int(now_ms))})
    return ResultUpdate(
        task.id, fields, ttl_s, append_error=error, fence=fence, queue=task.queue, task_type=task.type, run_s=run_s
    )


def receipt_withdrawn(task: Task, fence: int, ttl_s: int) -> ResultUpdate:
    """Written when a claimed task goes back to wait unstarted (deferred): a cancel then cancels it outright."""
    return ResultUpdate(task.id, {CLAIMED_FENCE: ""}, ttl_s, fence=fence, queue=task.queue)


def start_undone(task: Task, fence: int, ttl_s: int) -> ResultUpdate:
    """Written when a run whose start was recorded goes back to wait before its handler began (READY, no attempt)."""
    fields = {"status": READY, "attempts": str(max(task.attempt - 1, 0)), CLAIMED_FENCE: ""}
    if task.attempt <= 1:  # it has never run: no start to show
        fields.update({"started_at_ms": "", "last_attempted_at_ms": ""})
    return ResultUpdate(task.id, fields, ttl_s, fence=fence, queue=task.queue, task_type=task.type)


def dropped_cancelled(task: Task, ttl_s: int, fence: int) -> ResultUpdate:
    """Written when a consumer drops a cancelled task unrun: it has left its queue, its record may be deleted."""
    fields = {"status": CANCELLED, "cancelled_waiting": ""}
    return ResultUpdate(task.id, fields, ttl_s, fence=fence, queue=task.queue, task_type=task.type)


def cancelled(task: Task, now_ms: int, ttl_s: int, fence: int) -> ResultUpdate:
    """The update written when a handler stopped on a cancel request (raised TaskCancelled)."""
    fields = {"status": CANCELLED, "finished_at_ms": str(now_ms), "attempts": str(task.attempt)}
    return ResultUpdate(task.id, fields, ttl_s, fence=fence, queue=task.queue, task_type=task.type)


def error_record(exception_class_path: str, traceback_text: str) -> dict[str, str]:
    """An entry of a record's errors list, shaped like django.tasks' TaskError."""
    return {"exception_class_path": exception_class_path, "traceback": traceback_text}


# Where times beyond the calendar are clamped (a day inside it, so any time zone can show them).
_LATEST = datetime(9999, 12, 30, tzinfo=UTC)
_EARLIEST = datetime(1, 1, 2, tzinfo=UTC)


def _ms_to_datetime(value: str | None) -> datetime | None:
    """A record's milliseconds as a UTC datetime; clamped to the calendar, None if not a number."""
    try:
        ms = float(value or "")
    except ValueError:
        return None
    if math.isnan(ms):
        return None
    return datetime_of_ms(ms) or (_LATEST if ms > 0 else _EARLIEST)


def _int(value: str | None, default: int | None = 0) -> int | None:
    try:
        return int(value) if value else default
    except ValueError:
        return default


def _parsed(value: str | None, expected: type, default: Any) -> Any:
    """A JSON field of the record, or `default` when it is absent, invalid, too deep or not `expected`."""
    if not value:
        return default
    try:
        parsed = scrub_text(loads_bounded(value))
    except ValueError:
        return default
    return parsed if isinstance(parsed, expected) else default


# The record's fields read as text; of these, the links to other things are null in JSON when empty.
_LINK_FIELDS = ("retry_of", "periodic", "retried_as", "workflow", "workflow_path")
_TEXT_FIELDS = ("id", "type", "queue", "dead_reason", "cancelled_by", *_LINK_FIELDS)
_TIME_FIELDS: tuple[str, ...] = ("enqueued_at", "run_after", "started_at", "last_attempted_at", "finished_at")
_TIME_FIELDS += ("cancelled_at", "cancel_requested_at")


@dataclass(frozen=True)
class ResultRecord:
    """A task's result record as read back from Redis."""

    id: str
    type: str
    queue: str
    status: str
    priority: int = 0
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    max_attempts: int | None = None
    enqueued_at: datetime | None = None
    run_after: datetime | None = None
    started_at: datetime | None = None
    last_attempted_at: datetime | None = None
    finished_at: datetime | None = None
    return_value: Any = None
    has_return_value: bool = False
    worker_ids: list[str] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    dead_reason: str = ""
    cancelled_by: str = ""
    cancelled_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    progress: dict[str, Any] | None = None
    retry_of: str = ""  # the task this one retries (enqueued from the task browser)
    periodic: str = ""  # the periodic schedule that fired this task
    retried_as: str = ""  # the latest retry of this task
    workflow: str = ""  # the workflow this task belongs to (`tasks_app.workflows`)
    workflow_path: str = ""  # its place in that workflow's tree

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> ResultRecord:
        """Parse a result hash as `get_result` reads it (escaped text); a field that does not parse reads as not set."""
        errors = _parsed(raw.get("errors"), list, [])
        return_text = raw.get("return_value")
        values: dict[str, Any] = {name: raw.get(name, "") for name in _TEXT_FIELDS}
        values |= {name: _ms_to_datetime(raw.get(f"{name}_ms")) for name in _TIME_FIELDS}
        return cls(
            **values,
            status=raw.get("status") or READY,
            priority=_int(raw.get("priority")) or 0,
            args=_parsed(raw.get("args"), list, []),
            kwargs=_parsed(raw.get("kwargs"), dict, {}),
            attempts=_int(raw.get("attempts")) or 0,
            max_attempts=_int(raw.get("max_attempts"), None),
            return_value=_parsed(return_text, object, return_text) if return_text is not None else None,
            has_return_value=return_text is not None,
            worker_ids=[str(item) for item in _parsed(raw.get("worker_ids"), list, [])],
            errors=[{str(k): str(v) for k, v in item.items()} for item in errors if isinstance(item, dict)],
            progress=_parsed(raw.get("progress"), dict, None),
        )

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict, as the API returns it (a foreign payload's NaN as null: strict readers refuse NaN)."""
        fields: dict[str, Any] = {}
        for name in (f.name for f in dataclasses.fields(self) if f.name != "has_return_value"):
            value = getattr(self, name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif name in _LINK_FIELDS:
                value = value or None
            fields[name] = value
        return {name: finite(value) for name, value in fields.items()}
