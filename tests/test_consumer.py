"""The consumer's own logic: backpressure, claiming, suspects, identity, shutdown and signals."""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue as queue_module
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from tasks_app.consumer import supervisor as stop_signals
from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import encode_arguments, payload_of
from tasks_app.protocol.enqueue import Enqueueable
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.leases import MAX_RECOVERIES
from tests.support.claims import claim, die_running, push, register, task_bytes
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = pytest.mark.django_db(transaction=True)


def make_consumer(broker: Broker, **options: object) -> Consumer:
    """A registered consumer on queue "q" whose threads are not started: tests drive it by hand."""
    opts = {
        "queues": ["q"],
        "concurrency": 2,
        "prefetch": 1,
        "lease_s": 2.0,
        "grace_s": 0.2,
        "block_s": 0.1,
        "consumer_id": "me",
        **options,
    }
    consumer = Consumer(ConsumerOptions(**opts), broker=broker)  # type: ignore[arg-type]
    consumer.membership.register()
    consumer.task_types.refresh()  # as start() does: claimers wait until the task types were read
    return consumer


@pytest.fixture
def consumer(broker: Broker) -> Iterator[Consumer]:
    consumer = make_consumer(broker)
    yield consumer
    consumer.give_up.set()


def handed_to_workers(consumer: Consumer) -> list[Claimed]:
    """Take everything dispatched to the (not running) workers off their queue."""
    items = []
    while True:
        try:
            items.append(consumer.work.get_nowait())
        except queue_module.Empty:
            return items


def make_suspect(broker: Broker, died_id: str) -> None:
    """Move the next pending task to the suspects list, as a consumer that died holding it does."""
    register(broker, died_id, lease_ms=50)
    claim(broker, died_id, 1)
    time.sleep(0.06)
    assert broker.leases.reap("q", died_id, 50).requeued == 1


def claim_all(broker: Broker) -> list[bytes]:
    """Everything a fresh consumer would claim next, in order."""
    register(broker, "next", lease_ms=10_000)
    return claim(broker, "next", 100)


# --- options ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queues": []}, "at least one queue"),
        ({"queues": ["a b"]}, "queue"),
        ({"concurrency": 0}, "concurrency"),
        ({"prefetch": -1}, "prefetch"),
        ({"lease_s": 0.4}, "lease"),
        ({"grace_s": -1}, "grace"),
        ({"lease_s": math.inf}, "lease"),
        ({"grace_s": math.inf}, "grace"),
        ({"grace_s": 1e300}, "grace"),
        ({"hard_limit_grace_s": math.nan}, "timeout grace"),
        ({"consumer_id": "x/y"}, "consumer id"),
    ],
)
def test_options_that_cannot_work_are_refused(broker, options, message):
    with pytest.raises(ValueError, match=message):
        Consumer(ConsumerOptions(**options), broker=broker)


# --- claiming -----------------------------------------------------------------------------
def test_the_claimer_takes_at_most_concurrency_plus_prefetch(broker, consumer):
    push(broker, *(task_bytes(f"t{n}") for n in range(10)))
    loop = consumer.claimer("q")
    assert loop.run_once() == 0.0
    claimed = handed_to_workers(consumer)
    assert [item.raw for item in claimed] == [task_bytes(f"t{n}") for n in range(3)]
    assert consumer.capacity.in_use == 3
    assert set(broker.queue.held_by("q", "me")) == set(consumer.held.raws("q", "me")) == {item.raw for item in claimed}
    loop.run_once()  # full: waits for a slot, claims nothing
    assert len(broker.queue.held_by("q", "me")) == 3 and handed_to_workers(consumer) == []
    assert broker.inspect.queue_stats("q").pending == 7
    assert consumer.held.take_suspect_turn(), "no suspect was taken, so the turn is free"


