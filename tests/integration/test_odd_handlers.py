"""Handlers that misbehave, on real consumers: each such run ends as documented and the consumer goes on."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.results import ResultRecord
from tests.support import odd_handlers as odd
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# What each odd exception is recorded as (its class path), raised by a handler, a `@task` function or
# either on the asyncio lane.
RAISED = {
    "system_exit": "builtins.SystemExit",
    "keyboard_interrupt": "builtins.KeyboardInterrupt",
    "generator_exit": "builtins.GeneratorExit",
    "custom_base": "tests.support.odd_handlers.CustomBase",
    "unshowable": "tests.support.odd_handlers.Unshowable",
    "interrupts_when_shown": "tests.support.odd_handlers.Interrupts",
    "huge_message": "tests.support.odd_handlers.Huge",
    "circular": "builtins.ValueError",
    "recursion": "builtins.RecursionError",
    "memory_error": "builtins.MemoryError",
    "retry_huge": "tasks_app.exceptions.Retry",
}
RETURNED = ["generator", "nan", "inf", "huge", "surrogate", "set", "int_huge"]


def record_of(broker: Broker, task_id: str) -> ResultRecord:
    return ResultRecord.from_fields(broker.get_result(task_id) or {})


@pytest.mark.parametrize(
    ("raising", "returning"),
    [
        ("odd.raise", "odd.return"),
        ("odd.async_raise", "odd.async_return"),
        (odd.task_raise.module_path, odd.task_return.module_path),
        (odd.task_async_raise.module_path, odd.task_async_return.module_path),
    ],
)
def test_odd_exceptions_and_return_values_fail_only_their_task_with_a_readable_reason(
    broker, consumer_in_thread, raising, returning
):
    for name in (raising, returning):
        TaskType.objects.create(name=name, handler=name, max_attempts=1)
    with consumer_in_thread(concurrency=4):
        raised = {kind: producer.enqueue(raising, kwargs={"kind": kind})[0].id for kind in RAISED}
        returned = {kind: producer.enqueue(returning, kwargs={"kind": kind})[0].id for kind in RETURNED}
        every = [*raised.values(), *returned.values()]
        wait_until(lambda: all(record_of(broker, i).is_finished for i in every), 60, message="every odd run to end")
        [after] = producer.enqueue("odd.note", kwargs={"name": "after"})
        wait_until(lambda: record_of(broker, after.id).is_finished, 10, message="a task after them")
    assert record_of(broker, after.id).status == "SUCCESSFUL"
    for kind, task_id in raised.items():
        record = record_of(broker, task_id)
        assert (record.status, record.attempts) == ("FAILED", 1), kind
        assert record.errors[0]["exception_class_path"] == RAISED[kind], kind
    for kind, task_id in returned.items():
        assert (record_of(broker, task_id).status, kind) == ("FAILED", kind)
    fields = [broker.get_result(i) or {} for i in every]
    assert all(len(f["dead_reason"].encode()) < 17 * 1024 for f in fields), "a readable reason, cut"
    stats = broker.queue_stats("default")
    assert (stats.dead, stats.processing, stats.pending, stats.delayed) == (len(every), 0, 0, 0)


def test_a_consumer_whose_handler_closed_stdout_and_stderr_still_stops_with_exit_0(broker, consumer_process):
    # Before: flushing the closed sys.stdout at exit raised, so the process ended 1 after a fatal
    # dump, and only once the thread the handler left had ended (os._exit was never reached).
    consumer = consumer_process("--grace", "2", TASK_HANDLER_MODULES=odd.ODD_HANDLER_MODULES)
    [task] = producer.enqueue("odd.close_std")
    wait_until(lambda: record_of(broker, task.id).is_finished, 20, message="the task to run")
    [after] = producer.enqueue("odd.note", kwargs={"name": "after"})
    wait_until(lambda: record_of(broker, after.id).is_finished, 20, message="a task after it")
    assert record_of(broker, task.id).status == record_of(broker, after.id).status == "SUCCESSFUL"
    assert consumer.terminate(timeout_s=20) == 0, consumer.log()
