"""Django's tasks framework end to end: `.enqueue()` here, a real `runconsumer` subprocess runs it."""

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.db import transaction
from django.tasks import TaskResultStatus

from tasks_app.models import TaskType
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.enqueue import Enqueueable
from tests.support import django_tasks as tasks
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

HANDLER_MODULES = "tests.support.handlers,tests.support.django_tasks"


def run_consumer_until_idle(consumer_process) -> None:
    """Run a burst consumer over the default queue until nothing is left; fail on a bad exit."""
    consumer = consumer_process("--burst", "--lease", "2", "--concurrency", "2", TASK_HANDLER_MODULES=HANDLER_MODULES)
    assert consumer.wait(timeout_s=60) == 0, consumer.log()


def tune(django_task, **fields) -> None:
    """Create the task's TaskType row as an admin would tune it."""
    TaskType.objects.create(name=django_task.module_path, handler=django_task.module_path, **fields)


def test_enqueue_then_get_result_moves_from_ready_to_successful(broker, consumer_process):
    result = tasks.add.enqueue(20, 22)
    assert tasks.add.get_result(result.id).status == TaskResultStatus.READY

    run_consumer_until_idle(consumer_process)

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42
    assert result.attempts == 1 and len(result.worker_ids) == 1
    assert result.errors == []
    assert result.started_at <= result.finished_at


def test_failing_task_retries_per_its_task_type_and_records_every_error(broker, consumer_process):
    tune(tasks.fail, max_attempts=3, retry_backoff=0.05)
    result = tasks.fail.enqueue("always")

    run_consumer_until_idle(consumer_process)

    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == 3 and len(result.worker_ids) == 3
    assert [error.exception_class_path for error in result.errors] == ["builtins.ValueError"] * 3
    assert all("ValueError: always" in error.traceback for error in result.errors)
    assert result.errors[0].exception_class is ValueError
    assert broker.inspect.queue_stats("default").dead == 1


def test_takes_context_sees_attempts_one_two_three(broker, consumer_process):
    tune(tasks.flaky, max_attempts=3, retry_backoff=0.05)
    result = tasks.flaky.enqueue(failures=2)

    run_consumer_until_idle(consumer_process)

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 3
    assert [error.traceback.strip().splitlines()[-1] for error in result.errors] == [
        "RuntimeError: planned failure on attempt 1",
        "RuntimeError: planned failure on attempt 2",
    ]
    assert result.attempts == 3


def test_run_after_is_honoured(broker, consumer_process):
    # The consumer is up before either task is enqueued, so the one due now never waits for it.
    consumer = consumer_process("--lease", "2", "--concurrency", "2", TASK_HANDLER_MODULES=HANDLER_MODULES)
    wait_until(lambda: broker.inspect.queue_stats("default").consumers, 60, message="the consumer to register")
    run_after = datetime.now(tz=UTC) + timedelta(seconds=1.5)
    later = tasks.add.using(run_after=run_after).enqueue(1, 1)
    now = tasks.add.enqueue(2, 2)

    for result in (now, later):
        wait_until(lambda result=result: result.refresh() or result.is_finished, 60, message="both tasks to finish")
    assert consumer.terminate() == 0, consumer.log()
    assert later.status == now.status == TaskResultStatus.SUCCESSFUL
    assert later.started_at >= run_after.replace(microsecond=run_after.microsecond // 1000 * 1000)
    assert now.started_at < later.started_at


def test_first_enqueue_creates_a_task_type_the_admin_can_tune(broker, consumer_process):
    result = tasks.not_json.enqueue()
    row = TaskType.objects.get(name=tasks.not_json.module_path)
    assert (row.handler, row.max_attempts) == (tasks.not_json.module_path, 3)
    row.max_attempts = 1
    row.save()

    run_consumer_until_idle(consumer_process)

    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [error.exception_class_path for error in result.errors] == ["builtins.TypeError"]
    assert result.attempts == 1


def test_consumer_loads_a_task_named_by_its_task_type_row(broker, consumer_process):
    result = tasks.add.enqueue(3, 4)  # the producer creates the row naming tests.support.django_tasks.add

    consumer = consumer_process("--burst", "--lease", "2", TASK_HANDLER_MODULES="tests.support.handlers")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()

    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 7)


