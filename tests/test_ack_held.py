"""An ack's record write is held on one server: a run whose task was reaped writes no result."""

from __future__ import annotations

import threading
import time

import pytest

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task, encode_task
from tasks_app.protocol.enqueue import Enqueueable
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.scripts import Scripts

pytestmark = pytest.mark.django_db

ARGS = Arguments([], {})


def _run(broker: Broker, task: Task, consumer_id: str) -> tuple[bytes, int]:
    """Claim the one task of queue q as `consumer_id` and write its start: its bytes and token."""
    broker.leases.heartbeat(["q"], consumer_id, 10_000, {"lease_ms": 10_000})
    claim = broker.queue.claim_with_suspect("q", consumer_id, 1)
    assert claim is not None and len(claim.tasks) == 1
    task.attempt += 1
    assert (
        broker.records.record_result(records.started(task, ARGS, consumer_id, task.attempt, 3, 60, claim.first_fence))
        == 1
    )
    return claim.tasks[0], claim.first_fence


def _enqueued(broker: Broker, task_id: str) -> Task:
    task = Task(id=task_id, type="demo.echo", queue="q")
    broker.enqueuer.enqueue([Enqueueable(queue="q", raw=encode_task(task))], result_ttl_s=60)
    return task


def _ack(broker: Broker, consumer_id: str, raw: bytes, task: Task, fence: int) -> list[bool | None]:
    """Ack a run's success through a batcher, in one flush: the ack's flag."""
    batcher = AckBatcher(broker, threading.Event())
    outcome: list[bool | None] = []
    batcher.ack("q", consumer_id, raw, records.succeeded(task, f'"{consumer_id}"', 5, 60, fence, 0.1), outcome.append)
    assert batcher.flush_once(block_s=0.1) == 1
    return outcome


def _lapse_and_reap(broker: Broker, consumer_id: str) -> None:
    broker.client.zadd(broker.keys.consumers("q"), {consumer_id: 0})  # frozen past its lease
    assert broker.leases.reap("q", consumer_id, 10_000).requeued == 1


def _succeeded_this_minute(broker: Broker) -> int:
    return int(broker.client.hget(broker.keys.minute("q", int(time.time()) // 60), "ok") or 0)


def test_a_run_reaped_before_its_ack_lands_leaves_the_record_and_its_task_runs_once_more(broker):
    task = _enqueued(broker, "reaped-1")
    raw, fence = _run(broker, task, "c1")
    _lapse_and_reap(broker, "c1")  # the task waits as a suspect, claimed by nobody yet

    assert _ack(broker, "c1", raw, task, fence) == [False]  # c1 thaws and acks its success

    record = broker.records.get_result(task.id)
    assert (record["status"], record["fence"], record["worker_ids"]) == ("RUNNING", str(fence), '["c1"]')
    assert "return_value" not in record and "finished_at_ms" not in record
    assert broker.client.lrange(broker.keys.suspects("q"), 0, -1) == [raw]
    assert broker.client.zscore(broker.keys.history_status("q", "RUNNING"), task.id) is not None
    assert broker.client.zscore(broker.keys.history_status("q", records.SUCCESSFUL), task.id) is None
    assert _succeeded_this_minute(broker) == 0

    again, later = _run(broker, task, "c2")  # the rerun, exactly once more
    assert again == raw and later > fence
    assert _ack(broker, "c2", again, task, later) == [True]
    record = broker.records.get_result(task.id)
    assert (record["status"], record["return_value"], record["worker_ids"]) == ("SUCCESSFUL", '"c2"', '["c1","c2"]')
    assert broker.client.zscore(broker.keys.history_status("q", records.SUCCESSFUL), task.id) is not None
    assert _succeeded_this_minute(broker) == 1
    assert broker.client.llen(broker.keys.suspects("q")) == broker.client.llen(broker.keys.processing("q", "c2")) == 0
    assert set(broker.client.lrange(broker.keys.pending("q"), 0, -1)) <= {WAKE_TOKEN}  # a reap's wake-up at most
    assert broker.queue.claim_with_suspect("q", "c2", 1).tasks == []


def test_a_record_write_run_again_after_its_ack_is_written_only_if_the_ack_found_the_task(broker):
    scripts = Scripts()
    scripts.shas = {**scripts.shas, "record_result": "0" * 40}  # NOSCRIPT: re-run by source after the ack
    late = Broker(broker.client, broker.keys.prefix, scripts)
    task = _enqueued(broker, "rerun-1")
    raw, fence = _run(broker, task, "c1")

    assert _ack(late, "c1", raw, task, fence) == [True]
    record = broker.records.get_result(task.id)
    assert (record["status"], record["return_value"]) == (records.SUCCESSFUL, '"c1"')
    assert _succeeded_this_minute(broker) == 1

    reaped = _enqueued(broker, "rerun-2")
    raw, fence = _run(broker, reaped, "c3")
    _lapse_and_reap(broker, "c3")
    assert _ack(late, "c3", raw, reaped, fence) == [False]
    assert broker.records.get_result(reaped.id)["status"] == "RUNNING"
    assert _succeeded_this_minute(broker) == 1


def test_an_ack_of_a_consumer_id_another_instance_registered_writes_no_record(broker):
    task = _enqueued(broker, "restarted-1")
    raw, fence = _run(broker, task, "c1")
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000, "instance": "restart"})
    frozen = Broker(broker.client, broker.keys.prefix, broker.scripts)
    frozen.queue.instance = "frozen"

    assert _ack(frozen, "c1", raw, task, fence) == [False]
    assert broker.records.get_result(task.id)["status"] == "RUNNING"
    assert broker.client.lrange(broker.keys.processing("q", "c1"), 0, -1) == [raw]  # the restart's claim


@pytest.mark.parametrize("script", ["by SHA", "NOSCRIPT"])
@pytest.mark.parametrize("consumers", ["reaped", "foreign"])
def test_a_run_whose_id_left_the_consumers_but_whose_task_is_still_listed_writes_its_record(broker, script, consumers):
    # A reap moves at most REAP_BATCH tasks a call: the id is gone, the rest still wait in its list.
    task = _enqueued(broker, f"listed-{consumers}")
    raw, fence = _run(broker, task, "c1")
    broker.client.delete(broker.keys.consumers("q"))
    if consumers == "foreign":  # a foreign writer's key of another type: the list is searched
        broker.client.set(broker.keys.consumers("q"), "not a zset")
    acking = broker
    if script == "NOSCRIPT":  # the record write re-run by source after the ack took the task
        scripts = Scripts()
        scripts.shas = {**scripts.shas, "record_result": "0" * 40}
        acking = Broker(broker.client, broker.keys.prefix, scripts)

    assert _ack(acking, "c1", raw, task, fence) == [True]
    record = broker.records.get_result(task.id)
    assert (record["status"], record["return_value"]) == (records.SUCCESSFUL, '"c1"')
    assert broker.client.zscore(broker.keys.history_status("q", records.SUCCESSFUL), task.id) is not None
    assert _succeeded_this_minute(broker) == 1
    assert broker.client.llen(broker.keys.processing("q", "c1")) == 0
