"""Which result records a task type keeps once its tasks end, and for how long, with a real consumer."""

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.history import index_keys
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = pytest.mark.django_db(transaction=True)


def ran(broker, task_id: str) -> bool:
    return any(run["task_id"] == task_id for run in recorded_runs(broker))


def in_history(broker, task_id: str) -> bool:
    return any(broker.client.zscore(key, task_id) is not None for key in index_keys(broker.keys, "default"))


def settled(broker, task_id: str) -> bool:
    """It ran and nothing holds it any more: no consumer's list, no retry waiting."""
    stats = broker.inspect.queue_stats("default")
    return ran(broker, task_id) and not stats.processing and not stats.delayed and not stats.pending


def test_never_leaves_no_record_and_no_history_entry_after_success_or_failure(broker, consumer_in_thread):
    TaskType.objects.create(name="kept.never", handler="test.record", keep_results="never", max_attempts=1)
    with consumer_in_thread():
        [succeeds] = producer.enqueue("kept.never")
        [fails] = producer.enqueue("kept.never", kwargs={"fail_until_attempt": 2})
        for task in (succeeds, fails):
            wait_until(lambda task=task: settled(broker, task.id), 20, message=f"{task.id} to end")
            wait_until(lambda task=task: broker.records.get_result(task.id) is None, 10, message="its record to go")
            assert not in_history(broker, task.id)
    assert [task for task, _ in broker.inspect.list_dead("default")], "the failed task is still dead-lettered"


def test_failures_only_keeps_the_failed_and_drops_the_successful(broker, consumer_in_thread):
    TaskType.objects.create(name="kept.failures", handler="test.record", keep_results="failures", max_attempts=1)
    with consumer_in_thread():
        [succeeds] = producer.enqueue("kept.failures")
        [fails] = producer.enqueue("kept.failures", kwargs={"fail_until_attempt": 2})
        wait_until(lambda: (broker.records.get_result(fails.id) or {}).get("status") == "FAILED", 20, message="fail")
        wait_until(lambda: settled(broker, succeeds.id), 20, message="the success to end")
        wait_until(lambda: broker.records.get_result(succeeds.id) is None, 10, message="the success's record to go")
    assert in_history(broker, fails.id) and not in_history(broker, succeeds.id)


def test_a_type_of_its_own_time_to_live_keeps_its_records_that_long(broker, consumer_in_thread, settings):
    settings.TASKS_RESULT_TTL = 7 * 86400
    TaskType.objects.create(name="kept.briefly", handler="test.record", result_ttl=120)
    TaskType.objects.create(name="kept.default", handler="test.record")
    with consumer_in_thread():
        [brief] = producer.enqueue("kept.briefly")
        [default] = producer.enqueue("kept.default")
        for task in (brief, default):
            wait_until(
                lambda task=task: (broker.records.get_result(task.id) or {}).get("status") == "SUCCESSFUL",
                20,
                message=f"{task.id} to succeed",
            )
    assert 0 < broker.client.ttl(broker.keys.result(brief.id)) <= 120
    assert broker.client.ttl(broker.keys.result(default.id)) > 6 * 86400
    assert broker.client.pttl(index_keys(broker.keys, "default")[0]) > 6 * 86400 * 1000, "the index kept its life"