def test_a_claim_of_fewer_tasks_than_room_keeps_only_their_slots(broker, consumer):
    push(broker, task_bytes("a"), task_bytes("b"))
    consumer.claimer("q").run_once()
    assert len(handed_to_workers(consumer)) == 2 and consumer.capacity.in_use == 2


def test_a_claim_that_finds_nothing_gives_every_slot_back(broker, consumer):
    loop = consumer.claimer("q")
    assert loop.run_once() == 0.0
    assert consumer.capacity.in_use == 0 and handed_to_workers(consumer) == []
    assert consumer.held.take_suspect_turn(), "the suspect turn was given back"


def test_a_blocking_claim_returns_the_task_pushed_while_it_waits(broker):
    consumer = make_consumer(broker, block_s=2.0)
    threading.Timer(0.1, push, args=(broker, task_bytes("late"))).start()
    consumer.claimer("q").run_once()
    assert [item.raw for item in handed_to_workers(consumer)] == [task_bytes("late")]
    assert consumer.capacity.in_use == 1 and broker.queue.held_by("q", "me") == [task_bytes("late")]


def test_a_wake_token_is_dropped_and_the_prioritized_task_claimed_next(broker):
    consumer = make_consumer(broker, block_s=2.0)
    urgent = task_bytes("urgent", priority=5)
    threading.Timer(0.1, broker.enqueuer.enqueue, args=([Enqueueable(queue="q", raw=urgent, priority=5)], 60)).start()
    loop = consumer.claimer("q")
    loop.run_once()  # woken by the token, which is not a task
    assert handed_to_workers(consumer) == [] and consumer.capacity.in_use == 0
    loop.run_once()
    assert [item.raw for item in handed_to_workers(consumer)] == [urgent]
    assert broker.queue.held_by("q", "me") == [urgent], "the wake token left the processing list"
    assert WAKE_TOKEN not in broker.client.lrange(broker.keys.pending("q"), 0, -1)


def test_a_lost_lease_releases_the_slots_and_moves_to_a_new_identity(broker, consumer):
    push(broker, task_bytes("t"))
    broker.client.zrem(broker.keys.consumers("q"), "me")  # reaped while we were away
    consumer.claimer("q").run_once()
    assert consumer.capacity.in_use == 0 and handed_to_workers(consumer) == []
    assert consumer.consumer_id == "me.1" and consumer.executor.worker_id == "me.1"
    assert [c["id"] for c in broker.inspect.queue_stats("q").consumers] == ["me.1"]
    assert consumer.held.take_suspect_turn()
    consumer.claimer("q").run_once()
    assert broker.queue.held_by("q", "me.1") == [task_bytes("t")]


def test_lease_lost_for_an_old_identity_changes_nothing(broker, consumer):
    consumer.membership.lease_lost("me")
    consumer.membership.lease_lost("me")  # a second thread reporting the same loss
    assert consumer.consumer_id == "me.1"
    consumer.membership.lease_lost("me.1")
    assert consumer.consumer_id == "me.2"
    assert sorted(c["id"] for c in broker.inspect.queue_stats("q").consumers) == ["me", "me.1", "me.2"]


def test_a_lease_lost_as_the_consumer_leaves_registers_no_new_id(broker, consumer):
    # Before: the heartbeat's new id, registered just after the stop deregistered the old one, outlived the process.
    consumer.membership.leave()
    consumer.membership.lease_lost("me")
    assert consumer.consumer_id == "me"
    assert broker.inspect.queue_stats("q").consumers == []


def test_one_suspect_at_a_time_and_its_slot_is_held_until_it_leaves(broker, consumer):
    fresh = task_bytes("fresh")
    push(broker, task_bytes("s1"), task_bytes("s2"))
    make_suspect(broker, "died-1")
    make_suspect(broker, "died-2")
    push(broker, fresh)
    loop = consumer.claimer("q")
    loop.run_once()
    [suspect, other] = handed_to_workers(consumer)
    assert suspect.suspect and not other.suspect and other.raw == fresh
    assert not consumer.held.take_suspect_turn(), "the turn is held while the suspect is"
    loop.run_once()  # the other suspect waits: this consumer already holds one
    assert handed_to_workers(consumer) == [] and consumer.capacity.in_use == 2
    consumer.claiming_stopped.set()
    consumer.dispatch([suspect])  # stopping: straight back to the suspects list
    assert consumer.held.take_suspect_turn(), "a suspect that left gives its turn back"
    assert broker.client.llen(broker.keys.suspects("q")) == 2


