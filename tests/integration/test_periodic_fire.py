"""fire_periodic.lua on a real Redis: one run per slot whatever races it, the catch-up policies, wrong types."""

import threading
import time

import pytest

from tasks_app.models import PeriodicTask, TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import fire_slot, run_id
from tasks_app.periodic.schedule import Schedule
from tasks_app.protocol.periodic import SlotFiring
from tasks_app.protocol.records import datetime_of_ms
from tests.support.periodic import fire_around_a_queue_move, pushed_runs

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "periodic-out"


@pytest.fixture
def config(broker):
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue=QUEUE)
    return PeriodicConfig(name="every.second", task_type="demo.echo", schedule=Schedule(interval_s=1), args=[1])


def server_ms(broker) -> int:
    seconds, micros = broker.client.time()
    return seconds * 1000 + micros // 1000


def firing(slot_ms: int, catch_up: str = "skip", on_time_ms: int = 60_000) -> SlotFiring:
    return SlotFiring(slot_ms, slot_ms - 1000, on_time_ms, catch_up)


def test_eight_threads_racing_for_one_slot_push_one_task(broker, config):
    slot_ms = server_ms(broker) // 1000 * 1000
    barrier = threading.Barrier(8)
    outcomes = []

    def race():
        barrier.wait()
        outcomes.append(fire_slot(config, firing(slot_ms), broker).outcome)

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    runs = pushed_runs(broker, QUEUE)
    assert sorted(outcomes) == ["done"] * 7 + ["fired"]
    assert [(run.task_id, run.slot_ms) for run in runs] == [(run_id("every.second", slot_ms), slot_ms)]
    assert broker.records.get_result(runs[0].task_id)["status"] == "READY"


def test_a_slot_at_or_before_the_last_one_is_refused_and_a_future_one_waits(broker, config):
    slot_ms = server_ms(broker) // 1000 * 1000
    assert fire_slot(config, firing(slot_ms), broker).outcome == "fired"
    assert fire_slot(config, firing(slot_ms - 1000), broker).outcome == "done"
    assert fire_slot(config, firing(slot_ms + 60_000), broker).outcome == "early"
    assert len(pushed_runs(broker, QUEUE)) == 1


def test_skip_drops_missed_slots_and_once_fires_one_catch_up_run(broker, config):
    now_ms = server_ms(broker) // 1000 * 1000
    base_ms = now_ms - 10_000
    fire_slot(config, firing(base_ms, on_time_ms=60_000), broker)  # the last run before an outage
    skip = fire_slot(config, firing(now_ms), broker)
    assert skip.outcome == "fired"  # the 9 missed slots in between: dropped

    once = PeriodicConfig(**{**config.__dict__, "name": "every.second.once", "catch_up": PeriodicTask.CatchUp.ONCE})
    fire_slot(once, firing(base_ms, "once"), broker)
    assert fire_slot(once, firing(now_ms - 5000, "once"), broker).outcome == "fired_and_caught_up"
    # Too late to run as itself: one run stands for it and the slots missed before it.
    assert fire_slot(once, firing(now_ms, "once", on_time_ms=0), broker).outcome == "caught_up"

    runs = [(run.schedule, run.catch_up) for run in pushed_runs(broker, QUEUE)]
    assert runs.count(("every.second.once", True)) == 2
    assert runs.count(("every.second.once", False)) == 2
    assert runs.count(("every.second", True)) == 0
    assert runs.count(("every.second", False)) == 2


def test_slots_before_the_schedule_was_last_saved_are_never_caught_up(broker, config):
    once = PeriodicConfig(**{**config.__dict__, "catch_up": PeriodicTask.CatchUp.ONCE})
    now_ms = server_ms(broker) // 1000 * 1000
    fire_slot(once, firing(now_ms - 10_000, "once"), broker)
    # Disabled, then enabled again 2 s ago (a save): the slots while it was off are not "missed".
    resumed = SlotFiring(now_ms, now_ms - 1000, 60_000, "once", saved_ms=now_ms - 500)
    assert fire_slot(once, resumed, broker).outcome == "fired"
    assert not any(run.catch_up for run in pushed_runs(broker, QUEUE))


def test_a_cron_schedule_whose_start_was_moved_later_catches_up_nothing_from_before_its_start(broker, config):
    slot_ms = server_ms(broker) // 1000 * 1000
    schedule = Schedule(cron="* * * * * *", start_at=datetime_of_ms(slot_ms))
    once = PeriodicConfig(**{**config.__dict__, "schedule": schedule, "catch_up": PeriodicTask.CatchUp.ONCE})
    fire_slot(once, firing(slot_ms - 10_000, "once"), broker)  # it ran, then its start was moved to now
    first = SlotFiring(slot_ms, schedule.previous_before(slot_ms) or 0, 60_000, "once", saved_ms=slot_ms - 5000)
    assert fire_slot(once, first, broker).outcome == "fired"  # the seconds before its start were never due


