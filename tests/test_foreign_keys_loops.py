"""A consumer's loops beside a queue whose key a foreign writer made another type: only that queue is left undone."""

from __future__ import annotations

import logging
import re
import time

import pytest
from redis.exceptions import ResponseError

from tasks_app import producer
from tasks_app.consumer.control import Running, RunWatch
from tasks_app.consumer.limits import RateLimiter
from tasks_app.consumer.loops import HeartbeatLoop, LeaseClock, ReaperLoop, SchedulerLoop
from tasks_app.consumer.timeouts import RunClock
from tasks_app.context import TaskContext
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tests.integration.test_rate_follow_ups import LIMITED, TYPE, defer, due_now
from tests.support.claims import claim, push, register, task_bytes
from tests.support.counters import sample
from tests.test_foreign_key_types import spoil, spoil_as_string

pytestmark = pytest.mark.django_db

REFUSED = "taskqueue_queue_refused_total"
SHORT_LEASE_MS = 100


def _due(broker: Broker, queue: str) -> None:
    """A task of `queue` in its delayed set, due already."""
    producer.enqueue("demo.echo", queue=queue, delay_s=0.01)
    time.sleep(0.02)


def _refusals(caplog: pytest.LogCaptureFixture, queue: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"of queue {queue}" in r.getMessage()]


def test_a_foreign_delayed_set_stops_no_other_queues_promotions_and_is_said_once(broker, caplog):
    _due(broker, "a")
    _due(broker, "b")
    spoil(broker, broker.keys.delayed("a"))
    loop = SchedulerLoop(broker, ["a", "b"])
    refused_before = sample(REFUSED, loop="scheduler", queue="a")
    caplog.set_level(logging.INFO)
    for _ in range(3):
        loop.run_once()  # before: WRONGTYPE raised at queue a, b's task never promoted
    assert broker.queue_stats("b").pending == 1 and broker.queue_stats("b").delayed == 0
    # Each pass counts its refused promotion (and the first its refused backlog sample); the log says each once.
    assert sample(REFUSED, loop="scheduler", queue="a") - refused_before == 3 + 1
    [said] = [line for line in _refusals(caplog, "a") if "promoting due tasks" in line]
    assert "WRONGTYPE" in said and "the others go on" in said
    broker.client.delete(broker.keys.delayed("a"))
    loop.run_once()
    assert "promoting due tasks of queue a works again" in _refusals(caplog, "a")[-1]


