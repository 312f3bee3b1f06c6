"""Uniqueness keys (unique_until = finished) through kills, retries, dead letters, cancels and racing producers."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import tasks_app
from tasks_app import producer
from tasks_app.models import TaskType
from tests.support.process_tree import alive, children_of
from tests.support.processes import PROJECT_DIR, consumer_env, wait_until
from tests.support.recording import marks
from tests.support.throttle_handlers import HOLD_KEY_SUFFIX, MODULES, spans

pytestmark = pytest.mark.django_db(transaction=True)

UNIQUE = "uniq.span"
LEASE = ("--lease", "2")


def holder(broker, key: str = "k") -> str:
    """The id a second enqueue of the unique task answers with (a new task's when the key was free)."""
    [task] = producer.enqueue(UNIQUE, kwargs={"sleep_s": 0.05}, unique_key=key)
    return task.id


def starts(broker, task_id: str) -> list[int]:
    return [e["pid"] for e in spans(broker) if e["event"] == "start" and e["task_id"] == task_id]


def status(broker, task_id: str) -> str | None:
    return (broker.records.get_result(task_id) or {}).get("status")


@pytest.mark.parametrize("while_", ["running", "prefetched"])
def test_a_killed_consumers_task_keeps_its_key_through_its_rerun_and_frees_it_at_its_end(
    broker, consumer_process, while_
):
    TaskType.objects.create(name=UNIQUE, handler="test.span", unique_for_s=600, unique_until="finished")
    TaskType.objects.create(name="plain.span", handler="test.span")
    hold = f"{broker.keys.prefix}:{HOLD_KEY_SUFFIX}"
    broker.client.set(hold, 1)
    first = consumer_process("--concurrency", "1", "--prefetch", "1", *LEASE, TASK_HANDLER_MODULES=MODULES)
    wait_until(lambda: len(broker.inspect.queue_stats("default").consumers) == 1, 30, message="the first consumer")
    if while_ == "prefetched":  # a run ahead of it keeps the only worker: the unique task waits in the list
        [blocker] = producer.enqueue("plain.span", kwargs={"sleep_s": 2})
        wait_until(lambda: starts(broker, blocker.id), 15, message="the blocker to start")
    [task] = producer.enqueue(UNIQUE, kwargs={"hold": True}, unique_key="k")
    if while_ == "running":
        wait_until(lambda: starts(broker, task.id), 15, message="the unique task to start")
    else:
        wait_until(lambda: _held(broker, task.id), 15, message="the unique task to be prefetched")
    first.kill()
    assert holder(broker) == task.id  # its consumer is dead, its task not finished: the key holds

    other = consumer_process("--concurrency", "2", *LEASE, TASK_HANDLER_MODULES=MODULES)
    wait_until(lambda: other.pid in starts(broker, task.id), 20, message="the task to run again elsewhere")
    assert holder(broker) == task.id  # its rerun holds it
    broker.client.delete(hold)
    wait_until(lambda: status(broker, task.id) == "SUCCESSFUL", 20, message="the rerun to succeed")
    wait_until(lambda: holder(broker) != task.id, 5, message="the key to be freed by the rerun's end")


def _held(broker, task_id: str) -> bool:
    """Whether some consumer's processing list holds the task."""
    for key in broker.client.scan_iter(match=broker.keys.processing("default", "*")):
        if any(task_id.encode() in raw for raw in broker.client.lrange(key, 0, -1)):
            return True
    return False


def test_a_retried_task_keeps_its_key_and_its_dead_letter_frees_it(broker, consumer_process):
    TaskType.objects.create(
        name="uniq.record",
        handler="test.record",
        unique_for_s=600,
        unique_until="finished",
        max_attempts=2,
        retry_backoff=4,
    )
    [task] = producer.enqueue("uniq.record", kwargs={"fail_until_attempt": 2}, unique_key="k")
    consumer_process("--concurrency", "2", *LEASE)
    wait_until(lambda: broker.client.zcard(broker.keys.delayed("default")), 15, message="the first attempt's retry")
    assert producer.enqueue("uniq.record", unique_key="k")[0].id == task.id  # waiting for its retry: held
    wait_until(lambda: status(broker, task.id) == "FAILED", 30, message="both attempts to fail")
    assert not producer.enqueue("uniq.record", unique_key="k")[0].duplicate  # failed for good: the key is free


def test_a_run_outlasting_its_window_leaves_the_key_of_the_task_enqueued_after_it_alone(broker, consumer_process):
    TaskType.objects.create(name=UNIQUE, handler="test.span", unique_for_s=1, unique_until="finished")
    hold = f"{broker.keys.prefix}:{HOLD_KEY_SUFFIX}"
    broker.client.set(hold, 1)
    consumer_process("--concurrency", "1", "--prefetch", "0", *LEASE, TASK_HANDLER_MODULES=MODULES)
    [first] = producer.enqueue(UNIQUE, kwargs={"hold": True}, unique_key="k")
    wait_until(lambda: starts(broker, first.id), 15, message="the first run")
    time.sleep(1.2)  # past the window: the key lapsed while the first run goes on
    [second] = producer.enqueue(UNIQUE, kwargs={"sleep_s": 0}, unique_key="k", delay_s=3)
    assert not second.duplicate
    broker.client.delete(hold)
    wait_until(lambda: status(broker, first.id) == "SUCCESSFUL", 15, message="the first run to end")
    assert holder(broker) == second.id  # the first one's end freed no key of another task
    wait_until(lambda: status(broker, second.id) == "SUCCESSFUL", 15, message="the second run")


# Run by `manage.py shell -c` in each racing process: enqueue at RACE_AT (wall clock), under RACE_ID if set.
RACER = """
import os, time
from tasks_app import producer
at, task_id = float(os.environ["RACE_AT"]), os.environ["RACE_ID"] or None
while time.time() < at:
    pass
[task] = producer.enqueue_many([producer.TaskRequest(type="uniq.race", args=[1], task_id=task_id)])
print("ANSWER", task.id, task.duplicate)
"""


@pytest.mark.parametrize("ids", ["generated", "own", "shared"])
def test_producers_in_many_processes_enqueueing_one_unique_task_at_once_push_one(broker, key_prefix, ids):
    TaskType.objects.create(name="uniq.race", handler="test.record", unique_for_s=600, unique_until="finished")
    at = time.time() + 3  # every process started, Django set up, spinning on the clock
    caller_ids = {"generated": [""] * 6, "own": [f"caller-{n}" for n in range(6)], "shared": ["caller"] * 6}[ids]
    racers = [
        subprocess.Popen(
            [sys.executable, str(PROJECT_DIR / "manage.py"), "shell", "-c", RACER],
            cwd=PROJECT_DIR,
            env=consumer_env(key_prefix, RACE_AT=str(at), RACE_ID=caller_id),
            stdout=subprocess.PIPE,
            text=True,
        )
        for caller_id in caller_ids
    ]
    outputs = [racer.communicate(timeout=60)[0] for racer in racers]
    answers = [line.split()[1:] for out in outputs for line in out.splitlines() if line.startswith("ANSWER ")]
    assert len(answers) == len(racers), outputs
    assert len({task_id for task_id, _ in answers}) == 1, answers
    assert sorted(duplicate for _, duplicate in answers) == ["False"] + ["True"] * 5
    assert broker.client.llen(broker.keys.pending("default")) == 1


def test_a_forced_cancel_of_a_run_stuck_in_c_frees_its_key_only_once_its_process_is_gone(broker, consumer_process):
    TaskType.objects.create(name="uniq.hang", handler="test.hang", unique_for_s=600, unique_until="finished")
    group = consumer_process("--processes", "1", "--concurrency", "2", "--grace", "0.5", "--timeout-grace", "1")
    wait_until(lambda: children_of(group.pid), 30, message="the child to start")
    [stuck] = producer.enqueue("uniq.hang", kwargs={"sleep_s": 30}, unique_key="k")
    wait_until(lambda: marks(broker), 30, message="the stuck handler to start")
    [start] = marks(broker)
    tasks_app.cancel(stuck.id, force=True)
    wait_until(lambda: status(broker, stuck.id) == "CANCELLED", 15, message="the stuck task to be cancelled")
    while alive(start["pid"]):  # its handler may run on until its process is gone: the key holds
        assert producer.enqueue("uniq.hang", kwargs={"sleep_s": 0}, unique_key="k")[0].id == stuck.id
        time.sleep(0.05)
    wait_until(
        lambda: producer.enqueue("uniq.hang", kwargs={"sleep_s": 0}, unique_key="k")[0].id != stuck.id,
        30,
        message="the key to be freed once the process is gone",
    )
