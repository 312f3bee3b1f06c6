"""The one way tasks are enqueued: validation, encoding and a single round trip to Redis."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from time import monotonic  # not time.monotonic: tests replace this module's `time` to skew its clock
from typing import Any, NamedTuple, cast

from django.conf import settings
from redis.exceptions import RedisError

import tasks_app.metrics as metrics  # not `from tasks_app`: the package re-exports workflows, which use this module
import tasks_app.tracing as tracing
from tasks_app.models import TaskType
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import (
    MAX_JSON_DEPTH,
    PRIORITY_MAX,
    PRIORITY_MIN,
    Task,
    argument_problem,
    encode_arguments,
    encode_task,
    is_utf8_encodable,
    payload_of,
)
from tasks_app.protocol.enqueue import Enqueueable, UniqueEnqueueable
from tasks_app.protocol.keys import InvalidName, validate_name
from tasks_app.protocol.records import ms_of_datetime
from tasks_app.registry import Registry, registry as default_registry
from tasks_app.task_types import TaskTypeConfig, UnknownTaskType, recent_task_types


class EnqueueError(ValueError):
    """A request to enqueue that was rejected before anything reached Redis."""


class TaskTypeDisabled(EnqueueError):
    """The task type is disabled: nothing of it may be enqueued until it is enabled again."""

    def __init__(self, message: str, queue: str) -> None:
        super().__init__(message)
        self.queue = queue  # the type's queue, where its tasks would have gone


class QueueUnavailable(RuntimeError):
    """Redis could not take the tasks (unreachable, or refusing writes)."""


@dataclass(frozen=True)
class TaskRequest:
    """One task to enqueue, as a caller describes it."""

    type: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int = 0
    delay_s: float = 0.0
    run_after: datetime | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    task_id: str | None = None
    # True: `task_id` was just made (as a backend issuing ids does), so it is pushed unchecked like a generated
    # id. False: the caller's id, a retry of which is a duplicate.
    fresh_id: bool = False
    # Unique task types: what makes two tasks the same (default: the type, args and kwargs).
    unique_key: str | None = None
    # A workflow's step: True, it gets only its own arguments, not the steps' before it (`tasks_app.workflows`).
    immutable: bool = False


class EnqueuedTask(NamedTuple):
    """What was pushed: the task id and where and when it will run (a tuple: built per task, fast)."""

    id: str
    type: str
    queue: str
    priority: int
    enqueued_at_ms: int
    run_after_ms: int
    # Nothing was pushed: a unique type's task is enqueued within its window, or the caller's id is taken
    # (lately, earlier in the call, or by a record of another queue). `id` is that task's.
    duplicate: bool = False


def enqueue(
    type_name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str | None = None,
    priority: int = 0,
    delay_s: float = 0.0,
    run_after: datetime | None = None,
    headers: Mapping[str, str] | None = None,
    count: int = 1,
    unique_key: str | None = None,
    broker: Broker | None = None,
) -> list[EnqueuedTask]:
    """Validate and enqueue `count` tasks of one type in one round trip; return what was pushed."""
    if not _whole_from(count, 1, MAX_BATCH):
        raise EnqueueError(f"count must be an integer from 1 to {MAX_BATCH}, got {count!r}")
    request = TaskRequest(
        type=type_name,
        args=args,
        kwargs={} if kwargs is None else kwargs,
        queue=queue,
        priority=priority,
        delay_s=delay_s,
        run_after=run_after,
        headers=headers or {},
        unique_key=unique_key,
    )
    return enqueue_many([request] * count, broker=broker)


def enqueue_many(
    requests: Sequence[TaskRequest], *, broker: Broker | None = None, registry: Registry = default_registry
) -> list[EnqueuedTask]:
    """Validate every request (at most MAX_BATCH), then enqueue them all in one round trip."""
    if len(requests) > MAX_BATCH:
        raise EnqueueError(f"at most {MAX_BATCH} tasks per call, got {len(requests)}: split the batch")
    return push(prepare(requests, registry=registry), broker=broker)


@dataclass(slots=True)  # not frozen: one per enqueue call, and frozen costs twice as much to build
class PreparedBatch:
    """Validated, encoded tasks ready for one push, in request order, and what `enqueue_many` returns for them."""

    tasks: list[Enqueueable | UniqueEnqueueable]  # a unique type's task is pushed by a script of its own
    enqueued: list[EnqueuedTask]
    result_ttl_s: int
    # Ids of the tasks due at an absolute `run_after`: their delays shrink by the time until the push.
    fixed_due: set[str] = field(default_factory=set)
    prepared_at_s: float = field(default_factory=monotonic)
    # One `send <queue>` span per queue, its context in the headers of the queue's tasks; ended once pushed.
    sends: tracing.Sends = field(default_factory=tracing.Sends)

    def sent(self, error: BaseException | None = None) -> None:
        """End the batch's send spans: its tasks were pushed, or `error` stopped them."""
        self.sends.end(((task.queue, task.id) for task in self.enqueued), error)


