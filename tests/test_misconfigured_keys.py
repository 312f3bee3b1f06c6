"""A key of ours that holds another type is a misconfiguration: the loop says so once, readiness is red until fixed."""

from __future__ import annotations

import logging
import threading

import pytest

from tasks_app.consumer.lifecycle import EXIT_MISCONFIGURED, Consumer
from tasks_app.consumer.loops import Liveness, Misconfigured, SchedulerLoop, start_thread
from tasks_app.consumer.options import ConsumerOptions
from tests.support.claims import push, task_bytes
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs


def test_a_wrong_typed_key_of_ours_is_said_once_and_keeps_readiness_red_until_it_is_fixed(broker, caplog):
    caplog.set_level(logging.WARNING)
    broker.client.set(broker.keys.delayed("q"), "not a sorted set")  # WRONGTYPE for the scheduler's script
    misconfigured, stop = Misconfigured(), threading.Event()
    liveness = Liveness(None, stale_after_s=60, misconfigured=misconfigured.loops)
    liveness.beat()
    thread = start_thread(SchedulerLoop(broker, ["q"]), stop, misconfigured)
    try:
        wait_until(lambda: misconfigured.loops() == ["scheduler"], 10, message="the pass to fail")
        assert not liveness.ready() and liveness.healthy()
        wait_until(lambda: "WRONGTYPE" in caplog.text, 10, message="the error to be said")
        stop.wait(1.0)  # about four passes at the scheduler's pace, each failing the same way
        said = [r for r in caplog.records if "misconfigured" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.ERROR and "WRONGTYPE" in said[0].getMessage(), said
        broker.client.delete(broker.keys.delayed("q"))
        wait_until(lambda: liveness.ready(), 10, message="readiness to turn green once the key is fixed")
        assert misconfigured.loops() == []
        assert "scheduler: works again" in caplog.text
    finally:
        stop.set()
        thread.join(5)


def test_a_consumer_whose_lease_key_is_misconfigured_exits_at_start_saying_so(broker, caplog):
    broker.client.set(broker.keys.consumers("q"), "not a sorted set")
    consumer = Consumer(
        ConsumerOptions(queues=["q"], lease_s=2.0, grace_s=0.2, block_s=0.1, consumer_id="me"), broker=broker
    )
    assert consumer.run() == EXIT_MISCONFIGURED
    [said] = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert "misconfigured" in said and "WRONGTYPE" in said


@pytest.mark.django_db
def test_a_misconfigured_queue_leaves_the_consumers_other_queues_claimed(broker, consumer_in_thread, caplog):
    # Its claimer serves every queue: the refused claim of one must not hold up the others.
    broker.client.set(broker.keys.prioritized("bad"), "not a sorted set")  # WRONGTYPE for the claim's read
    with consumer_in_thread(queues=["bad", "good"]) as consumer:
        wait_until(lambda: "claimer:bad" in consumer.misconfigured.loops(), 10, message="the claim on bad to fail")
        push(broker, task_bytes("on-good", queue="good"), queue="good")
        wait_until(lambda: recorded_runs(broker), 10, message="the task on good to run")
        assert "claimer:good" not in consumer.misconfigured.loops()
    [said] = [r.getMessage() for r in caplog.records if "claimer:bad" in r.getMessage()]
    assert "misconfigured" in said and "WRONGTYPE" in said