def test_a_redis_error_mid_claim_releases_everything_then_reconciles_the_lost_reply(broker):
    # A client that gives up on a blocking claim before it ends: a real error on the wire.
    impatient = Broker(redis.Redis.from_url(settings.REDIS_URL, socket_timeout=0.1), broker.keys.prefix)
    consumer = make_consumer(impatient, block_s=1.0)
    loop = consumer.claimer("q")
    with pytest.raises(RedisError):
        loop.run_once()
    assert consumer.capacity.in_use == 0 and consumer.held.take_suspect_turn()
    consumer.held.give_suspect_turn_back()
    stray = task_bytes("moved-but-never-heard-of")
    push(broker, stray)
    claim(broker, "me", 1)  # what a claim whose reply was lost leaves behind
    loop.run_once()
    assert [item.raw for item in handed_to_workers(consumer)] == [stray], "returned, then claimed knowingly"
    assert broker.queue.held_by("q", "me") == [stray] and set(consumer.held.raws("q", "me")) == {stray}


def test_a_redis_error_in_a_wait_with_no_claim_before_it_reconciles_at_the_next_turn(broker):
    impatient = Broker(redis.Redis.from_url(settings.REDIS_URL, socket_timeout=0.1), broker.keys.prefix)
    consumer = make_consumer(impatient, block_s=1.0)
    loop = consumer.claimer("q")
    loop._quiet_until = time.monotonic() + 60  # as after a wait that timed out empty: the next waits straight away
    with pytest.raises(RedisError):
        loop.run_once()
    stray = task_bytes("moved-but-never-heard-of")
    push(broker, stray)
    claim(broker, "me", 1)  # what a move whose reply was lost leaves behind
    loop._quiet_until = 0.0
    loop.run_once()
    assert [item.raw for item in handed_to_workers(consumer)] == [stray], "returned at once, not a lease later"


# --- dispatch and shutdown ----------------------------------------------------------------
def test_dispatch_while_stopping_returns_the_tasks_at_once(broker, consumer):
    push(broker, task_bytes("a"), task_bytes("b"))
    raws = claim(broker, "me", 2)
    consumer.capacity.acquire_up_to(2)
    consumer.claiming_stopped.set()
    consumer.dispatch([Claimed("q", "me", raw) for raw in raws])
    assert handed_to_workers(consumer) == []
    assert broker.queue.held_by("q", "me") == [] and not consumer.held.raws("q", "me")
    assert consumer.capacity.in_use == 0
    assert broker.inspect.queue_stats("q").pending == 2


def test_shutdown_returns_unstarted_tasks_in_order_and_deregisters(broker, consumer):
    push(broker, *(task_bytes(f"t{n}") for n in range(5)))
    consumer.claimer("q").run_once()
    assert consumer.capacity.in_use == 3
    assert consumer.shutdown() == 0
    assert consumer.capacity.in_use == 0 and broker.queue.held_by("q", "me") == []
    assert broker.inspect.queue_stats("q").consumers == []
    next_up = claim_all(broker)
    assert next_up == [task_bytes(f"t{n}") for n in range(5)], "the returned ones run first, in order"


def test_a_task_still_running_when_the_grace_period_ends_is_given_up_on_and_retried(broker, consumer_in_thread, caplog):
    with consumer_in_thread(queues=["q"], concurrency=1, grace_s=0.2):
        push(broker, task_bytes("slow", payload=payload_of(*encode_arguments([], {"sleep_s": 1.5}))))
        wait_until(lambda: recorded_runs(broker), 5, message="the slow task to start")
    stats = broker.inspect.queue_stats("q")
    assert (stats.pending, stats.processing, stats.delayed, stats.consumers) == (0, 0, 1, [])
    assert "grace period over with 1 task(s) still running: 1 run(s) given up on" in caplog.text


