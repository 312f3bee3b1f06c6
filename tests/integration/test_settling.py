"""Settling what handlers and foreign producers really send, with real `runconsumer` processes.

Return values and exception texts that Redis cannot store, values over the size caps, runs past
their timeout: each fails its own task with a reason, never its batch-mates, never the consumer.
"""

import itertools
import json

import pytest
import redis

import tests.support.settle_handlers  # noqa: F401  (registers the handlers in this process)
from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.records import ResultRecord
from tests.chaos.servers import RedisServer
from tests.support.processes import wait_until
from tests.support.settle_handlers import SPANS_KEY_SUFFIX

pytestmark = pytest.mark.django_db(transaction=True)

HANDLERS = "tests.support.handlers,tests.support.settle_handlers"


def record_of(broker: Broker, task_id: str) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task_id) or {})


def wait_all_finished(broker: Broker, task_ids: list[str], timeout_s: float = 30) -> list[ResultRecord]:
    wait_until(
        lambda: all(record_of(broker, i).is_finished for i in task_ids), timeout_s, message="every task to finish"
    )
    return [record_of(broker, i) for i in task_ids]


def push_foreign(broker: Broker, task_id: str, type_name: str, payload: bytes) -> None:
    """LPUSH a task as a producer in another language would."""
    raw = encode_task(Task(id=task_id, type=type_name, queue="default", payload=payload))
    broker.client.lpush(broker.keys.pending("default"), raw)


def spans(broker: Broker) -> list[dict]:
    return [json.loads(item) for item in broker.client.lrange(f"{broker.keys.prefix}:{SPANS_KEY_SUFFIX}", 0, -1)]


def create_types() -> None:
    TaskType.objects.create(name="settle.latin1_name", handler="settle.latin1_name", max_attempts=2, retry_backoff=0.1)
    TaskType.objects.create(name="settle.big", handler="settle.big", max_attempts=1)
    TaskType.objects.create(name="demo.echo", handler="demo.echo", max_attempts=2, retry_backoff=0.1)


def enqueue_bad(broker: Broker, kind: str) -> str:
    if kind == "latin1_return":
        return producer.enqueue("settle.latin1_name")[0].id
    if kind == "foreign_surrogate_args":
        push_foreign(broker, "foreign-1", "demo.echo", b'{"args": ["\\ud800"]}')
        return "foreign-1"
    return producer.enqueue("settle.big", [5000])[0].id


@pytest.mark.parametrize("kind", ["latin1_return", "foreign_surrogate_args", "over_max_result_bytes"])
def test_an_unstorable_return_value_fails_its_task_only_and_the_consumer_goes_on(broker, consumer_process, kind):
    create_types()
    before = [t.id for t in producer.enqueue("demo.echo", [1], count=20)]
    bad_id = enqueue_bad(broker, kind)
    after = [t.id for t in producer.enqueue("demo.echo", [2], count=20)]
    consumer = consumer_process(
        "--concurrency", "4", "--prefetch", "8", TASK_HANDLER_MODULES=HANDLERS, TASKS_MAX_RESULT_BYTES="2048"
    )

    good = wait_all_finished(broker, before + after)
    assert [r.status for r in good] == ["SUCCESSFUL"] * 40, consumer.log()
    [bad] = wait_all_finished(broker, [bad_id])
    assert bad.status == "FAILED"
    reason = bad.dead_reason
    expected = (
        ("ResultTooLarge", "TASKS_MAX_RESULT_BYTES")
        if kind == "over_max_result_bytes"
        else ("ResultNotJson", "lone surrogate")
    )
    assert all(part in reason for part in expected), reason
    assert [decode_task(raw).id for raw, _ in broker.inspect.list_dead("default")] == [bad_id]

    later = [t.id for t in producer.enqueue("demo.echo", [3], count=5)]  # the consumer still claims
    assert [r.status for r in wait_all_finished(broker, later)] == ["SUCCESSFUL"] * 5
    assert broker.inspect.queue_stats("default").processing == 0
    assert consumer.terminate() == 0