def test_a_task_type_row_a_rollback_removed_is_created_again_by_the_next_enqueue(broker, consumer_process, settings):
    settings.TASKS_CONFIG_REFRESH_S = 600  # how long the producer keeps a type's row without reading it
    with transaction.atomic():
        tasks.add.enqueue(1, 2)  # creates the row; the push waits for a commit that never comes
        tasks.add.enqueue(2, 3)  # reads the row the first one created
        transaction.set_rollback(True)
    assert not TaskType.objects.filter(name=tasks.add.module_path).exists()

    result = tasks.add.enqueue(3, 4)

    assert TaskType.objects.filter(name=tasks.add.module_path).exists()
    # A consumer that finds the function only through its row runs it.
    consumer = consumer_process("--burst", "--lease", "2", TASK_HANDLER_MODULES="tests.support.handlers")
    assert consumer.wait(timeout_s=60) == 0, consumer.log()
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 7)


def test_a_row_naming_something_that_is_not_a_task_runs_nothing(broker, consumer_process):
    # A plain function (this one kills its process) named by a row is never called as a task.
    TaskType.objects.create(name="test.not_a_task", handler="tests.support.handlers.kill_self", max_attempts=1)
    task = Task(id="not-a-task-1", type="test.not_a_task", queue="default")
    broker.enqueuer.enqueue([Enqueueable(queue="default", raw=encode_task(task), task_id=task.id)], 60)

    run_consumer_until_idle(consumer_process)

    record = broker.records.get_result(task.id)
    assert record["status"] == "FAILED"
    assert "is not registered" in record["dead_reason"]


def test_a_running_consumer_finds_a_new_task_before_its_next_settings_refresh(broker, consumer_process):
    consumer = consumer_process(
        "--lease", "2", TASK_HANDLER_MODULES="tests.support.handlers", TASKS_CONFIG_REFRESH_S="600"
    )
    wait_until(lambda: broker.inspect.queue_stats("default").consumers, 30, message="the consumer to start")

    result = tasks.add.enqueue(5, 6)  # creates the TaskType row the consumer has not loaded yet

    wait_until(lambda: tasks.add.get_result(result.id).is_finished, 30, message="the task to finish")
    assert tasks.add.get_result(result.id).return_value == 11
    assert consumer.terminate() == 0, consumer.log()


def test_a_run_failed_for_its_timeout_reports_the_timeout_in_task_finished(broker, consumer_in_thread):
    from django.tasks.signals import task_finished

    tune(tasks.nap, timeout=0.3, max_attempts=1)
    finished = []

    def on_finished(sender, task_result, **kwargs):
        finished.append(task_result)

    task_finished.connect(on_finished)
    try:
        with consumer_in_thread():
            result = tasks.nap.enqueue(1.0)
            wait_until(lambda: finished, 15, message="task_finished")
    finally:
        task_finished.disconnect(on_finished)
    [reported] = finished
    assert reported.status == TaskResultStatus.FAILED
    assert reported.errors[-1].exception_class_path == "tasks_app.exceptions.TaskTimeout"
    stored = tasks.nap.get_result(result.id)
    assert stored.status == TaskResultStatus.FAILED
    assert stored.errors[-1].exception_class_path == "tasks_app.exceptions.TaskTimeout"


def test_a_task_with_context_polls_cancelled_and_reports_progress_on_djangos_context(broker, consumer_process):
    import tasks_app

    result = tasks.cooperative.enqueue(step_s=0.1)
    consumer = consumer_process("--concurrency", "2", TASK_HANDLER_MODULES=HANDLER_MODULES)
    reads: list[int] = []

    def progress_seen() -> bool:
        progress = (broker.records.get_result(result.id) or {}).get("progress")
        if progress:
            reads.append(json.loads(progress)["current"])
        return len(set(reads)) >= 3

    wait_until(progress_seen, 30, message="progress from the @task function")
    assert reads == sorted(reads)
    tasks_app.cancel(result.id, cancelled_by="ops")
    wait_until(lambda: tasks.cooperative.get_result(result.id).is_finished, 10, message="the run to end")
    read = tasks.cooperative.get_result(result.id)
    assert read.status == TaskResultStatus.FAILED and read.attempts == 1
    assert [error.exception_class_path for error in read.errors] == ["tasks_app.exceptions.TaskCancelled"]
    assert broker.records.get_result(result.id)["status"] == "CANCELLED"
    assert consumer.terminate() == 0, consumer.log()
