"""The consumer's periodic loop (`run_once`) on a real Redis: what it fires, how long it sleeps, what it reports."""

import time
from dataclasses import replace
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from tasks_app import metrics
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.periodic_loop import PeriodicLoop, scheduler_loops
from tasks_app.models import PeriodicTask, TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.schedule import Schedule
from tasks_app.protocol.records import datetime_of_ms
from tasks_app.task_types import recent_task_types
from tests.support.periodic import pushed_runs

pytestmark = pytest.mark.django_db(transaction=True)

OUT = "periodic-out"


@pytest.fixture
def echo():
    return TaskType.objects.create(name="demo.echo", handler="demo.echo", queue=OUT)


def loop_of(broker, *configs, clock_ms=None, refresh_s=2.0):
    return PeriodicLoop(broker, refresh_s, 60.0, load=lambda: configs, clock_ms=clock_ms)


def config(name="tick", **schedule):
    return PeriodicConfig(name=name, task_type="demo.echo", schedule=Schedule(**(schedule or {"interval_s": 1})))


def test_it_fires_a_due_slot_once_and_sleeps_until_the_next_slot_at_most_the_refresh(broker, echo):
    loop = loop_of(broker, config(), config("hourly", interval_s=3600))
    before = metrics.PERIODIC_FIRED.labels("tick")._value.get()
    assert 0 < loop.run_once() <= 1.0
    loop.run_once()  # the same slot again (or the next one): never twice
    slots = [run.slot_ms for run in pushed_runs(broker, OUT) if run.schedule == "tick"]
    assert len(slots) == len(set(slots)) >= 1
    assert metrics.PERIODIC_FIRED.labels("tick")._value.get() - before == len(slots)
    assert 0 < loop_of(broker, config("hourly", interval_s=3600)).run_once() <= 2.0


def test_a_slot_still_ahead_on_the_redis_clock_is_not_fired(broker, echo):
    ahead = loop_of(
        broker, config("hourly", interval_s=3600), clock_ms=lambda: broker.inspect.server_time_ms() + 3_600_000
    )
    assert 0 < ahead.run_once() <= 2.0  # the script refused the early slot: looked at again soon
    assert pushed_runs(broker, OUT) == []
    assert "hourly" not in ahead._handled


def test_slots_are_computed_on_the_redis_clock_whatever_this_host_says(broker, echo, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 0.0)  # a host clock stuck in 1970
    loop_of(broker, config()).run_once()
    [run] = pushed_runs(broker, OUT)
    assert abs(run.slot_ms - broker.inspect.server_time_ms()) < 5_000


def test_a_pass_computes_slots_only_for_the_schedules_due(broker, echo, monkeypatch):
    hourly = [config(f"hourly.{n}", interval_s=3600) for n in range(50)]
    loop = loop_of(broker, *hourly, config("tick"))
    loop.run_once()
    computed = []
    for method in ("latest_at_or_before", "next_after", "previous_before"):
        real = getattr(Schedule, method)
        monkeypatch.setattr(Schedule, method, lambda self, ms, real=real: computed.append(ms) or real(self, ms))
    time.sleep(1.0)
    loop.run_once()  # the next second: only "tick" is due
    assert 0 < len(computed) <= 6


@pytest.mark.alone  # a stall of a second between the pass and its script (load elsewhere) makes the slot late
def test_a_long_pass_fires_the_slot_due_when_it_comes_to_a_schedule_not_the_one_due_at_its_start(broker, echo):
    class SlowToCompute(Schedule):
        def latest_at_or_before(self, now_ms: int) -> int | None:
            time.sleep(2.2)  # a long pass, or this process paused in the middle of it
            return None

    once = replace(config("z.once"), catch_up="once")
    loop_of(broker, once, clock_ms=lambda: broker.inspect.server_time_ms() - 1000).run_once()  # a slot handled
    slow = replace(config("a.slow"), schedule=SlowToCompute(interval_s=3600))
    start_ms = broker.inspect.server_time_ms() // 1000 * 1000
    loop_of(broker, slow, once).run_once()
    runs = [run for run in pushed_runs(broker, OUT) if run.schedule == "z.once"]
    # One catch-up run for the seconds the pass took, then the slot due when it came to the schedule.
    assert [run.catch_up for run in runs] == [True, False]
    assert runs[1].slot_ms >= start_ms + 2000