def prepare(requests: Sequence[TaskRequest], *, registry: Registry = default_registry) -> PreparedBatch:
    """Validate and encode every request without touching Redis; raise EnqueueError on the first bad one."""
    batch = PreparedBatch([], [], settings.TASKS_RESULT_TTL)
    shapes = _Shapes(registry, int(time.time() * 1000), batch.sends, alike=len(requests) > 1)
    # A request object repeated (as `enqueue(count=N)` does) is validated once; each task costs an id and an encode.
    prepared: dict[int, tuple[TaskRequest, _Prepared]] = {}
    queue_of_id: dict[str, str] = {}  # the queue of each caller's id in the call
    fresh_ids = new_task_ids(len(requests))
    try:
        for request in requests:
            entry = prepared.get(id(request))
            if entry is None or entry[0] is not request:
                entry = prepared[id(request)] = (request, shapes.prepare(request))
            task, delay_ms, record, window_ms = entry[1]
            queue = task.queue
            # One id names one task, and one record: not tasks of two queues.
            if request.task_id and (first := queue_of_id.setdefault(request.task_id, queue)) != queue:
                raise EnqueueError(
                    f"task id {request.task_id!r:.120} is given to tasks of two queues, {first!r} and {queue!r}, in"
                    " one call: a task id names one task"
                )
            task_id = task.id = request.task_id or next(fresh_ids)
            if request.run_after is not None:
                batch.fixed_due.add(task_id)
            checked = bool(request.task_id) and not request.fresh_id  # a caller's id: a retry is a duplicate
            # A generated id: a waiting mark. A caller's id may be asked for its arguments before it starts (as
            # django.tasks' results are): a READY record.
            marked = not request.task_id
            item = Enqueueable(queue, encode_task(task), task.priority, delay_ms, record, task_id, checked, marked)
            batch.tasks.append(UniqueEnqueueable(item, task.unique_digest, window_ms) if window_ms else item)
            batch.enqueued.append(
                EnqueuedTask(task_id, request.type, queue, task.priority, shapes.now_ms, task.run_after_ms)
            )
    except BaseException as exc:  # nothing of the batch goes out
        batch.sends.end([], exc)
        raise
    return batch


