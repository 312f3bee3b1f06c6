"""A consumer one of whose queues holds a key a foreign writer made another type: it starts and serves the
others, claims nothing from that queue, and joins it once the key is mended, without a restart."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tasks_app import producer
from tasks_app.consumer.claimer import ClaimerLoop
from tasks_app.protocol.broker import Broker
from tests.support.counters import sample
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs
from tests.test_consumer import make_consumer
from tests.test_foreign_key_types import spoil, spoil_as_string

pytestmark = pytest.mark.django_db(transaction=True)

REFUSED = "taskqueue_queue_refused_total"

# The keys of queue "bad" that registering there, or recovering what an earlier run of id "fixed" left, reads.
START_KEYS: dict[str, Callable[[Broker], str]] = {
    "consumers": lambda broker: broker.keys.consumers("bad"),
    "consumer_info": lambda broker: broker.keys.consumer_info("bad"),
    "primary": lambda broker: broker.keys.primary("bad"),
    "processing": lambda broker: broker.keys.processing("bad", "fixed"),
    "recoveries": lambda broker: broker.keys.recoveries("bad"),
    "suspects": lambda broker: broker.keys.suspects("bad"),
    "reaped": lambda broker: broker.keys.reaped("bad"),
    "dead": lambda broker: broker.keys.dead("bad"),
}


def left_by_an_earlier_run(broker: Broker) -> str:
    """A task of queue "bad" that an earlier run of id "fixed" claimed and never settled (it was killed); its id."""
    [task] = producer.enqueue("test.record", queue="bad")
    broker.client.lmove(broker.keys.pending("bad"), broker.keys.processing("bad", "fixed"), "RIGHT", "LEFT")
    return task.id


def ran(broker: Broker, task_id: str) -> bool:
    return any(run["task_id"] == task_id for run in recorded_runs(broker))


@pytest.mark.parametrize("name", list(START_KEYS))
def test_a_consumer_starts_beside_a_queue_whose_start_keys_are_foreign_and_joins_it_once_mended(
    broker, consumer_in_thread, caplog, name
):
    left = None if name == "processing" else left_by_an_earlier_run(broker)
    key = START_KEYS[name](broker)
    spoil_as_string(broker, key)
    [good] = producer.enqueue("test.record", queue="good")
    refused_before = sample(REFUSED, loop="registering", queue="bad")
    # Before: the refusal was a start-up error, and the consumer served none of its queues.
    with consumer_in_thread(queues=["bad", "good"], consumer_id="fixed") as consumer:
        wait_until(lambda: ran(broker, good.id), 15, message="the good queue's task to run")
        wait_until(lambda: sample(REFUSED, loop="registering", queue="bad") > refused_before + 1, 10, message="retries")
        said = [m for m in caplog.messages if m.startswith("registering:") and "of queue bad refused by Redis" in m]
        assert len(said) == 1 and "WRONGTYPE" in said[0] and key in said[0], said
        # Never claimed from, never a lease lost for it: no claim there is under a lease.
        assert consumer.consumer_id == "fixed" and len(recorded_runs(broker)) == 1
        if left is not None:
            assert broker.client.lrange(broker.keys.processing("bad", "fixed"), 0, -1), "left where it was"
        broker.client.delete(key)
        [later] = producer.enqueue("test.record", queue="bad")
        wait_until(lambda: ran(broker, later.id), 15, message="the mended queue's task to run, without a restart")
        if left is not None:
            wait_until(lambda: ran(broker, left), 15, message="the earlier run's task to be recovered and run")
        assert [c["id"] for c in broker.live_consumers("bad")] == ["fixed"] and consumer.consumer_id == "fixed"
    assert any(m.startswith("registering:") and "of queue bad works again" in m for m in caplog.messages)
    assert broker.live_consumers("bad") == [] and broker.live_consumers("good") == []


def test_a_consumer_that_lost_its_lease_moves_on_past_a_queue_whose_tombstones_are_foreign(broker):
    consumer = make_consumer(broker, queues=["a", "b"])
    spoil_as_string(broker, broker.keys.reaped("a"))
    consumer.lease_lost("me")  # before: the refused tombstone raised, and the consumer kept its lost id for good
    assert consumer.consumer_id == "me.1" and consumer.registration.current() == ("me.1", ["b"])
    assert consumer.registered_on("b") and not consumer.registered_on("a"), "claims nothing where it holds no lease"
    assert broker.client.zscore(broker.keys.reaped("b"), "me") is not None


@pytest.mark.parametrize("name", ["delayed", "consumer_info", "processing"])
def test_a_burst_consumer_exits_once_all_it_may_claim_is_done_beside_a_queue_it_cannot_read(
    broker, consumer_in_thread, caplog, name
):
    [good] = producer.enqueue("test.record", queue="good")
    [bad] = producer.enqueue("test.record", queue="bad")
    spoil_as_string(broker, START_KEYS[name](broker) if name in START_KEYS else broker.keys.delayed("bad"))
    # Before: the refused read of queue bad's stats kept the consumer from ever finding its queues idle.
    with consumer_in_thread(queues=["bad", "good"], consumer_id="fixed", burst=True):
        wait_until(lambda: "burst: nothing left to claim" in caplog.text, 20, message="the burst consumer to stop")
    assert ran(broker, good.id)
    left = [m for m in caplog.messages if m.startswith("burst: queue bad")]
    if name == "delayed":  # registered there, so it ran what it could claim before it stopped
        assert ran(broker, bad.id)
        assert len(left) == 1 and "cannot be read" in left[0] and broker.keys.delayed("bad") in left[0]
    else:  # not registered there: what waits there is left
        assert not ran(broker, bad.id) and broker.client.llen(broker.keys.pending("bad")) == 1
        assert len(left) == 1 and "1 task(s)" in left[0], left


def test_a_queue_whose_claims_are_refused_is_said_once_backed_off_and_claimed_from_once_mended(
    broker, consumer_in_thread, caplog
):
    key = broker.keys.fence("bad")  # read by claims only: the queue's counts read as usual
    spoil(broker, key)
    [bad] = producer.enqueue("test.record", queue="bad")
    [good] = producer.enqueue("test.record", queue="good")
    refused_before = sample(REFUSED, loop="claimer", queue="bad")
    with consumer_in_thread(queues=["bad", "good"], consumer_id="fixed"):
        wait_until(lambda: ran(broker, good.id), 15, message="the good queue's task to run")
        wait_until(lambda: sample(REFUSED, loop="claimer", queue="bad") > refused_before + 1, 10, message="retries")
        said = [m for m in caplog.messages if m.startswith("claimer:") and "of queue bad refused by Redis" in m]
        assert len(said) == 1 and "WRONGTYPE" in said[0] and key in said[0], said
        assert not any("redis error" in m for m in caplog.messages), "not taken for Redis away"
        assert broker.client.llen(broker.keys.pending("bad")) == 1, "before: claimed, then returned at every pass"
        broker.client.delete(key)
        wait_until(lambda: ran(broker, bad.id), 15, message="the mended queue's task to run, without a restart")
    assert any(m.startswith("claimer:") and "of queue bad works again" in m for m in caplog.messages)


def test_a_claimer_whose_claims_are_refused_tries_again_every_third_of_a_lease(broker):
    consumer = make_consumer(broker, queues=["bad"])
    spoil(broker, broker.keys.prioritized("bad"))
    loop = ClaimerLoop(consumer, "bad")
    for _ in range(2):
        assert loop.run_once() == pytest.approx(consumer.options.lease_s / 3)  # before: raised, retried as an outage
    broker.client.delete(broker.keys.prioritized("bad"))
    assert loop.run_once() == 0.0


def test_a_burst_consumer_exits_beside_a_queue_whose_claims_are_refused(broker, consumer_in_thread, caplog):
    [good] = producer.enqueue("test.record", queue="good")
    [bad] = producer.enqueue("test.record", queue="bad")
    spoil(broker, broker.keys.fence("bad"))
    # Before: its pending task, never claimed, kept the burst consumer running for good.
    with consumer_in_thread(queues=["bad", "good"], consumer_id="fixed", burst=True):
        wait_until(lambda: "burst: nothing left to claim" in caplog.text, 20, message="the burst consumer to stop")
    assert ran(broker, good.id) and not ran(broker, bad.id)
    assert broker.client.llen(broker.keys.pending("bad")) == 1
    [left] = [m for m in caplog.messages if m.startswith("burst: queue bad")]
    assert "1 task(s) pending" in left and "cannot claim" in left


def test_a_consumer_starts_and_serves_its_queues_beside_a_foreign_queue_set(broker, consumer_in_thread, caplog):
    [task] = producer.enqueue("test.record", queue="good")
    key = broker.keys.queues()  # lists queues for the dashboard only
    spoil_as_string(broker, key)
    # Before: registering failed at the set on every queue, and the consumer never started.
    with consumer_in_thread(queues=["good", "other"], consumer_id="fixed"):
        wait_until(lambda: ran(broker, task.id), 15, message="the task to run")
        assert {c["id"] for c in broker.live_consumers("good")} == {"fixed"}
    said = [m for m in caplog.messages if "queue set" in m]
    assert len(said) == 1 and "WRONGTYPE" in said[0] and key in said[0], said
    assert broker.client.get(key) == b"foreign"


@pytest.mark.parametrize("foreign_at_start", [True, False])
def test_a_running_consumer_lists_its_queues_again_once_the_queue_set_is_mended(
    broker, consumer_in_thread, caplog, foreign_at_start
):
    key = broker.keys.queues()  # lists queues for the dashboard only
    if foreign_at_start:
        spoil_as_string(broker, key)
    with consumer_in_thread(queues=["good", "other"], consumer_id="fixed") as consumer:
        wait_until(lambda: broker.live_consumers("good"), 10, message="the consumer to register")
        spoil_as_string(broker, key)  # a foreign writer's, then mended by deleting it
        broker.client.delete(key)
        lease_s = consumer.options.lease_s
        # Before: listed again only when the consumer registered again (a restart or a lost lease).
        listed = lambda: broker.client.smembers(key) == {b"good", b"other"}  # noqa: E731
        wait_until(listed, 2 * lease_s, message="the queues to be listed again within a lease")
        assert consumer.consumer_id == "fixed"
    mended = [m for m in caplog.messages if "queue set works again" in m]
    assert len(mended) == (1 if foreign_at_start else 0), caplog.messages


def test_a_queue_whose_lease_renewal_is_refused_starts_none_of_the_tasks_held_there_and_each_runs_once(
    broker, consumer_in_thread
):
    [blocker] = producer.enqueue("test.record", queue="good", kwargs={"hold_until": "release"})
    with consumer_in_thread(queues=["good", "bad"], consumer_id="fixed", concurrency=1, prefetch=1) as consumer:
        wait_until(lambda: ran(broker, blocker.id), 10, message="its one worker to be busy")
        [held] = producer.enqueue("test.record", queue="bad")
        wait_until(lambda: broker.held_by("bad", "fixed"), 10, message="a task of queue bad to be claimed ahead")
        key = broker.keys.consumer_info("bad")
        spoil(broker, key)  # read by every renewal there: refused from now on, the lease there lapses
        lapsed = lambda: broker.client.zscore(broker.keys.consumers("bad"), "fixed") < broker.server_time_ms()  # noqa: E731
        wait_until(lapsed, 10, message="the lease on queue bad to lapse")
        broker.client.set(f"{broker.keys.prefix}:release", 1)  # the worker is free for the task held
        wait_until(lambda: broker.get_result(blocker.id)["status"] == "SUCCESSFUL", 10, message="the blocker's end")
        broker.client.delete(key)  # mended: a reaper now recovers what the lapsed lease held there
        wait_until(lambda: ran(broker, held.id), 15, message="the task held there to run")
        wait_until(lambda: broker.get_result(held.id)["status"] == "SUCCESSFUL", 10, message="its end")
        # Before: started under the lapsed lease (renewed on queue good only), and again once recovered.
        assert [run["consumer"] for run in recorded_runs(broker) if run["task_id"] == held.id] == ["fixed.1"]
        assert consumer.consumer_id == "fixed.1"