def test_a_disabled_task_type_fires_nothing_and_the_loop_goes_on(broker, echo, caplog):
    TaskType.objects.filter(pk=echo.pk).update(enabled=False)
    loop = loop_of(broker, config())
    assert loop.run_once() > 0
    assert pushed_runs(broker, OUT) == []
    assert "is disabled" in caplog.text


def test_slots_refused_while_the_task_type_was_disabled_are_not_caught_up_once_it_is_enabled(broker, echo):
    now_ms = broker.inspect.server_time_ms() // 60_000 * 60_000
    # Four minutely slots, the last on time: one late (recorded), two while the type is disabled.
    clock = iter([now_ms - 180_000, now_ms - 120_000, now_ms - 60_000, now_ms + 1])
    loop = loop_of(broker, replace(config(interval_s=60), catch_up="once"), clock_ms=lambda: next(clock))
    loop.run_once()
    TaskType.objects.filter(pk=echo.pk).update(enabled=False)
    recent_task_types.forget()
    loop.run_once()
    loop.run_once()
    assert pushed_runs(broker, OUT) == []
    TaskType.objects.filter(pk=echo.pk).update(enabled=True)
    recent_task_types.forget()
    loop.run_once()
    assert [(run.slot_ms, run.catch_up) for run in pushed_runs(broker, OUT)] == [(now_ms, False)]


def test_a_slot_the_schedule_missed_while_its_type_was_enabled_is_still_caught_up(broker, echo):
    now_ms = broker.inspect.server_time_ms() // 60_000 * 60_000
    clock = iter([now_ms - 180_000, now_ms + 1])  # the slots between were never handled: missed
    loop = loop_of(broker, replace(config(interval_s=60), catch_up="once"), clock_ms=lambda: next(clock))
    loop.run_once()
    loop.run_once()
    assert [run.catch_up for run in pushed_runs(broker, OUT)] == [True, False]


def test_a_schedule_whose_state_key_redis_refuses_does_not_stop_the_others(broker, echo, caplog):
    broker.client.set(broker.keys.periodic(OUT, "a.foreign"), "not a hash")  # WRONGTYPE for the script
    loop = loop_of(broker, config("a.foreign"), config("b.tick"))
    assert loop.run_once() > 0
    assert [run.schedule for run in pushed_runs(broker, OUT)] == ["b.tick"]
    assert "periodic task a.foreign: slot" in caplog.text and "WRONGTYPE" in caplog.text


@pytest.mark.parametrize("name", ["pending", "prioritized"])
def test_a_schedule_whose_queue_redis_refuses_does_not_stop_the_others(broker, echo, caplog, name):
    foreign = replace(config("a.foreign"), queue="elsewhere")
    broker.client.set(getattr(broker.keys, name)("elsewhere"), "not what the fire script writes")
    loop = loop_of(broker, foreign, config("b.tick"))
    assert loop.run_once() > 0
    assert [run.schedule for run in pushed_runs(broker, OUT)] == ["b.tick"]
    assert "periodic task a.foreign: slot" in caplog.text and "WRONGTYPE" in caplog.text


def test_a_schedule_that_cannot_fire_reads_late_on_a_consumer_that_never_saw_it_fire(broker, echo):
    TaskType.objects.filter(pk=echo.pk).update(handler="not.registered")
    now_ms = broker.inspect.server_time_ms()
    clock = iter([now_ms, now_ms + 150_000])
    loop = loop_of(broker, config("broken.minutely", interval_s=60), clock_ms=lambda: next(clock))
    loop.run_once()
    loop.run_once()  # 2.5 periods later: still refused
    assert metrics.PERIODIC_LATE.labels("broken.minutely")._value.get() > 60  # the alert's threshold: one period


def test_lateness_grows_when_slots_pass_without_a_run(broker, echo):
    loop = loop_of(broker, config("minutely", interval_s=60))
    loop.run_once()  # the first sight of the schedule (late: nothing fired, its slot recorded)
    assert metrics.PERIODIC_LATE.labels("minutely")._value.get() == 0
    later = loop_of(broker, config("minutely", interval_s=60))
    later._handled = dict(loop._handled)
    later._fired = dict(loop._handled)
    later._report_lateness(config("minutely", interval_s=60), broker.inspect.server_time_ms() + 150_000)
    assert metrics.PERIODIC_LATE.labels("minutely")._value.get() > 60
    assert metrics.PERIODIC_PERIOD.labels("minutely")._value.get() == 60