def push(batch: PreparedBatch, *, broker: Broker | None = None) -> list[EnqueuedTask]:
    """Push a prepared batch; return what was enqueued (duplicates carry the id of the task enqueued before)."""
    late_ms = int((monotonic() - batch.prepared_at_s) * 1000) if batch.fixed_due else 0

    def due(item: Enqueueable) -> Enqueueable:  # due at an absolute time: its delay counts from now, not `prepare`
        return item._replace(delay_ms=max(0, item.delay_ms - late_ms)) if item.task_id in batch.fixed_due else item

    uniques = [task for task in batch.tasks if isinstance(task, UniqueEnqueueable)]
    items = [t for t in batch.tasks if isinstance(t, Enqueueable)] if uniques else cast(list[Enqueueable], batch.tasks)
    if batch.fixed_due:
        items, uniques = [due(item) for item in items], [u._replace(item=due(u.item)) for u in uniques]
    enqueued = list(batch.enqueued)
    try:
        if batch.tasks:
            pushed = (broker or get_broker()).enqueuer.enqueue(items, batch.result_ttl_s, uniques)
            duplicates = [(index, holder) for index, holder in enumerate(pushed) if holder is not None]
            if duplicates:  # the batch's positions in the order of `pushed`: the plain tasks', then the unique ones'
                tasks = batch.tasks
                in_pushed_order = sorted(range(len(tasks)), key=lambda at: isinstance(tasks[at], UniqueEnqueueable))
            for index, holder in duplicates:
                position = in_pushed_order[index]
                enqueued[position] = enqueued[position]._replace(id=holder, duplicate=True)
                if index >= len(items):
                    metrics.DUPLICATES_REFUSED.labels(enqueued[position].type).inc()
    except RedisError as exc:
        batch.sent(exc)
        partly = "; some may be enqueued: retry with the same task ids" if settings.REDIS_CLUSTER else ""
        raise QueueUnavailable(f"cannot enqueue: Redis did not take the tasks ({exc}){partly}") from exc
    batch.sent()
    return enqueued


def new_task_ids(count: int) -> Iterator[str]:
    """Random (version 4) UUID strings, ~4x faster each than `str(uuid.uuid4())`: `count` of them, or more."""
    while True:
        digits = os.urandom(16 * min(max(count, 1), 256)).hex()
        for at in range(0, len(digits), 32):
            d = digits[at : at + 32]
            yield f"{d[:8]}-{d[8:12]}-4{d[13:16]}-{'89ab'[int(d[16], 16) & 3]}{d[17:20]}-{d[20:]}"


class _Prepared(NamedTuple):
    """A validated request: its task without an id, when it is due, and the record or mark fields its tasks share."""

    task: Task
    delay_ms: int  # from Redis's now (the envelope's run_after_ms, on this producer's clock, is for display only)
    record: dict[str, str]  # a READY record's fields; for a task with a waiting mark, its type and queue
    unique_window_ms: int  # 0: not a unique task


class _Shapes:
    """One call's requests by shape: all they hold but their arguments and id, validated once per shape."""

    # A batch of requests that differ only in their arguments (the common bulk enqueue) costs per task its
    # arguments' JSON and an envelope copied from the first of its shape, not a validation.

    def __init__(self, registry: Registry, now_ms: int, sends: tracing.Sends, *, alike: bool) -> None:
        self.registry, self.now_ms, self.sends = registry, now_ms, sends
        self.alike = alike  # False: a call of one request, whose shape no other shares
        self.configs: dict[str, TaskTypeConfig] = {}
        self.max_payload_bytes: int = settings.TASKS_MAX_PAYLOAD_BYTES
        self._first: dict[tuple[Any, ...], _Prepared] = {}

    def prepare(self, request: TaskRequest) -> _Prepared:
        """Validate and encode `request`, its shape only if it is new to the call."""
        key = _shape(request) if self.alike else None
        try:
            first = self._first.get(key) if key is not None else None
        except TypeError:  # a part that cannot be a key: validated on its own
            key = first = None
        config = self.configs.get(request.type) or _task_type(request.type, self.registry)
        self.configs[request.type] = config
        if request.task_id is not None:
            _check_task_id(request.task_id)
        delay_ms = first.delay_ms if first else _delay_ms(request, self.now_ms)
        args_json, kwargs_json, payload = _encoded_arguments(request, self.max_payload_bytes)
        if first is None:
            task = _task(request, config, delay_ms, payload, self.now_ms)
            self.sends.stamp(task.queue, task.headers)
        else:
            task = Task()
            task.CopyFrom(first.task)
            task.payload = payload
        task.unique_digest = unique_digest(request, config)
        window_ms = config.unique_window_ms if task.unique_digest else 0
        if request.task_id or window_ms:
            record = records.ready_fields_of_json(task, args_json, kwargs_json)
            if window_ms and config.unique_until == TaskType.UniqueUntil.FINISHED:
                record["unique_digest"] = task.unique_digest  # a cancel before it starts frees its key (it ended)
        else:  # a waiting mark: the enqueue writes only these
            record = {"type": task.type, "queue": task.queue}
        prepared = _Prepared(task, delay_ms, record, window_ms)
        if first is None and key is not None:
            self._first[key] = prepared
        return prepared


