"""Validation and encoding on the producer side."""

import uuid
from datetime import UTC, datetime, timedelta, tzinfo

import pytest
from django.db import transaction

from tasks_app.models import TaskType
from tasks_app.producer import EnqueueError, TaskRequest, enqueue, enqueue_many
from tasks_app.protocol.codec import decode_payload, decode_task
from tasks_app.protocol.records import ResultRecord
from tests.support.enqueued import enqueued_keys, waiting_record

pytestmark = pytest.mark.django_db


class NoOffset(tzinfo):
    """A time zone that knows no offset: its datetimes are naive, tzinfo or not."""

    def utcoffset(self, dt: datetime | None) -> None:
        return None

    def localize(self) -> datetime:
        return datetime(2030, 1, 1, tzinfo=self)


def nested(levels: int) -> list:
    """A list `levels` deep: [[...[0]...]]."""
    value: list = [0]
    for _ in range(levels - 1):
        value = [value]
    return value


def test_enqueue_pushes_a_task_and_a_waiting_mark(broker):
    [task] = enqueue("demo.echo", [1, 2], {"k": "v"}, headers={"trace": "abc"})
    [raw] = broker.client.lrange(broker.keys.pending("default"), 0, -1)
    decoded = decode_task(raw)
    assert (decoded.id, decoded.type, decoded.queue, decoded.attempt) == (task.id, "demo.echo", "default", 0)
    assert decode_payload(decoded.payload).args == [1, 2]
    assert dict(decoded.headers) == {"trace": "abc"}
    record = ResultRecord.from_fields(broker.records.get_result(task.id))
    assert (record.status, record.queue, record.type) == ("READY", "default", "demo.echo")
    assert not broker.client.exists(broker.keys.result(task.id))


def test_first_enqueue_of_a_handler_name_creates_its_task_type(broker):
    enqueue("demo.sleep", [0])
    row = TaskType.objects.get(name="demo.sleep")
    assert (row.handler, row.queue, row.max_attempts) == ("demo.sleep", "default", 3)


def test_a_task_type_row_routes_to_its_handler_and_queue(broker):
    TaskType.objects.create(name="billing.invoice", handler="demo.echo", queue="billing")
    [task] = enqueue("billing.invoice")
    assert task.queue == "billing"
    assert broker.client.llen(broker.keys.pending("billing")) == 1


def test_count_enqueues_distinct_tasks_in_one_call(broker):
    tasks = enqueue("demo.echo", count=25)
    assert len({t.id for t in tasks}) == 25
    assert broker.client.llen(broker.keys.pending("default")) == 25


def test_bulk_enqueue_is_all_or_nothing(broker):
    with pytest.raises(EnqueueError):
        enqueue_many([TaskRequest("demo.echo", [1]), TaskRequest("demo.echo", "not a list")])
    assert enqueued_keys(broker) == []


def test_delay_and_run_after_go_to_the_delayed_set(broker):
    enqueue("demo.echo", delay_s=30)
    enqueue("demo.echo", run_after=datetime.now(UTC) + timedelta(minutes=5), priority=4)
    assert broker.client.zcard(broker.keys.delayed("default")) == 2
    assert broker.client.llen(broker.keys.pending("default")) == 0


def test_priority_goes_to_the_prioritized_set(broker):
    enqueue("demo.echo", priority=10)
    assert broker.client.zcard(broker.keys.prioritized("default")) == 1


