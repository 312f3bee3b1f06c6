"""A consumer pod removed by Kubernetes: SIGTERM, then SIGKILL once the pod's grace period is over.

The pod's consumer holds two running tasks and three claimed ahead. What never started goes back at
SIGTERM; runs that end within the grace are acknowledged and the consumer exits 0; past the grace
period nothing is lost, and no task runs again while the consumer that ran it is alive.
"""

from __future__ import annotations

import signal
import subprocess
from collections import defaultdict

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.records import ResultRecord
from tests.chaos.harness import LEASE_S, statuses, tally, task_ids
from tests.support.processes import ConsumerProcess, wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

RUNNING, AHEAD, LEFT = 2, 3, 3  # runs held at the stop, tasks claimed ahead, tasks never claimed by the pod


def stop_like_kubernetes(pod: ConsumerProcess, grace_period_s: float) -> int | None:
    """SIGTERM, then SIGKILL if the process still runs after `grace_period_s`: its exit code, None if killed."""
    pod.signal(signal.SIGTERM)
    try:
        return pod.wait(grace_period_s)
    except subprocess.TimeoutExpired:
        pod.kill()
        return None


def start_loaded_pod(broker: Broker, consumer_process, consumer_grace_s: float) -> tuple[ConsumerProcess, list[str]]:
    """A pod's consumer running RUNNING held tasks with AHEAD more claimed; the ids of every task enqueued."""
    TaskType.objects.create(name="pod.held", handler="test.record", max_attempts=3, retry_backoff=1)
    TaskType.objects.create(name="pod.quick", handler="test.record")
    held = producer.enqueue("pod.held", kwargs={"hold_until": "release"}, count=RUNNING)
    quick = producer.enqueue("pod.quick", count=AHEAD + LEFT)
    pod = consumer_process(
        *("--consumer-id", "pod", "--concurrency", str(RUNNING), "--prefetch", str(AHEAD)),
        *("--lease", str(LEASE_S), "--grace", str(consumer_grace_s)),
        name="pod",
    )
    wait_until(
        lambda: len(recorded_runs(broker)) == RUNNING and len(claimed_by(broker, "pod")) == RUNNING + AHEAD,
        60,
        message=lambda: f"the pod to run {RUNNING} tasks and hold {AHEAD} more: {pod.log()[-2000:]}",
    )
    return pod, [task.id for task in held + quick]


def claimed_by(broker: Broker, consumer_id: str) -> set[str]:
    return task_ids(broker.client.lrange(broker.keys.processing("default", consumer_id), 0, -1))


def pending_ids(broker: Broker) -> set[str]:
    return task_ids(broker.client.lrange(broker.keys.pending("default"), 0, -1))


def runs_on(broker: Broker, consumer_id: str) -> list[dict]:
    return [run for run in recorded_runs(broker) if run["consumer"] == consumer_id]


def test_a_pod_whose_runs_end_within_the_grace_returns_what_never_started_and_exits_0(broker, consumer_process):
    pod, ids = start_loaded_pod(broker, consumer_process, consumer_grace_s=30)
    running = {run["task_id"] for run in recorded_runs(broker)}
    ahead = claimed_by(broker, "pod") - running
    stopped_ms = broker.inspect.server_time_ms()
    pod.signal(signal.SIGTERM)
    wait_until(lambda: claimed_by(broker, "pod") == running, 10, message="the tasks claimed ahead to go back")
    assert ahead <= pending_ids(broker) and len(pending_ids(broker)) == AHEAD + LEFT
    broker.client.set(f"{broker.keys.prefix}:release", 1)  # the running tasks end within the grace
    assert pod.wait(60) == 0, pod.log()
    assert [run for run in runs_on(broker, "pod") if run["start_ms"] >= stopped_ms] == [], "it started after SIGTERM"
    assert statuses(broker, sorted(running)) == dict.fromkeys(sorted(running), "SUCCESSFUL")
    assert not claimed_by(broker, "pod") and broker.inspect.queue_stats("default").consumers == []

    other = consumer_process("--consumer-id", "other", "--lease", str(LEASE_S), name="other")
    wait_until(lambda: set(statuses(broker, ids).values()) == {"SUCCESSFUL"}, 60, message="every task to succeed")
    result = tally(broker, ids)
    assert (result.lost, result.duplicates, result.total_runs) == ([], set(), len(ids))
    assert other.terminate(timeout_s=60) == 0, other.log()


@pytest.mark.parametrize(
    ("consumer_grace_s", "pod_grace_s"),
    [
        pytest.param(1, 20, id="consumer-gives-up-before-sigkill"),
        pytest.param(120, 5, id="sigkill-before-the-consumer-gives-up"),
    ],
)
def test_sigkill_after_a_grace_period_shorter_than_a_run_loses_and_repeats_nothing(
    broker, consumer_process, consumer_grace_s, pod_grace_s
):
    pod, ids = start_loaded_pod(broker, consumer_process, consumer_grace_s)
    running = {run["task_id"] for run in recorded_runs(broker)}
    other = consumer_process("--consumer-id", "other", "--lease", str(LEASE_S), name="other")
    stopped_ms = broker.inspect.server_time_ms()
    exit_code = stop_like_kubernetes(pod, pod_grace_s)  # the held runs would go on for a minute
    gone_ms = broker.inspect.server_time_ms()
    if consumer_grace_s < pod_grace_s:
        assert exit_code == 0, pod.log()  # it gave the runs up itself: each failed with TaskInterrupted
    else:
        assert exit_code is None, pod.log()
    broker.client.set(f"{broker.keys.prefix}:release", 1)  # the runs that follow end
    wait_until(
        lambda: set(statuses(broker, ids).values()) == {"SUCCESSFUL"},
        120,
        message=lambda: f"every task to succeed: {statuses(broker, ids)}\n{other.log()[-3000:]}",
    )
    assert [run for run in runs_on(broker, "pod") if run["start_ms"] >= stopped_ms] == [], "it started after SIGTERM"
    result = tally(broker, ids)
    assert result.lost == []
    assert result.duplicates == running, "only the runs cut off by the stop run again"
    by_task: dict[str, list[dict]] = defaultdict(list)
    for run in recorded_runs(broker):
        by_task[run["task_id"]].append(run)
    # Given up on by the consumer: failed with TaskInterrupted (an attempt used). Killed: recovered by the lease.
    cut_off_with = ["tasks_app.exceptions.TaskInterrupted"] if exit_code == 0 else []
    for task_id in running:
        first, again = by_task[task_id]
        assert first["consumer"] == "pod" and again["consumer"] != "pod"
        assert again["start_ms"] >= gone_ms, "it ran again while the pod that ran it was alive"
        record = ResultRecord.from_fields(broker.records.get_result(task_id) or {})
        assert [error["exception_class_path"] for error in record.errors] == cut_off_with
    assert other.terminate(timeout_s=60) == 0, other.log()