def test_a_return_value_over_the_servers_bulk_limit_fails_its_task_only(broker, consumer_process, settings, tmp_path):
    server = RedisServer(tmp_path).start()
    try:
        redis.Redis.from_url(server.url).config_set("proto-max-bulk-len", 1024 * 1024)
        settings.REDIS_URL = server.url  # the producer and this test's broker use the private server
        private = Broker(redis.Redis.from_url(server.url), broker.keys.prefix)
        TaskType.objects.create(name="settle.big", handler="settle.big", max_attempts=1)
        good = [t.id for t in producer.enqueue("demo.echo", [1], count=10)]
        [huge] = producer.enqueue("settle.big", [1536 * 1024])
        good += [t.id for t in producer.enqueue("demo.echo", [2], count=10)]
        consumer = consumer_process(
            "--concurrency",
            "4",
            TASK_HANDLER_MODULES=HANDLERS,
            REDIS_URL=server.url,
            TASKS_MAX_RESULT_BYTES=str(4 * 1024 * 1024),
        )

        assert [r.status for r in wait_all_finished(private, good, 60)] == ["SUCCESSFUL"] * 20, consumer.log()
        [record] = wait_all_finished(private, [huge.id], 60)
        assert record.status == "FAILED" and "could not be stored" in record.dead_reason, record
        later = [t.id for t in producer.enqueue("demo.echo", [3], count=5)]
        assert [r.status for r in wait_all_finished(private, later)] == ["SUCCESSFUL"] * 5
        assert private.inspect.queue_stats("default").processing == 0
        assert consumer.terminate() == 0
    finally:
        server.remove()


def test_an_exception_message_with_a_lone_surrogate_is_retried_then_dead_lettered(broker, consumer_process):
    TaskType.objects.create(
        name="settle.raise_latin1", handler="settle.raise_latin1", max_attempts=2, retry_backoff=0.1
    )
    [task] = producer.enqueue("settle.raise_latin1")
    consumer = consumer_process("--concurrency", "2", TASK_HANDLER_MODULES=HANDLERS)

    [record] = wait_all_finished(broker, [task.id])
    assert (record.status, record.attempts) == ("FAILED", 2), consumer.log()
    assert "cannot open caf\\udce9" in record.dead_reason  # readable: the byte shown as an escape
    assert [e["exception_class_path"] for e in record.errors] == ["builtins.RuntimeError"] * 2
    [(raw, _)] = broker.inspect.list_dead("default")
    dead = decode_task(raw)
    assert dead.id == task.id and "caf\\udce9" in dead.last_error and "raise_latin1" in dead.last_traceback
    assert broker.inspect.queue_stats("default").processing == 0
    assert consumer.terminate() == 0


def test_a_retry_of_a_timed_out_run_never_overlaps_it(broker, consumer_process):
    TaskType.objects.create(name="settle.timed", handler="settle.timed", max_attempts=3, retry_backoff=0.1, timeout=0.5)
    [task] = producer.enqueue("settle.timed", kwargs={"sleep_s": 3})
    consumer = consumer_process("--concurrency", "4", TASK_HANDLER_MODULES=HANDLERS)

    [record] = wait_all_finished(broker, [task.id], 40)
    assert (record.status, record.attempts) == ("FAILED", 3), consumer.log()
    assert [e["exception_class_path"] for e in record.errors] == ["tasks_app.exceptions.TaskTimeout"] * 3
    runs: dict[int, dict[str, float]] = {}
    for span in spans(broker):
        runs.setdefault(span["attempt"], {})[span["event"]] = span["at_s"]
    assert sorted(runs) == [1, 2, 3]
    for attempt in (2, 3):
        assert runs[attempt]["start"] >= runs[attempt - 1]["end"], runs
    assert broker.inspect.queue_stats("default").processing == 0
    assert consumer.terminate() == 0


def test_a_pure_python_handler_is_interrupted_at_its_timeout_and_its_finally_runs(broker, consumer_process):
    TaskType.objects.create(name="settle.busy", handler="settle.busy", max_attempts=1, timeout=0.5)
    [task] = producer.enqueue("settle.busy", kwargs={"run_s": 20})
    consumer = consumer_process("--concurrency", "2", TASK_HANDLER_MODULES=HANDLERS)

    [record] = wait_all_finished(broker, [task.id], 15)
    assert record.status == "FAILED", consumer.log()
    assert record.errors[0]["exception_class_path"] == "tasks_app.exceptions.TaskTimeout"
    assert "settle_handlers.py" in record.errors[0]["traceback"]  # where the handler was interrupted
    events = {span["event"]: span["at_s"] for span in spans(broker)}
    assert "finally" in events, (events, record.errors, consumer.log())
    assert 0.4 <= events["finally"] - events["start"] < 3.0, events
    assert consumer.terminate() == 0