def test_arguments_nested_64_levels_deep_reach_the_record_whole(broker):
    [task] = enqueue("demo.echo", nested(64), {"k": nested(63)})  # the args array and the kwargs object count
    record = ResultRecord.from_fields(waiting_record(broker, task.id, "default"))
    assert (record.args, record.kwargs) == (nested(64), {"k": nested(63)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"type_name": "no.such.type"}, "unknown task type"),
        ({"type_name": "bad name!"}, "invalid task type"),
        ({"type_name": "demo.echo", "args": {"a": 1}}, "args must be a JSON array"),
        ({"type_name": "demo.echo", "args": "abc"}, "args must be a JSON array"),
        ({"type_name": "demo.echo", "kwargs": [1]}, "kwargs must be a JSON object"),
        ({"type_name": "demo.echo", "args": [object()]}, "JSON-serializable"),
        ({"type_name": "demo.echo", "args": [float("nan")]}, "JSON-serializable"),
        ({"type_name": "demo.echo", "args": nested(65)}, "nest at most 64 levels"),
        ({"type_name": "demo.echo", "kwargs": {"k": nested(64)}}, "nest at most 64 levels"),
        ({"type_name": "demo.echo", "args": [nested(100_000)]}, "nest at most 64 levels"),  # past the encoder's stack
        ({"type_name": "demo.echo", "args": [{1: "a", "1": "b"}]}, "keys must be strings, got 1"),
        ({"type_name": "demo.echo", "kwargs": {"k": [{None: 0}]}}, "keys must be strings, got None"),
        ({"type_name": "demo.echo", "queue": "a b"}, "invalid queue"),
        ({"type_name": "demo.echo", "priority": 101}, "priority must be an integer from -100 to 100"),
        ({"type_name": "demo.echo", "priority": True}, "priority must be an integer"),
        ({"type_name": "demo.echo", "delay_s": -1}, "delay must be a non-negative"),
        ({"type_name": "demo.echo", "delay_s": float("inf")}, "delay must be a non-negative"),
        ({"type_name": "demo.echo", "run_after": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"type_name": "demo.echo", "run_after": NoOffset().localize()}, "timezone-aware"),
        ({"type_name": "demo.echo", "run_after": "2030-01-01T00:00:00Z"}, "run_after must be a datetime"),
        ({"type_name": "demo.echo", "delay_s": 10**400}, "delay must be at most"),
        ({"type_name": "demo.echo", "kwargs": []}, "kwargs must be a JSON object"),
        ({"type_name": "demo.echo", "kwargs": 0}, "kwargs must be a JSON object"),
        ({"type_name": "demo.echo", "headers": {"trace": "\ud800"}}, "headers must map names to UTF-8 text"),
        ({"type_name": "demo.echo", "count": 0}, "count must be an integer from 1 to 10000"),
        ({"type_name": "demo.echo", "count": True}, "count must be an integer from 1 to 10000"),
        ({"type_name": "demo.echo", "count": 10**7}, "count must be an integer from 1 to 10000"),
    ],
)
def test_invalid_requests_are_rejected_before_anything_is_pushed(broker, kwargs, message):
    type_name = kwargs.pop("type_name")
    with pytest.raises(EnqueueError, match=message):
        enqueue(type_name, **kwargs)
    assert enqueued_keys(broker) == []


def test_a_batch_larger_than_one_call_may_hold_is_refused_whole(broker):
    # One script holds Redis while it runs: ten million tasks in one would stall every client for minutes.
    with pytest.raises(EnqueueError, match="at most 10000 tasks per call, got 10001: split the batch"):
        enqueue_many([TaskRequest("demo.echo")] * 10_001)
    assert enqueued_keys(broker) == []


@pytest.mark.parametrize("task_id", [5, "", "x" * 201, "\ud800", b"raw"])
def test_caller_task_ids_that_are_not_short_utf8_text_are_rejected(broker, task_id):
    with pytest.raises(EnqueueError, match="task_id must be 1 to 200 characters"):
        enqueue_many([TaskRequest("demo.echo", task_id="fine"), TaskRequest("demo.echo", task_id=task_id)])
    assert enqueued_keys(broker) == []


@pytest.mark.parametrize("task_id", ["report/7", ".", "..", "a\x00b", "tab\there", "\x85"])
def test_a_caller_task_id_no_url_or_database_text_can_hold_is_rejected(broker, task_id):
    with pytest.raises(EnqueueError, match="task_id cannot contain '/' or control characters"):
        enqueue_many([TaskRequest("demo.echo", task_id=task_id)])
    assert enqueued_keys(broker) == []