def _task(request: TaskRequest, config: TaskTypeConfig, delay_ms: int, payload: bytes, now_ms: int) -> Task:
    """The task of a request of a new shape, but its id and uniqueness digest; EnqueueError if refused."""
    queue = config.queue if request.queue is None or request.queue == "" else request.queue  # not `or`: 0 is refused
    try:
        validate_name(queue, "queue")
    except InvalidName as exc:
        raise EnqueueError(str(exc)) from None
    if not _whole_from(request.priority, PRIORITY_MIN, PRIORITY_MAX):
        raise EnqueueError(
            f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}, got {request.priority!r}"
        )
    task = Task(
        type=request.type,
        payload=payload,
        queue=queue,
        priority=request.priority,
        enqueued_at_ms=now_ms,
        run_after_ms=now_ms + delay_ms if delay_ms else 0,
    )
    try:
        for key, value in request.headers.items():
            task.headers[str(key)] = str(value)
    except (AttributeError, ValueError) as exc:  # not a mapping, or a lone surrogate (UnicodeEncodeError)
        raise EnqueueError(f"headers must map names to UTF-8 text: {exc}") from None
    return task


def _shape(request: TaskRequest) -> tuple[Any, ...] | None:
    """What `_Shapes` validates of a request, as a key (which may not hash); None if its headers cannot be one."""
    headers = request.headers
    if type(headers) is not dict or (
        headers and not all(type(k) is str and type(v) is str for k, v in headers.items())
    ):
        return None
    priority, delay_s = request.priority, request.delay_s
    # With the types: True == 1, yet a priority of True is refused and one of 1 is not.
    return (
        request.type,
        request.queue,
        type(priority),
        priority,
        type(delay_s),
        delay_s,
        request.run_after,
        *headers.items(),
    )


# Tasks one call enqueues at most: its script holds Redis meanwhile (about 0.2-0.4 s for this many),
# and a larger batch would stall every client of the server; split larger batches into calls.
MAX_BATCH = 10_000
MAX_UNIQUE_KEY_CHARS = 1000
MAX_TASK_ID_CHARS = 200


def _whole_from(value: object, low: int, high: int) -> bool:
    """Whether `value` is an int (not a bool) from `low` to `high`."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_task_id(task_id: str) -> None:
    """Refuse a caller's task id that is not 1 to MAX_TASK_ID_CHARS characters of UTF-8 text without "/"."""
    if not (isinstance(task_id, str) and 1 <= len(task_id) <= MAX_TASK_ID_CHARS and is_utf8_encodable(task_id)):
        raise EnqueueError(f"task_id must be 1 to {MAX_TASK_ID_CHARS} characters of UTF-8 text, got {task_id!r:.120}")
    # Its task page and API URL could not name it; a control character (NUL) no PostgreSQL text holds.
    if "/" in task_id or task_id in {".", ".."} or any(ord(char) < 32 or 127 <= ord(char) < 160 for char in task_id):
        raise EnqueueError(
            f"task_id cannot contain '/' or control characters, nor be '.' or '..', got {task_id!r:.120}"
        )


