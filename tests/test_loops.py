"""The consumer's background loops, one `run_once()` at a time, against a real Redis."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks_app import producer
from tasks_app.consumer.loops import FIRST_BACKOFF_S, HousekeepingLoop, SchedulerLoop, run_forever, start_thread
from tasks_app.consumer.membership import LeaseClock, Membership, ReaperLoop, RetiringIds
from tasks_app.consumer.settling import record_reaped
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.leases import MAX_RECOVERIES
from tasks_app.protocol.scripts import connect
from tasks_app.task_types import TaskTypeCache
from tests.support.claims import claim, die_running, push, register, task_bytes
from tests.support.counters import sample
from tests.support.processes import wait_until

SHORT_LEASE_MS = 100


class ScriptedLoop:
    """A loop whose run_once follows a script: a sleep to return, or an exception to raise."""

    name = "scripted"

    def __init__(self, steps: list[float | BaseException], stop: threading.Event) -> None:
        self.steps = steps
        self.stop = stop
        self.calls = 0

    def run_once(self) -> float:
        step = self.steps[self.calls]
        self.calls += 1
        if self.calls == len(self.steps):
            self.stop.set()
        if isinstance(step, BaseException):
            raise step
        return step


class RecordingStop(threading.Event):
    """A stop event that records how long the loop asked to sleep, without sleeping (set after `stop_after` waits)."""

    def __init__(self, stop_after: int = 0) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.stop_after = stop_after

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        if len(self.waits) == self.stop_after:
            self.set()
        return self.is_set()


def unreachable_broker(prefix: str) -> Broker:
    """A broker whose Redis refuses connections."""
    return Broker(connect("redis://127.0.0.1:1/0"), prefix)


def heartbeat_of(broker: Broker, consumer_id: str, queues: list[str], lost: list) -> Membership:
    """The heartbeat of `consumer_id` registered on `queues` (lease 9 s); a lost lease is recorded, not acted on."""
    membership = Membership(
        broker,
        broker,
        queues,
        LeaseClock(9.0),
        consumer_id,
        reaper=ReaperLoop(broker, queues, 9.0, lambda queue, dead: None),
        retiring=RetiringIds(broker, 9.0, lambda queue, consumer_id: []),
        info=dict,
        instance="",
        give_up=threading.Event(),
    )
    membership._current = (consumer_id, tuple(queues))
    membership.lease_lost = lambda *loss: lost.append(loss)  # type: ignore[method-assign]
    return membership


# --- run_forever --------------------------------------------------------------------------
def test_run_forever_backs_off_through_redis_errors_and_resets_after_a_success():
    stop = RecordingStop()
    errors_before = sample("taskqueue_redis_errors_total", loop="scripted")
    loop = ScriptedLoop(
        [0.5, RedisConnectionError("down"), RedisConnectionError("down"), 0.0, RedisConnectionError("down"), 0.3], stop
    )
    run_forever(loop, stop)
    assert loop.calls == 6
    first, second, third = stop.waits[1], stop.waits[2], stop.waits[3]
    assert stop.waits[0] == 0.5 and stop.waits[-1] == 0.3 and len(stop.waits) == 5  # no wait after 0.0
    assert 0.8 * FIRST_BACKOFF_S <= first <= 1.2 * FIRST_BACKOFF_S
    assert second > first * 1.3  # doubled (with jitter)
    assert 0.8 * FIRST_BACKOFF_S <= third <= 1.2 * FIRST_BACKOFF_S  # reset by the success in between
    assert sample("taskqueue_redis_errors_total", loop="scripted") == errors_before + 3


def test_run_forever_survives_a_bug_in_run_once(caplog):
    stop = RecordingStop()
    loop = ScriptedLoop([ValueError("a bug"), 0.2], stop)
    run_forever(loop, stop)
    assert loop.calls == 2, "the loop went on after the bug"
    assert stop.waits == [1.0, 0.2]
    assert "scripted: unexpected error" in caplog.text and "ValueError: a bug" in caplog.text


def test_start_thread_runs_the_loop_until_stopped():
    stop = threading.Event()
    loop = ScriptedLoop([0.0] * 3, stop)
    thread = start_thread(loop, stop)
    thread.join(timeout=5)
    assert not thread.is_alive() and thread.daemon and thread.name == "scripted"
    assert loop.calls == 3


# --- heartbeat ----------------------------------------------------------------------------
def test_heartbeat_renews_a_held_lease_every_third_of_it(broker):
    register(broker, "c1", lease_ms=1000)
    lost: list[tuple[str, list[str]]] = []
    loop = heartbeat_of(broker, "c1", ["q"], lost)
    deadline_before = broker.client.zscore(broker.keys.consumers("q"), "c1")
    time.sleep(0.01)
    assert loop.run_once() == pytest.approx(3.0)
    assert broker.client.zscore(broker.keys.consumers("q"), "c1") >= deadline_before + 8000
    assert lost == []


def test_heartbeat_reports_a_lost_lease_with_the_id_that_lost_it_and_where(broker):
    lost: list[tuple[str, list[str]]] = []
    broker.leases.heartbeat(["p"], "reaped-one", 9000, {})  # held on p; never registered on q: reaped there
    loop = heartbeat_of(broker, "reaped-one", ["p", "q"], lost)
    loop.run_once()
    assert lost == [("reaped-one", ["q"])]
    assert broker.client.zscore(broker.keys.consumers("q"), "reaped-one") is None, "a lost lease is not retaken"


def test_heartbeat_retries_at_twice_its_pace_at_most_when_redis_is_away(key_prefix):
    lost: list[tuple[str, list[str]]] = []
    loop = heartbeat_of(unreachable_broker(key_prefix), "c1", ["q"], lost)
    stop = RecordingStop(stop_after=6)
    run_forever(loop, stop)
    assert len(stop.waits) == 6 and all(0 < wait <= 1.5 * 1.2 for wait in stop.waits), "a sixth of the lease"
    assert lost == [], "an unreachable Redis is not a lost lease"


# --- scheduler ----------------------------------------------------------------------------
def test_scheduler_sleeps_its_longest_with_nothing_delayed(broker):
    assert SchedulerLoop(broker, ["q"]).run_once() == SchedulerLoop.MAX_SLEEP_S


@pytest.mark.django_db
def test_scheduler_wakes_when_the_next_task_is_due(broker):
    producer.enqueue("demo.echo", queue="q", delay_s=0.2)
    producer.enqueue("demo.echo", queue="other", delay_s=60)
    loop = SchedulerLoop(broker, ["other", "q"])
    assert 0.0 <= loop.run_once() <= 0.2 < SchedulerLoop.MAX_SLEEP_S
    assert broker.inspect.queue_stats("q").delayed == 1
    time.sleep(0.21)
    assert loop.run_once() == SchedulerLoop.MAX_SLEEP_S  # the first moved; the other is far off
    assert (broker.inspect.queue_stats("q").pending, broker.inspect.queue_stats("q").delayed) == (1, 0)
    assert broker.inspect.queue_stats("other").delayed == 1


@pytest.mark.django_db
def test_scheduler_goes_again_at_once_while_a_full_batch_moved(broker):
    producer.enqueue("demo.echo", queue="q", delay_s=0.01, count=3)
    time.sleep(0.02)
    loop = SchedulerLoop(broker, ["q"])
    loop.BATCH = 2
    assert loop.run_once() == 0.0
    assert loop.run_once() == SchedulerLoop.MAX_SLEEP_S
    assert broker.inspect.queue_stats("q").pending == 3


@pytest.mark.django_db
def test_scheduler_wakes_deferred_types_once_read_then_only_when_one_is_enabled_again(broker, monkeypatch):
    row = TaskType.objects.create(name="held.back", handler="demo.echo", enabled=False)
    woken: list[str] = []
    monkeypatch.setattr(broker.limits, "wake_enabled", lambda queue, disabled: woken.append(queue) or 0)
    types = TaskTypeCache()
    loop = SchedulerLoop(broker, ["a", "b"], types=types)
    loop.run_once()
    assert woken == [], "nothing is woken before the settings are read"
    types.refresh()
    loop.run_once()
    loop.run_once()
    assert woken == ["a", "b"], "once, on every queue, after the first read"
    row.enabled = True
    row.save()
    types.refresh()
    loop.run_once()
    loop.run_once()
    assert woken == ["a", "b", "a", "b"], "once more for the type enabled again, and no more while idle"


# --- reaper -------------------------------------------------------------------------------
def test_reaper_recovers_only_consumers_whose_lease_expired(broker):
    push(broker, *(task_bytes(f"t{n}") for n in range(4)))
    register(broker, "dead", SHORT_LEASE_MS)
    register(broker, "alive", 30_000)
    claim(broker, "dead", 3)
    alive_holds = claim(broker, "alive", 1)
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    recovered_before = sample("taskqueue_tasks_recovered_total", queue="q")
    loop = ReaperLoop(broker, ["q"], 0.1, lambda queue, dead: pytest.fail("nothing is dead-lettered"))
    assert loop.run_once() == 0.05  # a third of a lease, at least 50 ms
    assert broker.queue.held_by("q", "dead") == []
    assert broker.queue.held_by("q", "alive") == alive_holds
    assert broker.inspect.queue_stats("q").pending == 3  # the recovered ones wait as suspects
    assert sample("taskqueue_tasks_recovered_total", queue="q") == recovered_before + 3
    assert [c["id"] for c in broker.inspect.queue_stats("q").consumers] == ["alive"]
    assert ReaperLoop(broker, ["q"], 9.0, lambda q, d: None).run_once() == 3.0


def counted_looks(monkeypatch, broker: Broker) -> list[list[str]]:
    """The queues of each look the reapers on `broker` make at every queue of theirs."""
    looks: list[list[str]] = []
    look = broker.leases.reap_candidate_pages

    def counted(queues, offsets):
        looks.append(list(queues))
        return look(queues, offsets)

    monkeypatch.setattr(broker.leases, "reap_candidate_pages", counted)
    return looks


def test_an_idle_reaper_looks_at_its_queues_once_a_lease_yet_at_once_when_a_lease_lapses(broker, monkeypatch):
    looks = counted_looks(monkeypatch, broker)
    register(broker, "alive", 30_000)
    loop = ReaperLoop(broker, ["q", "r"], 0.3, lambda queue, dead: None)
    loop.run_once()
    loop.run_once()
    assert len(looks) == 1, "no deadline in the lease index passed: the queues are not looked at"
    time.sleep(0.3)
    loop.run_once()
    assert len(looks) == 2, "and once a lease in any case"
    push(broker, task_bytes("t"))
    register(broker, "dying", SHORT_LEASE_MS)
    claim(broker, "dying", 1)
    loop.run_once()
    assert len(looks) == 2
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    loop.run_once()
    assert len(looks) == 3 and broker.queue.held_by("q", "dying") == [], "its lapse is seen in the index at once"


def test_the_consumer_holding_the_turn_dies_and_another_reaps_it_within_its_lease(broker, monkeypatch):
    # Whichever consumer dies, the others' reapers see its deadline pass in the one index they all read.
    looks = counted_looks(monkeypatch, broker)
    for name in ("a", "b", "c"):
        register(broker, name, 30_000)
    reapers = {name: ReaperLoop(broker, ["q"], 9.0, lambda queue, dead: None) for name in ("a", "b", "c")}
    for reaper in reapers.values():
        reaper.run_once()  # the first look, at start
    assert broker.leases.take_turn("reaper", ["q"], 9_000), "a holds the turn at the look once a lease"
    push(broker, task_bytes("t"))
    register(broker, "a", SHORT_LEASE_MS)  # "a" renews once more with a short lease, claims, and dies
    claim(broker, "a", 1)
    time.sleep(SHORT_LEASE_MS / 1000 + 0.02)
    reapers["b"].run_once()
    assert broker.queue.held_by("q", "a") == [] and len(looks) == 4
    assert [c["id"] for c in broker.inspect.queue_stats("q").consumers] == ["b", "c"]


def test_consumers_of_the_same_queues_take_turns_at_the_look_once_a_lease(broker, monkeypatch):
    looks = counted_looks(monkeypatch, broker)
    reapers = [ReaperLoop(broker, queues, 0.3, lambda queue, dead: None) for queues in (["q", "r"], ["r", "q"])]
    for reaper in reapers:
        reaper.run_once()  # each looks at its start
    time.sleep(0.3)
    for reaper in reapers:
        reaper.run_once()
    assert len(looks) == 3, "one of them looked for the both of them"
    time.sleep(0.3)
    reapers[1].run_once()  # the other died holding the turn: it lapses within the lease
    assert len(looks) == 4


def test_consumers_of_the_same_queues_take_turns_at_the_schedulers_chores(broker, monkeypatch):
    sampled: list[str] = []
    monkeypatch.setattr(broker.inspect, "sample_backlog", sampled.append)
    loops = [SchedulerLoop(broker, ["q", "r"]), SchedulerLoop(broker, ["r", "q"]), SchedulerLoop(broker, ["q"])]
    for loop in loops:
        loop.run_once()
    assert sampled == ["q", "r", "q"], "one sample of each queue per consumers of the same queues"


@pytest.mark.django_db
def test_a_consumer_that_leaves_cleanly_leaves_the_lease_index(broker, consumer_in_thread):
    with consumer_in_thread(queues=["q", "r"]) as consumer:
        consumer_id = consumer.consumer_id
        wait_until(lambda: broker.client.zscore(broker.keys.leases(), consumer_id), 5, message="it to register")
    assert broker.client.zscore(broker.keys.leases(), consumer_id) is None, "no reaper need look for it"


def test_reaper_dead_letters_a_task_that_keeps_killing_its_consumers(broker):
    push(broker, task_bytes("poison"))
    dead_lettered: list[tuple[str, list[bytes]]] = []
    loop = ReaperLoop(broker, ["q"], 0.1, lambda queue, dead: dead_lettered.append((queue, dead)))
    for victim in range(MAX_RECOVERIES + 1):
        die_running(broker, f"victim-{victim}", SHORT_LEASE_MS)
        assert loop.reap("q", f"victim-{victim}") == 1
    [(queue, [raw])] = dead_lettered
    assert queue == "q" and b"recovered 4 times" in raw
    assert broker.inspect.queue_stats("q").dead == 1 and broker.inspect.queue_stats("q").pending == 0


@pytest.mark.django_db
@pytest.mark.parametrize("foreign_record", [False, True])
def test_a_unique_task_the_reaper_dead_letters_frees_its_key(broker, foreign_record):
    TaskType.objects.create(name="x.once", handler="x.once", queue="q", unique_for_s=600, unique_until="finished")
    task_types = TaskTypeCache()
    task_types.refresh()
    unique_key = broker.keys.unique("q", "d1")
    broker.client.set(unique_key, "poison", px=600_000)  # as enqueue_unique left it
    if foreign_record:  # a foreign writer's string where its record goes: the record cannot be written
        broker.client.set(broker.keys.result("poison"), "not a hash")
    push(broker, task_bytes("poison", "x.once", unique_digest="d1"))
    loop = ReaperLoop(broker, ["q"], 0.1, partial(record_reaped, broker, task_types, give_up=threading.Event()))
    for victim in range(MAX_RECOVERIES + 1):
        die_running(broker, f"victim-{victim}", SHORT_LEASE_MS)
        loop.reap("q", f"victim-{victim}")
    assert broker.inspect.queue_stats("q").dead == 1
    assert not broker.client.exists(unique_key)  # it failed for good: a new one may be enqueued


@pytest.mark.django_db
def test_a_task_the_reaper_dead_letters_keeps_no_record_if_its_type_keeps_none(broker):
    TaskType.objects.create(name="x.forgotten", handler="x.forgotten", queue="q", keep_results="never")
    task_types = TaskTypeCache()
    task_types.refresh()
    push(broker, task_bytes("poison", "x.forgotten"))
    loop = ReaperLoop(broker, ["q"], 0.1, partial(record_reaped, broker, task_types, give_up=threading.Event()))
    for victim in range(MAX_RECOVERIES + 1):
        die_running(broker, f"victim-{victim}", SHORT_LEASE_MS)
        loop.reap("q", f"victim-{victim}")
    assert broker.inspect.queue_stats("q").dead == 1, "still dead-lettered"
    assert broker.records.get_result("poison") is None


@pytest.mark.django_db
def test_a_foreign_envelope_the_reaper_dead_letters_is_filed_under_the_queue_it_died_in(broker):
    push(broker, task_bytes("poison", "x.foreign", queue="elsewhere"))  # its envelope names another queue
    loop = ReaperLoop(broker, ["q"], 0.1, partial(record_reaped, broker, TaskTypeCache(), give_up=threading.Event()))
    for victim in range(MAX_RECOVERIES + 1):
        die_running(broker, f"victim-{victim}", SHORT_LEASE_MS)
        loop.reap("q", f"victim-{victim}")
    assert broker.records.get_result("poison")["status"] == "FAILED"
    assert broker.client.zrange(broker.keys.history_status("q", "FAILED"), 0, -1) == [b"poison"]
    assert not broker.client.exists(broker.keys.history("elsewhere"))


def test_reaping_a_live_or_unknown_consumer_moves_nothing(broker):
    push(broker, task_bytes("t"))
    register(broker, "alive", 30_000)
    held = claim(broker, "alive", 1)
    loop = ReaperLoop(broker, ["q"], 0.1, lambda q, d: None)
    assert loop.reap("q", "alive") == 0 and loop.reap("q", "nobody") == 0
    assert broker.queue.held_by("q", "alive") == held


# --- housekeeping -------------------------------------------------------------------------
@pytest.mark.django_db  # after each refresh it lets go of a database connection gone stale
def test_housekeeping_refreshes_on_its_period_and_watches_every_tick():
    refreshes: list[float] = []
    expiries: list[float] = []
    loop = HousekeepingLoop(
        lambda: refreshes.append(time.monotonic()), 0.2, lambda: expiries.append(time.monotonic()) or 0
    )
    assert loop.run_once() == HousekeepingLoop.TICK_S
    loop.run_once()
    assert (len(refreshes), len(expiries)) == (1, 2)  # the first call refreshes at once
    time.sleep(0.21)
    loop.run_once()
    assert (len(refreshes), len(expiries)) == (2, 3)