def test_one_caller_id_given_to_tasks_of_two_queues_in_one_call_is_refused_naming_it(broker):
    # Its record is one key for both: the second task would take the first one's record over.
    TaskType.objects.create(name="unique.echo", handler="demo.echo", unique_for_s=60)
    for second in ("demo.echo", "unique.echo"):
        batch = [
            TaskRequest("demo.echo", [1], queue="A", task_id="shared"),
            TaskRequest(second, [2], queue="B", task_id="shared"),
        ]
        with pytest.raises(EnqueueError, match="task id 'shared' is given to tasks of two queues, 'A' and 'B'"):
            enqueue_many(batch)
    assert enqueued_keys(broker) == []


def test_disabled_types_and_unregistered_handlers_are_rejected(broker):
    TaskType.objects.create(name="off", handler="demo.echo", enabled=False)
    TaskType.objects.create(name="orphan", handler="gone.handler")
    with pytest.raises(EnqueueError, match="disabled"):
        enqueue("off")
    with pytest.raises(EnqueueError, match="not registered"):
        enqueue("orphan")


def test_oversize_payloads_are_rejected(broker, settings):
    settings.TASKS_MAX_PAYLOAD_BYTES = 100
    with pytest.raises(EnqueueError, match="over the limit of 100"):
        enqueue("demo.echo", ["x" * 200])


@pytest.mark.django_db(transaction=True)  # outside a transaction: what is read is kept at once
def test_type_settings_are_cached_between_enqueues_and_local_edits_apply_at_once(broker, django_assert_num_queries):
    row = TaskType.objects.create(name="cached.type", handler="demo.echo", queue="first")
    assert enqueue("cached.type")[0].queue == "first"
    with django_assert_num_queries(0):
        assert enqueue("cached.type")[0].queue == "first"
    row.queue = "second"
    row.save()
    assert enqueue("cached.type")[0].queue == "second"


@pytest.mark.django_db(transaction=True)
def test_a_type_read_in_a_transaction_is_kept_once_it_commits_never_after_a_rollback(broker, django_assert_num_queries):
    for _ in range(2):  # the second read sees the row the first one created
        with transaction.atomic():
            enqueue("demo.echo")
            enqueue("demo.echo")
            transaction.set_rollback(True)
        assert not TaskType.objects.filter(name="demo.echo").exists()
    with transaction.atomic():
        enqueue("demo.echo")
    with django_assert_num_queries(0):
        enqueue("demo.echo")
    assert TaskType.objects.filter(name="demo.echo").exists()


def test_a_mark_and_a_ready_record_store_only_fields_off_their_default_and_read_back_whole(broker, settings):
    [first] = enqueue("demo.echo")
    [plain] = enqueue("demo.echo")  # a known queue: mark and push in one script call
    # A caller's id keeps a READY record (its id is checked against it).
    request = TaskRequest("demo.echo", [1], {"k": "v"}, priority=5, delay_s=60, task_id="full-1")
    [full] = enqueue_many([request])
    for task in (first, plain):
        bucket, mark = broker.keys.waiting_mark(task.id)
        assert broker.client.hget(bucket, mark) == b"default demo.echo"
        assert not broker.client.exists(broker.keys.result(task.id))
    fields = {b"type", b"queue", b"enqueued_at_ms", b"priority", b"args", b"kwargs", b"run_after_ms"}
    assert set(broker.client.hkeys(broker.keys.result(full.id))) == fields
    assert 0 < broker.client.ttl(broker.keys.result(full.id)) <= settings.TASKS_RESULT_TTL + 61
    assert [decode_task(raw).id for raw in broker.client.lrange(broker.keys.pending("default"), 0, -1)] == [
        plain.id,
        first.id,
    ]
    record = ResultRecord.from_fields(broker.records.get_result(plain.id))
    assert (
        record.id,
        record.type,
        record.queue,
        record.status,
        record.priority,
        record.args,
        record.kwargs,
        record.attempts,
        record.run_after,
    ) == (plain.id, "demo.echo", "default", "READY", 0, [], {}, 0, None)
    assert record.enqueued_at is None  # a mark holds no time: the record has it once the task starts
    record = ResultRecord.from_fields(broker.records.get_result(full.id))
    assert (record.id, record.status, record.priority, record.args, record.kwargs) == (
        full.id,
        "READY",
        5,
        [1],
        {"k": "v"},
    )
    assert record.run_after == datetime.fromtimestamp(full.run_after_ms / 1000, tz=UTC)


