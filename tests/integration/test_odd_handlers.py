"""Handlers that misbehave, on real consumers: each such run ends as documented and the consumer goes on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.records import ResultRecord
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
    return ResultRecord.from_fields(broker.records.get_result(task_id) or {})


def notes(broker: Broker) -> list[str]:
    return [note.decode() for note in broker.client.lrange(f"{broker.keys.prefix}:{odd.NOTES_KEY_SUFFIX}", 0, -1)]


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
    fields = [broker.records.get_result(i) or {} for i in every]
    assert all(len(f["dead_reason"].encode()) < 17 * 1024 for f in fields), "a readable reason, cut"
    stats = broker.inspect.queue_stats("default")
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


def gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie its parent never reaped counts as exited)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def child_pid(broker: Broker) -> int:
    [pid] = {int(note.rsplit(" ", 1)[1]) for note in notes(broker) if note.startswith("child")}
    return pid


@pytest.mark.parametrize(
    "name", ["odd.fork", "odd.async_fork", odd.task_fork.module_path, odd.task_async_fork.module_path]
)
def test_a_child_forked_by_a_handler_that_returns_into_the_consumer_exits_having_settled_nothing(
    broker, consumer_process, name
):
    # Before: the child went on as a consumer with only the forking thread: a sync one waited for
    # work forever; an async one ran the lane's loop, settled runs as failed (retried: the task ran
    # twice) and shared the loop's wake-ups with its parent, living on after the consumer stopped.
    TaskType.objects.create(name=name, handler=name, max_attempts=3, retry_backoff=0.1)
    consumer = consumer_process("--concurrency", "2", TASK_HANDLER_MODULES=odd.ODD_HANDLER_MODULES)
    beside = [producer.enqueue("odd.async_note", kwargs={"name": f"beside{i}", "sleep_s": 0.5})[0] for i in range(3)]
    [forking] = producer.enqueue(name, kwargs={"child_s": 0.2})
    every = [forking, *beside]
    wait_until(lambda: all(record_of(broker, t.id).is_finished for t in every), 20, message="every task to end")
    wait_until(lambda: gone(child_pid(broker)), 10, message="the forked child to exit")
    time.sleep(1)  # what a child left running would settle meanwhile
    record = record_of(broker, forking.id)
    assert (record.status, record.attempts, record.return_value) == ("SUCCESSFUL", 1, "parent")
    assert [record_of(broker, t.id).status for t in beside] == ["SUCCESSFUL"] * 3
    ran = [n.rsplit(" ", 1)[0] for n in notes(broker) if not n.startswith("child")]
    finished = ["finished"] if "task" in name else []  # task_finished, sent by the parent alone
    parent = ["parent returns"] if "async" in name else []
    assert sorted(ran) == sorted(["beside0", "beside1", "beside2", *parent, *finished])
    assert all(n.startswith("child") or n.endswith(f" {consumer.pid}") for n in notes(broker))
    assert consumer.terminate(timeout_s=20) == 0, consumer.log()
    stats = broker.inspect.queue_stats("default")
    assert (stats.processing, stats.pending, stats.delayed, stats.dead) == (0, 0, 0, 0)