def test_a_poison_pill_dead_lettered_by_the_reaper_gets_a_failed_record(broker, consumer_in_thread):
    push(broker, task_bytes("poison"))
    for victim in range(MAX_RECOVERIES):
        die_running(broker, f"victim-{victim}", 50)
        broker.leases.reap("q", f"victim-{victim}", 50)
    die_running(broker, "last-victim", 50)  # the consumer's own reaper finds this one
    with consumer_in_thread(queues=["q"]):
        wait_until(
            lambda: (broker.records.get_result("poison") or {}).get("status") == "FAILED",
            5,
            message="the poison pill's record to say FAILED",
        )
    record = broker.records.get_result("poison")
    assert "recovered 4 times from consumers that died running it" in record["dead_reason"]
    assert json.loads(record["errors"])[-1]["exception_class_path"] == "ConsumerDied"
    assert broker.inspect.queue_stats("q").dead == 1 and recorded_runs(broker) == []


def test_the_reapers_failed_records_ride_out_an_outage_and_one_refused_stops_none_of_the_others(
    broker, consumer_in_thread, monkeypatch, caplog
):
    # Before: the first error lost the records of this and every later pill of the batch for good
    # (they were dead letters already, so no later pass came back to them).
    pills = {name: task_bytes(name) for name in ("flaky", "refused", "plain")}
    register(broker, "victim", lease_ms=50)
    for raw in pills.values():  # each has killed three consumers already, and ran on this one too
        broker.client.lpush(broker.keys.processing("q", "victim"), raw)
        digest = hashlib.sha1(raw).hexdigest()
        broker.client.hset(broker.keys.recoveries("q"), mapping={digest: MAX_RECOVERIES, f"s:{digest}": 1})
    broker.client.set(broker.keys.result("refused"), "a foreign writer's string")
    record_result, failed_once = broker.records.record_result, []

    def flaky_record_result(update):
        if update.task_id == "flaky" and not failed_once:
            failed_once.append(update)
            raise RedisConnectionError("the connection dropped")
        return record_result(update)

    monkeypatch.setattr(broker.records, "record_result", flaky_record_result)
    time.sleep(0.06)
    with consumer_in_thread(queues=["q"]):
        wait_until(
            lambda: (
                [(broker.records.get_result(name) or {}).get("status") for name in ("flaky", "plain")] == ["FAILED"] * 2
            ),
            10,
            message="the pills' records to say FAILED",
        )
    assert failed_once and broker.inspect.queue_stats("q").dead == 3
    assert "could not record dead-lettered task refused as failed" in caplog.text


def test_a_task_claimed_under_a_lost_identity_is_left_to_the_reaper(broker, consumer_in_thread):
    with consumer_in_thread(queues=["q"], concurrency=1) as running:
        old_id = running.consumer_id
        wait_until(lambda: broker.inspect.queue_stats("q").consumers, 5, message="the consumer to register")
        running.membership.lease_lost(old_id)  # as if the heartbeat found the lease gone
        raw = task_bytes("t")
        broker.client.lpush(broker.keys.processing("q", old_id), raw)  # claimed just before the loss
        running.capacity.acquire_up_to(1)
        running.dispatch([Claimed("q", old_id, raw)])
        wait_until(lambda: not running.held.raws("q", old_id), 5, interval_s=0.01, message="a worker to let go of it")
        assert recorded_runs(broker) == [], "it did not run under the lost identity"
        assert broker.queue.held_by("q", old_id) == [raw], "the reaper recovers it from the old list"