def test_a_ready_record_with_every_field_written_by_an_older_producer_reads_back(broker):
    broker.client.hset(
        broker.keys.result("old-1"),
        mapping={
            "id": "old-1",
            "type": "demo.echo",
            "queue": "q",
            "priority": "3",
            "status": "READY",
            "args": "[2]",
            "kwargs": "{}",
            "enqueued_at_ms": "1700000000000",
            "attempts": "0",
        },
    )
    record = ResultRecord.from_fields(broker.records.get_result("old-1"))
    assert (record.id, record.type, record.queue, record.status, record.priority, record.args, record.attempts) == (
        "old-1",
        "demo.echo",
        "q",
        "READY",
        3,
        [2],
        0,
    )


def test_tasks_of_one_repeated_request_get_their_own_ids_and_canonical_bytes(broker):
    tasks = enqueue("demo.echo", [7], {"k": "v"}, headers={"trace": "t"}, count=3)
    raws = broker.client.lrange(broker.keys.pending("default"), 0, -1)
    decoded = [decode_task(raw) for raw in raws]
    assert sorted(t.id for t in decoded) == sorted(t.id for t in tasks)
    assert all(uuid.UUID(t.id).version == 4 and str(uuid.UUID(t.id)) == t.id for t in decoded)
    assert all(t.SerializeToString() == raw for t, raw in zip(decoded, raws, strict=True))
    assert all((decode_payload(t.payload).kwargs, dict(t.headers)) == ({"k": "v"}, {"trace": "t"}) for t in decoded)


def test_requests_alike_but_for_their_arguments_each_reach_redis_whole_with_a_mark(broker):
    requests = [TaskRequest("demo.echo", [n], {"n": n}, queue="alike", headers={"h": "1"}) for n in range(300)]
    requests += [TaskRequest("demo.echo", [n], queue="alike", priority=3) for n in range(3)]
    requests.append(TaskRequest("demo.sleep", [0], queue="alike", headers={"h": "2"}))
    tasks = enqueue_many(requests)
    raws = broker.client.lrange(broker.keys.pending("alike"), 0, -1)
    raws += broker.client.zrange(broker.keys.prioritized("alike"), 0, -1)
    decoded = {task.id: task for task in map(decode_task, raws)}
    assert len(decoded) == len(requests) == len({task.id for task in tasks})
    for request, task in zip(requests, tasks, strict=True):
        envelope = decoded[task.id]
        assert (envelope.type, envelope.priority, dict(envelope.headers)) == (
            request.type,
            request.priority,
            dict(request.headers),
        )
        assert decode_payload(envelope.payload).args == list(request.args)
        assert decode_payload(envelope.payload).kwargs == dict(request.kwargs)
        record = ResultRecord.from_fields(broker.records.get_result(task.id))  # from its mark, written with it
        assert (record.status, record.queue, record.type) == ("READY", "alike", request.type)
        assert not broker.client.exists(broker.keys.result(task.id))