def test_a_foreign_priority_out_of_range_is_clamped_and_survives_a_retry(broker, consumer_in_thread):
    TaskType.objects.create(name="test.record", handler="test.record", max_attempts=2, retry_backoff=0.1)
    raw = encode_task(
        Task(
            id="loud-1",
            type="test.record",
            queue="default",
            priority=5000,
            payload=b'{"kwargs": {"fail_until_attempt": 1}}',
        )
    )
    broker.client.lpush(broker.keys.pending("default"), raw)
    with consumer_in_thread():
        [record] = wait_all_finished(broker, ["loud-1"])
    assert (record.status, record.attempts, record.priority) == ("SUCCESSFUL", 2, 100)
    assert broker.inspect.list_dead("default") == []


def test_a_type_name_from_redis_does_not_become_a_metric_label(broker, consumer_in_thread):
    from prometheus_client import REGISTRY

    def dead_lettered(type_label: str) -> float:
        sample = REGISTRY.get_sample_value(
            "taskqueue_tasks_dead_lettered_total", {"type": type_label, "queue": "default"}
        )
        return sample or 0.0

    before = dead_lettered("_unknown")
    push_foreign(broker, "stranger-1", "made.up.type.7f3a", b"")
    with consumer_in_thread():
        [record] = wait_all_finished(broker, ["stranger-1"])
    assert record.status == "FAILED" and "unknown task type" in record.dead_reason
    assert dead_lettered("_unknown") == before + 1
    assert (
        REGISTRY.get_sample_value(
            "taskqueue_tasks_dead_lettered_total", {"type": "made.up.type.7f3a", "queue": "default"}
        )
        is None
    )


def test_a_retry_that_redis_refuses_dead_letters_the_task_instead_of_holding_it(broker, consumer_process):
    TaskType.objects.create(name="demo.fail", handler="demo.fail", max_attempts=3, retry_backoff=0.1)
    [task] = producer.enqueue("demo.fail", kwargs={"message": "boom"})
    broker.client.set(broker.keys.delayed("default"), "not a sorted set")  # every retry: WRONGTYPE
    consumer = consumer_process("--concurrency", "2", TASK_HANDLER_MODULES=HANDLERS)

    [record] = wait_all_finished(broker, [task.id])
    assert record.status == "FAILED", consumer.log()
    assert "settling the task failed" in record.dead_reason and "WRONGTYPE" in record.dead_reason
    [(raw, _)] = broker.inspect.list_dead("default")
    assert decode_task(raw).id == task.id
    broker.client.delete(broker.keys.delayed("default"))
    assert broker.inspect.queue_stats("default").processing == 0
    later = [t.id for t in producer.enqueue("demo.echo", [1], count=3)]
    assert [r.status for r in wait_all_finished(broker, later)] == ["SUCCESSFUL"] * 3
    assert consumer.terminate() == 0


@pytest.mark.parametrize("handler", ["settle.asks_retry", "settle.async_asks_retry"])
def test_a_handler_asking_for_retries_runs_again_when_it_asked_and_succeeds(broker, consumer_process, handler):
    # The type's backoff is an hour: only the delay the handler asks for brings the runs back.
    TaskType.objects.create(name=handler, handler=handler, max_attempts=5, retry_backoff=3600)
    [task] = producer.enqueue(handler, [0.5, 3])
    consumer = consumer_process(TASK_HANDLER_MODULES=HANDLERS)

    [record] = wait_all_finished(broker, [task.id], 30)
    assert record.status == "SUCCESSFUL" and record.attempts == 3, consumer.log()
    starts = [span["at_s"] for span in spans(broker) if span["task_id"] == task.id]
    assert len(starts) == 3
    assert all(later - earlier >= 0.45 for earlier, later in itertools.pairwise(starts)), starts
    assert consumer.terminate() == 0


def test_a_permanent_error_is_dead_lettered_after_one_run(broker, consumer_process):
    TaskType.objects.create(name="settle.permanent", handler="settle.permanent", max_attempts=5, retry_backoff=0.1)
    [task] = producer.enqueue("settle.permanent")
    consumer = consumer_process(TASK_HANDLER_MODULES=HANDLERS)

    [record] = wait_all_finished(broker, [task.id], 30)
    assert record.status == "FAILED" and record.attempts == 1, consumer.log()
    assert record.dead_reason.startswith("permanent error on attempt 1: tasks_app.exceptions.PermanentError")
    assert [decode_task(raw).id for raw, _ in broker.inspect.list_dead("default")] == [task.id]
    assert len([span for span in spans(broker) if span["task_id"] == task.id]) == 1
    assert consumer.terminate() == 0