def test_a_new_schedule_first_seen_late_fires_nothing_for_its_past(broker, config):
    long_ago_ms = server_ms(broker) - 3_600_000
    reply = fire_slot(config, firing(long_ago_ms, "once"), broker)
    assert reply.outcome == "skipped"
    assert pushed_runs(broker, QUEUE) == []


@pytest.mark.parametrize("history", [False, True])
def test_a_schedule_does_not_run_a_slot_from_before_its_last_save(broker, config, history):
    # Moved to this queue (a save) just after its slot fired in the old one, or created after it;
    # with a history: moved back to a queue it ran in before, or re-created under a deleted one's name.
    slot_ms = server_ms(broker) // 1000 * 1000 - 1000
    if history:
        assert fire_slot(config, firing(slot_ms - 120_000), broker).outcome == "skipped"
    moved = SlotFiring(slot_ms, slot_ms - 1000, 60_000, "once", saved_ms=slot_ms + 500)
    assert fire_slot(config, moved, broker).outcome == "skipped"
    following = SlotFiring(slot_ms + 1000, slot_ms, 60_000, "once", saved_ms=slot_ms + 500)
    assert fire_slot(config, following, broker).outcome == "fired"  # the first slot after the save runs
    assert [run.slot_ms for run in pushed_runs(broker, QUEUE)] == [slot_ms + 1000]


@pytest.mark.parametrize("key", ["state", "claim"])
def test_a_state_key_of_another_type_is_an_error_and_pushes_nothing(broker, config, key):
    keys = {"state": broker.keys.periodic(QUEUE, config.name), "claim": broker.keys.periodic_claim(config.name)}
    broker.client.set(keys[key], "x")
    with pytest.raises(Exception, match="WRONGTYPE"):
        fire_slot(config, firing(server_ms(broker) // 1000 * 1000), broker)
    assert pushed_runs(broker, QUEUE) == []


def test_a_prioritized_run_goes_to_the_prioritized_set_and_wakes_pending(broker, config):
    urgent = PeriodicConfig(**{**config.__dict__, "priority": 5})
    assert fire_slot(urgent, firing(server_ms(broker) // 1000 * 1000), broker).pushed
    assert broker.client.zcard(broker.keys.prioritized(QUEUE)) == 1
    assert broker.client.llen(broker.keys.pending(QUEUE)) == 1  # the wake token


def test_the_state_records_the_last_fired_run(broker, config):
    slot_ms = server_ms(broker) // 1000 * 1000
    before_ms = int(time.time() * 1000) - 5_000
    fire_slot(config, firing(slot_ms), broker)
    [state] = broker.periodic.periodic_states([(QUEUE, config.name)])
    assert (state.handled_slot_ms, state.fired_slot_ms) == (slot_ms, slot_ms)
    assert state.task_id == run_id(config.name, slot_ms)
    assert state.fired_at_ms >= before_ms


def test_a_unique_type_fires_once_per_slot_by_the_script_alone(broker, config):
    TaskType.objects.filter(name="demo.echo").update(unique_for_s=3600)
    now_ms = server_ms(broker) // 1000 * 1000
    assert fire_slot(config, firing(now_ms - 1000), broker).outcome == "fired"
    assert fire_slot(config, firing(now_ms), broker).outcome == "fired"  # same args, next slot: runs
    assert len(pushed_runs(broker, QUEUE)) == 2


def test_slots_fired_in_either_queue_around_a_move_are_not_caught_up_in_the_other(broker, config):
    # Consumers re-read the rows at their own times: for a while some fire into the old queue.
    fired, runs = fire_around_a_queue_move(broker, config, QUEUE, "periodic-moved")
    assert runs == fired  # each slot once, where it was fired, and no catch-up run for a slot run elsewhere


@pytest.mark.parametrize("catch_up", ["skip", "once"])
def test_a_slot_fired_before_its_state_was_lost_does_not_fire_again(broker, config, catch_up):
    # The state hash deleted or evicted while its slot claim stays: the claim says the slot was handled.
    schedule = PeriodicConfig(**{**config.__dict__, "catch_up": catch_up})
    slot_ms = server_ms(broker) // 1000 * 1000 - 1000
    assert fire_slot(schedule, firing(slot_ms, catch_up), broker).outcome == "fired"
    broker.client.delete(broker.keys.periodic(QUEUE, config.name))
    assert fire_slot(schedule, firing(slot_ms, catch_up), broker).outcome == "done"
    assert fire_slot(schedule, firing(slot_ms + 1000, catch_up), broker).outcome == "fired"  # no catch-up run
    assert [(run.slot_ms, run.catch_up) for run in pushed_runs(broker, QUEUE)] == [
        (slot_ms, False),
        (slot_ms + 1000, False),
    ]