def unique_digest(request: TaskRequest, config: TaskTypeConfig) -> str:
    """The digest naming a unique task's key: of its type and `unique_key`, or of its type and arguments."""
    key = request.unique_key
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= MAX_UNIQUE_KEY_CHARS):
        raise EnqueueError(f"unique_key must be a string of 1 to {MAX_UNIQUE_KEY_CHARS} characters")
    if not config.unique_for_s:
        if key is not None:
            raise EnqueueError(f"unique_key given, but task type {request.type!r} is not unique (no unique_for_s)")
        return ""
    if key is None:
        arguments = json.dumps([list(request.args), dict(request.kwargs)], sort_keys=True, separators=(",", ":"))
        identity = "a\x00" + arguments
    else:
        identity = "k\x00" + key
    data = f"{request.type}\x00{identity}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:32]


def _task_type(name: str, registry: Registry) -> TaskTypeConfig:
    try:
        validate_name(name, "task type")
        config = recent_task_types.get(name, registry, settings.TASKS_CONFIG_REFRESH_S)
    except (InvalidName, UnknownTaskType) as exc:
        raise EnqueueError(str(exc)) from None
    if not config.enabled:
        raise TaskTypeDisabled(f"task type {name!r} is disabled", config.queue)
    if registry.get(config.handler) is None:
        raise EnqueueError(f"task type {name!r} uses handler {config.handler!r}, which is not registered")
    return config


def _encoded_arguments(request: TaskRequest, max_payload_bytes: int) -> tuple[str, str, bytes]:
    """The JSON texts of the request's args and kwargs ("" when empty) and its payload; EnqueueError if refused."""
    args, kwargs = request.args, request.kwargs
    if type(args) not in (list, tuple) and (isinstance(args, (str, bytes, Mapping)) or not isinstance(args, Sequence)):
        raise EnqueueError("args must be a JSON array")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise EnqueueError("kwargs must be a JSON object with string keys")
    try:
        args_json, kwargs_json = encode_arguments(args, kwargs)
        payload = payload_of(args_json, kwargs_json)
    except (TypeError, ValueError) as exc:
        raise EnqueueError(f"arguments must be JSON-serializable: {exc}") from None
    except RecursionError:
        raise EnqueueError(f"arguments may nest at most {MAX_JSON_DEPTH} levels") from None
    # Checked once encoded: the encoder has refused cycles, which this walk would follow forever.
    problem = argument_problem(args, args_json) or argument_problem(
        kwargs if type(kwargs) is dict else dict(kwargs), kwargs_json
    )
    if problem:
        raise EnqueueError(problem)
    if len(payload) > max_payload_bytes:
        raise EnqueueError(f"payload is {len(payload)} bytes, over the limit of {max_payload_bytes}")
    return args_json, kwargs_json, payload


def _delay_ms(request: TaskRequest, now_ms: int) -> int:
    """How long from now (ms) the task waits: Redis scores it on its own clock, not this one."""
    delay_s, max_delay_s = request.delay_s, settings.TASKS_MAX_DELAY_S
    # Compared, not math.isfinite(): that raises OverflowError for an int past the floats.
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not 0 <= delay_s < math.inf:
        raise EnqueueError(f"delay must be a non-negative number of seconds, got {delay_s!r}")
    if delay_s > max_delay_s:
        raise EnqueueError(f"delay must be at most {max_delay_s} seconds (TASKS_MAX_DELAY_S), got {delay_s!r}")
    if request.run_after is None:
        return int(delay_s * 1000)
    if not isinstance(request.run_after, datetime):
        raise EnqueueError(f"run_after must be a datetime, got {request.run_after!r}")
    if request.run_after.utcoffset() is None:  # a tzinfo without an offset is naive too
        raise EnqueueError("run_after must be timezone-aware")
    delay_ms = ms_of_datetime(request.run_after) - now_ms
    if delay_ms > max_delay_s * 1000:
        raise EnqueueError(f"run_after must be at most {max_delay_s} seconds (TASKS_MAX_DELAY_S) from now")
    return max(0, delay_ms)
