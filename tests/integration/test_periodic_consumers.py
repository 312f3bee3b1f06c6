"""Periodic tasks fired by real `runconsumer` processes: once per slot across consumers, kills and outages."""

import itertools
import time
from datetime import UTC, datetime, timedelta

import pytest

from tasks_app.models import PeriodicTask, TaskType
from tests.support.periodic import PushedRun, pushed_runs
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# The runs pile up in a queue no consumer of these tests serves, to be read as they were pushed.
OUT = "periodic-out"
CONSUMER = ("--queue", "default", "--lease", "2", "--concurrency", "1", "--prefetch", "0")


@pytest.fixture
def record_type():
    return TaskType.objects.create(name="test.record", handler="test.record", queue=OUT)


def schedule(record_type, name: str, **fields) -> PeriodicTask:
    return PeriodicTask.objects.create(name=name, task_type=record_type, interval_s=1, **fields)


def runs_of(broker, name: str) -> list[PushedRun]:
    return [run for run in pushed_runs(broker, OUT) if run.schedule == name]


def regular_slots(broker, name: str) -> list[int]:
    return [run.slot_ms for run in runs_of(broker, name) if not run.catch_up]


def assert_once_per_slot(broker, name: str) -> list[int]:
    runs = runs_of(broker, name)
    slots = [run.slot_ms for run in runs if not run.catch_up]
    assert len(slots) == len(set(slots)), f"a slot of {name} fired twice: {sorted(slots)}"
    assert slots == sorted(slots) and all(slot % 1000 == 0 for slot in slots)
    assert len({run.task_id for run in runs}) == len(runs)
    return slots


def test_three_consumers_fire_each_slot_once_through_a_kill_and_catch_up_after_an_outage(
    broker, consumer_process, record_type
):
    schedule(record_type, "tick.skip")
    schedule(record_type, "tick.once", catch_up=PeriodicTask.CatchUp.ONCE)
    consumers = [consumer_process(*CONSUMER) for _ in range(3)]
    wait_until(lambda: len(regular_slots(broker, "tick.skip")) >= 1, 60, message="the first run")
    started = time.monotonic()
    time.sleep(7)
    consumers[0].kill()
    time.sleep(max(0.0, 15 - (time.monotonic() - started)))
    for name in ("tick.skip", "tick.once"):
        slots = assert_once_per_slot(broker, name)
        span = (slots[-1] - slots[0]) // 1000 + 1
        assert len(slots) >= 0.8 * span, f"slots missed with consumers up: {len(slots)} runs over {span} s"
        # Only a slot every consumer reached late (a loaded machine) is missed, and then at most
        # one catch-up run stands for it.
        catch_ups = sum(run.catch_up for run in runs_of(broker, name))
        assert catch_ups <= (span - len(slots) if name == "tick.once" else 0)

    # All consumers down for 5 s, then one starts.
    for consumer in consumers[1:]:
        consumer.kill()
    before = {name: len(runs_of(broker, name)) for name in ("tick.skip", "tick.once")}
    time.sleep(5)
    consumer_process(*CONSUMER)
    wait_until(
        lambda: len(runs_of(broker, "tick.skip")) >= before["tick.skip"] + 3, 60, message="runs after the restart"
    )
    time.sleep(1.5)
    skip_after = runs_of(broker, "tick.skip")[before["tick.skip"] :]
    once_after = runs_of(broker, "tick.once")[before["tick.once"] :]
    assert not any(run.catch_up for run in skip_after)
    assert [run.catch_up for run in once_after].count(True) == 1
    assert once_after[0].catch_up  # the catch-up run comes first, then the slots as they come
    for name in ("tick.skip", "tick.once"):
        slots = assert_once_per_slot(broker, name)
        gap_s = max(b - a for a, b in itertools.pairwise(slots)) / 1000
        assert gap_s >= 5  # the outage's slots did not come back as a burst


def test_a_slot_whose_state_is_lost_after_its_consumer_fired_it_and_was_killed_is_not_fired_again(
    broker, consumer_process, record_type
):
    schedule(record_type, "tick.alive")  # shows the replacement's scheduler at work
    start_at = datetime.now(UTC) + timedelta(seconds=3)
    PeriodicTask.objects.create(name="hourly", task_type=record_type, interval_s=3600, start_at=start_at)
    first = consumer_process(*CONSUMER)
    wait_until(lambda: len(runs_of(broker, "hourly")) == 1, 60, message="the hourly slot to fire")
    first.kill()
    broker.client.delete(broker.keys.periodic(OUT, "hourly"))  # evicted, or deleted by hand
    last_tick = max(regular_slots(broker, "tick.alive"))
    consumer_process(*CONSUMER)  # a replacement, well within the slot's 60 s grace
    wait_until(lambda: max(regular_slots(broker, "tick.alive")) > last_tick + 1000, 60, message="the replacement")
    assert len(runs_of(broker, "hourly")) == 1


def test_disabling_a_row_or_its_end_at_passing_stops_runs_within_the_refresh(broker, consumer_process, record_type):
    ending_at = datetime.now(UTC) + timedelta(seconds=4)
    stopped = schedule(record_type, "tick.disabled")
    schedule(record_type, "tick.ending", end_at=ending_at)
    consumer_process(*CONSUMER)
    wait_until(lambda: len(regular_slots(broker, "tick.disabled")) >= 2, 60, message="runs to start")
    PeriodicTask.objects.filter(pk=stopped.pk).update(enabled=False)
    disabled_ms = int(time.time() * 1000)
    refresh_ms = 500  # TASKS_CONFIG_REFRESH_S of the tests
    wait_until(lambda: time.time() > ending_at.timestamp() + 2.5, 30, message="the end to pass")
    late = [slot for slot in regular_slots(broker, "tick.disabled") if slot > disabled_ms + refresh_ms + 1000]
    assert late == []
    ending = regular_slots(broker, "tick.ending")
    assert ending and max(ending) <= int(ending_at.timestamp() * 1000)