@pytest.mark.parametrize(
    "bad",
    [
        TaskRequest("demo.echo", ["\ud800"], queue="alike"),  # a lone surrogate
        TaskRequest("demo.echo", [float("nan")], queue="alike"),
        TaskRequest("demo.echo", [{1: "x"}], queue="alike"),
        TaskRequest("demo.echo", [1], queue="alike", priority=True),
        TaskRequest("demo.echo", [1], queue="alike", task_id="a/b"),
    ],
)
def test_a_bad_request_among_requests_alike_is_refused_and_nothing_is_pushed(broker, bad):
    with pytest.raises(EnqueueError):
        enqueue_many([TaskRequest("demo.echo", [1], queue="alike", priority=1), bad])
    assert enqueued_keys(broker) == []


def test_duplicates_in_a_batch_of_plain_and_unique_tasks_are_told_at_their_own_positions(broker):
    TaskType.objects.create(name="once", handler="demo.echo", queue="mix", unique_for_s=60)
    [held] = enqueue("once", [1])
    enqueue_many([TaskRequest("demo.echo", [0], queue="mix", task_id="known")])
    tasks = enqueue_many(
        [
            TaskRequest("once", [1]),  # its uniqueness key is held
            TaskRequest("demo.echo", [2], queue="mix"),
            TaskRequest("demo.echo", [3], queue="mix", task_id="known"),  # the caller's id, enqueued before
            TaskRequest("once", [4]),
        ]
    )
    assert [task.duplicate for task in tasks] == [True, False, True, False]
    assert (tasks[0].id, tasks[2].id) == (held.id, "known")
    assert [task.type for task in tasks] == ["once", "demo.echo", "demo.echo", "once"]


def test_an_unreachable_redis_is_a_clear_error(settings):
    from tasks_app.producer import QueueUnavailable

    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    with pytest.raises(QueueUnavailable, match="cannot enqueue: Redis did not take the tasks"):
        enqueue("demo.echo")


def nothing_enqueued(broker) -> bool:
    keys = broker.keys
    return not any(
        [
            broker.client.llen(keys.pending("default")),
            broker.client.zcard(keys.delayed("default")),
            broker.client.zcard(keys.prioritized("default")),
            list(broker.client.scan_iter(match=f"{keys.prefix}:result:*")),
        ]
    )


@pytest.mark.parametrize("delay_s", [1e14, 365 * 86400 + 1])
def test_a_delay_over_the_maximum_is_refused_and_enqueues_nothing(broker, delay_s):
    with pytest.raises(EnqueueError, match="delay must be at most 31536000 seconds"):
        enqueue_many([TaskRequest("demo.echo", [1]), TaskRequest("demo.echo", [2], delay_s=delay_s)])
    assert nothing_enqueued(broker)


def test_a_run_after_beyond_the_maximum_delay_is_refused(broker, settings):
    settings.TASKS_MAX_DELAY_S = 3600
    with pytest.raises(EnqueueError, match="run_after must be at most 3600 seconds"):
        enqueue("demo.echo", run_after=datetime.now(UTC) + timedelta(hours=2))
    assert nothing_enqueued(broker)
    [task] = enqueue("demo.echo", run_after=datetime.now(UTC) + timedelta(minutes=59))
    assert broker.client.zcard(broker.keys.delayed("default")) == 1 and task.run_after_ms > task.enqueued_at_ms


def test_the_form_and_the_producer_share_the_maximum_delay(settings):
    from tasks_app.web.tasks import EnqueueForm

    assert EnqueueForm.base_fields["delay"].max_value == settings.TASKS_MAX_DELAY_S


@pytest.mark.parametrize(
    ("name", "value", "error_id"),
    [
        ("TASKS_MAX_DELAY_S", 0, "tasks_app.E020"),
        ("TASKS_DEAD_LETTER_MAX", -1, "tasks_app.E021"),
        ("TASKS_DEAD_LETTER_MAX_AGE_S", 0, "tasks_app.E022"),
    ],
)
def test_invalid_delay_and_dead_letter_settings_fail_the_system_checks(settings, name, value, error_id):
    from tasks_app.checks import check_task_settings

    assert error_id not in {problem.id for problem in check_task_settings()}
    setattr(settings, name, value)
    assert error_id in {problem.id for problem in check_task_settings()}