def test_no_scheduler_runs_no_periodic_loop(broker):
    assert scheduler_loops(broker, ConsumerOptions(scheduler=False)) == []
    [loop] = scheduler_loops(broker, ConsumerOptions())
    assert loop.name == "periodic"


def test_code_schedules_are_synced_before_the_first_pass_and_a_database_error_does_not_stop_firing(
    broker, echo, settings, caplog
):
    settings.TASKS_PERIODIC = {"from.code": {"task": "demo.echo", "interval_s": 60}}
    sync = loop_of(broker, config())
    assert sync.run_once() > 0
    assert PeriodicTask.objects.get(name="from.code").source == "code"
    settings.TASKS_PERIODIC = {"broken": "not a dict"}
    assert loop_of(broker, config("other")).run_once() > 0
    assert "TASKS_PERIODIC['broken'] is not scheduled" in caplog.text


@pytest.mark.parametrize(
    ("name", "value", "check_id"), [("TASKS_PERIODIC_GRACE_S", -1, "E050"), ("TASKS_PERIODIC", [], "E051")]
)
def test_system_checks_refuse_bad_periodic_settings(settings, name, value, check_id):
    from tasks_app.checks import check_task_settings

    setattr(settings, name, value)
    assert f"tasks_app.{check_id}" in {problem.id for problem in check_task_settings()}


def _lines(caplog, text):
    return [record for record in caplog.records if text in record.getMessage()]


def test_a_row_that_cannot_be_scheduled_is_logged_once_until_it_is_saved_again_then_its_recovery(broker, echo, caplog):
    row = PeriodicTask.objects.create(name="bad.cron", task_type=echo, interval_s=60)
    PeriodicTask.objects.filter(pk=row.pk).update(interval_s=None, cron="61 * * * *")  # past the admin
    loop = PeriodicLoop(broker, 0.0, 60.0)  # refresh 0: every pass reloads the rows
    for _ in range(3):
        loop.run_once()
    assert len(_lines(caplog, "bad.cron is not scheduled")) == 1
    row.refresh_from_db()
    row.save()  # saved again, still invalid: said again
    loop.run_once()
    loop.run_once()
    assert len(_lines(caplog, "bad.cron is not scheduled")) == 2
    PeriodicTask.objects.filter(pk=row.pk).update(cron="0 * * * *")
    loop.run_once()
    loop.run_once()
    assert len(_lines(caplog, "bad.cron is scheduled again")) == 1


def test_a_schedule_whose_slots_cannot_be_fired_is_logged_once_until_it_fires_again(broker, echo, caplog):
    TaskType.objects.filter(pk=echo.pk).update(handler="not.registered")
    now_ms = broker.inspect.server_time_ms() // 1000 * 1000
    clock = iter(range(now_ms, now_ms + 10_000, 1000))
    loop = loop_of(broker, config("unfired"), clock_ms=lambda: next(clock))
    for _ in range(3):  # three slots refused
        loop.run_once()
    assert len(_lines(caplog, "periodic task unfired: slot")) == 1
    TaskType.objects.filter(pk=echo.pk).update(handler="demo.echo")
    recent_task_types.forget()
    loop.run_once()
    loop.run_once()
    assert len(_lines(caplog, "periodic task unfired fires again")) == 1


def test_slots_skipped_while_the_task_type_is_disabled_are_logged_once(broker, echo, caplog):
    TaskType.objects.filter(pk=echo.pk).update(enabled=False)
    now_ms = broker.inspect.server_time_ms() // 1000 * 1000
    clock = iter(range(now_ms, now_ms + 10_000, 1000))
    loop = loop_of(broker, config("skipping"), clock_ms=lambda: next(clock))
    for _ in range(3):
        loop.run_once()
    assert len(_lines(caplog, "is disabled")) == 1