def test_reconciling_never_returns_a_byte_identical_twin_that_is_still_held(broker, consumer_in_thread):
    # A foreign producer may push the same bytes twice: two claims, two runs, both held at once.
    twin = task_bytes("twin", payload=payload_of(*encode_arguments([], {"sleep_s": 0.4})))
    with consumer_in_thread(queues=["q"], concurrency=1, prefetch=1) as running:
        push(broker, twin, twin)
        wait_until(lambda: len(recorded_runs(broker)) == 2, 5, message="the second twin to start")
        assert broker.queue.held_by("q", running.consumer_id) == [twin], "the second twin is held while it runs"
        running.claimer("q").reconcile()  # what a claim error now would do
        time.sleep(0.6)
    assert len(recorded_runs(broker)) == 2, "the running twin was returned to pending and ran again"


def test_a_claimer_audits_its_list_only_after_a_claim_that_may_have_moved_tasks(
    broker, consumer_in_thread, monkeypatch
):
    # Only a claim adds to a processing list: an idle queue's claimer has no strays to look for.
    with consumer_in_thread(queues=["q", "r"], concurrency=1) as running:
        wait_until(lambda: broker.inspect.queue_stats("q").consumers, 5, message="the consumer to register")
        claimer = running.claimer("q", running.broker)  # as the one claimer of several queues makes it
        claimer.run_once()  # a claim that finds nothing
        assert claimer.audit_at == math.inf, "a claim answered with nothing moved nothing"

        def lost_reply(*args, **kwargs):
            raise RedisConnectionError("the reply was lost")

        monkeypatch.setattr(claimer.broker.queue, "claim_with_suspect", lost_reply)
        with pytest.raises(RedisConnectionError):
            claimer.run_once()
        monkeypatch.undo()
        assert claimer.audit_at < math.inf
        claimer.reconcile()
        assert claimer.audit_at == math.inf


# --- the in-thread consumer fixture -------------------------------------------------------
def _crash_in_shutdown(running: Any) -> None:
    shutdown = running.shutdown

    def crash() -> int:
        shutdown()
        raise RuntimeError("a bug in shutdown")

    running.shutdown = crash


def _exit_non_zero(running: Any) -> None:
    shutdown = running.shutdown
    running.shutdown = lambda: shutdown() + 3


def test_the_fixture_reports_a_consumer_that_crashed(consumer_in_thread):
    with (
        pytest.raises(AssertionError, match="consumer crashed: RuntimeError"),
        consumer_in_thread(queues=["q"]) as running,
    ):
        _crash_in_shutdown(running)


def test_the_fixture_reports_a_consumer_that_exited_non_zero(consumer_in_thread):
    with (
        pytest.raises(AssertionError, match=r"consumer exited with \[3\]"),
        consumer_in_thread(queues=["q"]) as running,
    ):
        _exit_non_zero(running)


# --- signals ------------------------------------------------------------------------------
@pytest.fixture
def signalled(broker, monkeypatch) -> Iterator[tuple[Consumer, list[int]]]:
    """A consumer whose signal handlers are installed; os._exit is recorded instead of run."""
    consumer = make_consumer(broker)
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(stop_signals, "SIGNAL_ECHO_S", 0.2)
    stop_signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    previous = {signum: signal.getsignal(signum) for signum in stop_signums}
    consumer.install_signal_handlers()
    yield consumer, exits
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_first_signal_asks_for_a_graceful_stop(signalled):
    consumer, exits = signalled
    os.kill(os.getpid(), signal.SIGTERM)
    assert consumer.stop_requested.wait(1) and exits == []


def test_a_signal_echoed_at_once_is_the_same_request(signalled):
    consumer, exits = signalled
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)  # the terminal's Ctrl-C and the supervisor's copy of it
    assert consumer.stop_requested.wait(1)
    time.sleep(0.01)
    assert exits == []


def test_a_second_signal_after_the_echo_window_exits_at_once(signalled):
    _consumer, exits = signalled
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.25)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    assert exits == [1]