@pytest.mark.parametrize("name", ["pending", "dead"])
def test_a_foreign_pending_list_or_dead_set_stops_no_other_queues_trimming_and_sampling(broker, name):
    for queue in ("a", "b"):
        for n in range(3):
            broker.client.zadd(broker.keys.dead(queue), {f"gone-{n}": time.time() * 1000 - n})
    producer.enqueue("demo.echo", queue="b")
    spoil(broker, getattr(broker.keys, name)("a"))
    history = broker.keys.history("b")
    broker.client.persist(history)
    SchedulerLoop(broker, ["a", "b"], dead_letter_max=1).run_once()  # before: WRONGTYPE at queue a
    assert broker.client.zcard(broker.keys.dead("b")) == 1
    minute = broker.keys.minute("b", int(time.time()) // 60)
    assert broker.client.hget(minute, "backlog") == b"1"
    assert broker.client.ttl(history) > 0


# --- reaper -------------------------------------------------------------------------------
def _dies_holding(broker: Broker, consumer_id: str, task_id: str, queue: str = "q") -> None:
    """A consumer of `queue` that claimed one task and whose lease then lapsed."""
    push(broker, task_bytes(task_id, queue=queue), queue=queue)
    register(broker, consumer_id, SHORT_LEASE_MS, queue)
    claim(broker, consumer_id, 1, queue)


def _reaper(broker: Broker, queues: list[str]) -> ReaperLoop:
    return ReaperLoop(broker, queues, SHORT_LEASE_MS / 1000, lambda queue, dead: None)


@pytest.mark.parametrize("name", ["consumers", "reaped"])
def test_a_queue_whose_leases_are_foreign_keeps_no_other_queues_dead_consumers_unreaped(broker, name):
    _dies_holding(broker, "dead", "t1", queue="b")
    spoil(broker, getattr(broker.keys, name)("a"))
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    _reaper(broker, ["a", "b"]).run_once()  # before: WRONGTYPE at queue a, b's dead consumer kept its task
    assert broker.held_by("b", "dead") == [] and broker.queue_stats("b").pending == 1


@pytest.mark.parametrize("name", ["consumers", "reaped"])
def test_the_reapers_refused_look_for_dead_consumers_names_the_key(broker, caplog, name):
    key = getattr(broker.keys, name)("a")
    spoil(broker, key)
    with pytest.raises(ResponseError, match=re.escape(key)):  # before: Redis's error alone, naming no key
        broker.reap_candidates("a")
    _reaper(broker, ["a"]).run_once()
    [said] = _refusals(caplog, "a")
    assert "WRONGTYPE" in said and key in said


def test_a_dead_consumers_foreign_list_keeps_no_other_dead_consumer_of_its_queue_unreaped(broker, caplog):
    _dies_holding(broker, "spoilt", "t1")
    spoil(broker, broker.keys.processing("q", "spoilt"))
    _dies_holding(broker, "dead", "t2")  # its lease lapses after the spoilt one's: it is listed after it
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    loop = _reaper(broker, ["q"])
    loop.run_once()  # before: WRONGTYPE at the spoilt one, the other never reaped
    suspects = broker.keys.suspects("q")  # where recovered tasks go
    assert broker.held_by("q", "dead") == [] and broker.client.llen(suspects) == 1
    spoil(broker, broker.keys.processing("q", "dead"))  # a foreign write to a reaped one's list, its tombstone kept
    _dies_holding(broker, "later", "t3")
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    loop.run_once()  # before: that tombstone's list refused every later reaping of the queue, for a day
    assert broker.held_by("q", "later") == [] and broker.client.llen(suspects) == 2
    said = _refusals(caplog, "q")
    assert len(said) == 2 and "reaping consumer spoilt" in said[0] and "reaping consumer dead" in said[1]
    assert all("WRONGTYPE" in line for line in said)


@pytest.mark.parametrize("name", ["suspects", "recoveries"])
def test_a_dead_consumers_tasks_stay_in_its_list_while_where_they_go_is_foreign(broker, name):
    _dies_holding(broker, "dead", "t1")
    key = getattr(broker.keys, name)("q")
    broker.client.set(key, "foreign")  # a string where a list, a hash or a sorted set is kept
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    loop = _reaper(broker, ["q"])
    for _ in range(3):
        loop.run_once()
    assert len(broker.held_by("q", "dead")) == 1  # before: popped by the first pass, then lost in the error
    broker.client.delete(key)
    loop.run_once()
    assert broker.held_by("q", "dead") == [] and broker.client.llen(broker.keys.suspects("q")) == 1


# --- heartbeat ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["consumers", "consumer_info", "primary"])
def test_a_queue_whose_lease_keys_are_foreign_keeps_the_lease_renewed_on_every_other_queue_and_is_lost_there(
    broker, caplog, name
):
    lost: list[tuple[str, list[str]]] = []
    broker.heartbeat(["a", "b"], "c1", 9000, {"lease_ms": 9000, "instance": "i1"})
    key = getattr(broker.keys, name)("a")
    broker.client.delete(key)
    broker.client.rpush(key, "foreign")  # a list where a hash or a sorted set is kept
    lease = LeaseClock(9.0)
    loop = HeartbeatLoop(broker, lambda: ("c1", ["a", "b"]), lease, lambda *loss: lost.append(loss), instance="i1")
    deadline_before = broker.client.zscore(broker.keys.consumers("b"), "c1")
    time.sleep(0.01)
    for _ in range(2):
        assert loop.run_once() == pytest.approx(3.0)  # before: retried as an outage, the lease never renewed
    # Lost there at once (the consumer moves on to a new id), not left to lapse: once the key is mended a
    # reaper could recover what the id holds there before a renewal saw it (before: lost == []).
    assert lost == [("c1", ["a"])] * 2
    assert broker.client.zscore(broker.keys.consumers("b"), "c1") > deadline_before
    [said] = _refusals(caplog, "a")
    assert "renewing the lease of queue a refused by Redis" in said and "WRONGTYPE" in said


# --- housekeeping: cancel requests of running tasks -----------------------------------------
def _running(task_id: str, queue: str) -> Running:
    context = TaskContext(task_id, "test.record", queue, 1, 3, {}, "c1")
    return Running(Task(id=task_id, type="test.record", queue=queue), RunClock(None), context)


def test_a_queue_whose_cancel_requests_are_foreign_keeps_no_other_queues_runs_from_their_cancels(broker):
    runs = [_running("t-a", "a"), _running("t-b", "b")]
    spoil(broker, broker.keys.cancel_requests("a"))
    broker.client.zadd(broker.keys.cancel_requests("b"), {"t-b": time.time() * 1000})
    RunWatch(broker, lambda update: None, 60).tick(runs)  # before: WRONGTYPE at queue a, b's run never told
    assert runs[1].context.cancelled and not runs[0].context.cancelled


# --- rate-limit follow-ups ------------------------------------------------------------------
def test_a_queue_whose_delayed_set_is_foreign_keeps_no_other_queues_deferrals_from_a_removed_limit(broker, caplog):
    defer(broker, "a", 1)  # listed first
    deferred = defer(broker, "b", 3)
    spoil(broker, broker.keys.delayed("a"))
    assert broker.rate_removed(TYPE, None, LIMITED.queue)  # lists a, b and the type's own queue
    refused_before = sample(REFUSED, loop="rate-follow-up", queue="a")
    RateLimiter(broker)._follow_up(TYPE, [None])  # before: WRONGTYPE at queue a, b's tasks left at their slots
    assert due_now(broker, "b", deferred)
    assert broker.rate_follow_ups(TYPE, None) == {}  # queue a too: its tasks take their new slots when they wake
    assert sample(REFUSED, loop="rate-follow-up", queue="a") - refused_before == 1
    [said] = _refusals(caplog, "a")
    assert "WRONGTYPE" in said


# --- giving back what a consumer holds (a stop, a pause, a retiring id) ------------------------
def test_a_leave_refused_at_a_foreign_pending_list_loses_none_of_the_tasks_it_held(broker):
    register(broker, "old", 60_000, "a")
    broker.client.lpush(broker.keys.processing("a", "old"), task_bytes("t1", queue="a"))
    spoil_as_string(broker, broker.keys.pending("a"))
    with pytest.raises(ResponseError, match=broker.keys.pending("a")):
        broker.deregister("a", "old")  # before: it took the task off the list, then failed putting it back
    assert broker.client.llen(broker.keys.processing("a", "old")) == 1


def test_a_return_refused_at_a_foreign_pending_list_loses_none_of_the_tasks_it_returns(broker):
    register(broker, "c1", 60_000, "a")
    task = task_bytes("t1", queue="a")
    broker.client.lpush(broker.keys.processing("a", "c1"), task)
    spoil_as_string(broker, broker.keys.pending("a"))
    with pytest.raises(ResponseError, match=broker.keys.pending("a")):
        broker.return_unstarted("a", "c1", [task])  # before: it took the task off the list, then failed putting it back
    assert broker.held_by("a", "c1") == [task]


@pytest.mark.parametrize("name", ["prioritized", "suspects", "fence", "processing"])
def test_a_claim_refused_at_a_foreign_key_names_it_and_moves_nothing(broker, name):
    register(broker, "c1", 60_000, "a")
    push(broker, task_bytes("t1", queue="a"), queue="a")
    suspect = task_bytes("s1", queue="a")
    broker.client.rpush(broker.keys.suspects("a"), suspect)
    key = broker.keys.processing("a", "c1") if name == "processing" else getattr(broker.keys, name)("a")
    spoil(broker, key)
    with pytest.raises(ResponseError, match=re.escape(key)):
        broker.claim_with_suspect("a", "c1", 10)  # before: the suspect or the tasks moved, then WRONGTYPE
    assert broker.client.llen(broker.keys.pending("a")) == 1
    if name != "suspects":
        assert broker.client.lrange(broker.keys.suspects("a"), 0, -1) == [suspect]