def test_a_schedule_following_its_types_queue_moves_with_it_and_fires_no_slot_in_both(broker, echo):
    moved = "periodic-moved"
    row = PeriodicTask.objects.create(name="follows", task_type=echo, interval_s=1)
    PeriodicTask.objects.filter(pk=row.pk).update(updated_at=datetime_of_ms(broker.inspect.server_time_ms() - 60_000))
    PeriodicLoop(broker, 0.0, 60.0).run_once()
    [fired] = pushed_runs(broker, OUT)
    echo.queue = moved
    echo.save()  # as the admin does
    recent_task_types.forget()
    # Another consumer, which has not handled that slot yet, sees the type in its new queue.
    other = PeriodicLoop(broker, 0.0, 60.0)
    deadline = time.monotonic() + 10
    while not pushed_runs(broker, moved) and time.monotonic() < deadline:
        time.sleep(other.run_once())
    runs = pushed_runs(broker, moved)
    assert runs and all(run.slot_ms > fired.slot_ms for run in runs)  # the slot fired in the old queue ran once


@pytest.mark.parametrize("comes_back", ["moved back", "re-created"])
def test_a_schedule_back_in_a_queue_where_it_had_run_does_not_run_a_slot_from_before_its_return(
    broker, echo, comes_back
):
    away = "periodic-away"
    slot_ms = broker.inspect.server_time_ms() // 1000 * 1000 - 1000
    fields = {"name": "roams", "task_type": echo, "interval_s": 60, "start_at": datetime_of_ms(slot_ms - 60_000)}
    row = PeriodicTask.objects.create(queue=OUT, **fields)
    rows = PeriodicTask.objects.filter(pk=row.pk)
    rows.update(updated_at=datetime_of_ms(slot_ms - 90_000))
    # The slot before, handled in OUT (by now too late to run: recorded as skipped, as a run would be).
    PeriodicLoop(broker, 0.0, 60.0, clock_ms=lambda: slot_ms - 30_000).run_once()
    rows.update(queue=away, updated_at=datetime_of_ms(slot_ms - 10_000))  # moved away before the slot
    PeriodicLoop(broker, 0.0, 60.0).run_once()
    assert [run.slot_ms for run in pushed_runs(broker, away)] == [slot_ms]
    if comes_back == "moved back":
        row.refresh_from_db()
        row.queue = OUT
        row.save()  # as the admin does, within the grace of the slot
    else:
        row.delete()
        PeriodicTask.objects.create(queue=OUT, **fields)
    # A consumer that has not handled the slot itself.
    PeriodicLoop(broker, 0.0, 60.0).run_once()
    assert pushed_runs(broker, OUT) == []
    assert broker.records.get_result(pushed_runs(broker, away)[0].task_id)["queue"] == away


def test_after_clocks_go_back_a_daily_job_that_ran_sleeps_until_the_refresh_not_in_a_busy_loop(broker, echo):
    # 02:15 shown the second time (CET): the 02:30 of this night ran at its first showing (CEST).
    second_showing = datetime(2026, 10, 25, 2, 15, tzinfo=ZoneInfo("Europe/Berlin"), fold=1)
    daily = config("daily", cron="30 2 * * *", timezone="Europe/Berlin")
    loop = loop_of(broker, daily, clock_ms=lambda: int(second_showing.timestamp() * 1000))
    assert loop.run_once() > 1.0  # the refresh (2 s), not a pass every 5 ms for up to an hour


MOVED = "periodic-moved"


@pytest.mark.parametrize("first", ["old", "new"])
def test_two_consumers_on_snapshots_before_and_after_a_queue_move_fire_its_slot_once(broker, echo, first):
    hour_ms = broker.inspect.server_time_ms() // 3_600_000 * 3_600_000
    old = replace(config("roams", interval_s=3600), queue=OUT, saved_ms=hour_ms - 7_200_000)
    new = replace(old, queue=MOVED, saved_ms=hour_ms - 60_000)  # moved a minute before the slot
    # Two consumers' schedulers, one still on the rows read before the move: the hour's slot is on time for both.
    loops = [PeriodicLoop(broker, 2.0, 3600.0, load=lambda snapshot=snapshot: [snapshot]) for snapshot in (old, new)]
    for loop in loops if first == "old" else reversed(loops):
        loop.run_once()
    runs = [(queue, run.slot_ms) for queue in (OUT, MOVED) for run in pushed_runs(broker, queue)]
    assert runs == [(OUT if first == "old" else MOVED, hour_ms)]  # where the first fired it, once
    assert [loop._handled["roams"] for loop in loops] == [hour_ms, hour_ms]
