"""A problem that persists across a loop's passes is logged once (then a reminder now and then), and its end once."""

import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks_app.consumer import periodic_loop
from tasks_app.consumer.loops import HeartbeatLoop, LeaseClock, run_forever
from tasks_app.consumer.periodic_loop import CodeScheduleSync, PeriodicLoop
from tasks_app.consumer.retiring import RetiringIds
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.schedule import Schedule
from tasks_app.problem_log import ProblemLog
from tasks_app.task_types import TaskTypeCache
from tests.support.counters import sample
from tests.test_loops import RecordingStop, ScriptedLoop, unreachable_broker

logger = logging.getLogger("tests.persisting")


def lines(caplog, text):
    """The records whose message holds `text`."""
    return [record for record in caplog.records if text in record.getMessage()]


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the helper ---------------------------------------------------------------------------
def test_the_same_problem_is_logged_once_then_a_reminder_with_its_count_then_its_recovery_once(caplog):
    clock = Clock()
    problems = ProblemLog(logger, remind_every_s=60.0, clock=clock)
    for _ in range(5):
        clock.now += 10
        problems.failed("loop", "redis", "loop: redis error: %s", "down")
    assert len(lines(caplog, "loop: redis error: down")) == 1
    clock.now += 20  # 60 s since it was said
    problems.failed("loop", "redis", "loop: redis error: %s", "down")
    [reminder] = lines(caplog, "still so")
    assert reminder.getMessage() == "loop: redis error: down (still so: 5 time(s) in the last 60 s)"
    problems.recovered("loop", "loop: working again")
    problems.recovered("loop", "loop: working again")
    [recovery] = lines(caplog, "working again")
    assert recovery.levelno == logging.INFO and recovery.getMessage() == "loop: working again (after 60 s)"


def test_a_different_problem_is_logged_at_once_and_keys_are_apart(caplog):
    problems = ProblemLog(logger, remind_every_s=None)
    problems.failed("a", "redis", "a: redis away")
    problems.failed("b", "redis", "b: redis away")
    problems.failed("a", "bug", "a: a bug", level=logging.ERROR)
    problems.failed("a", "bug", "a: a bug", level=logging.ERROR)
    assert [record.getMessage() for record in caplog.records] == ["a: redis away", "b: redis away", "a: a bug"]
    problems.keep_only(["a"])
    assert not problems.recovered("b", "b: back"), "a forgotten key has nothing to recover from"


# --- run_forever --------------------------------------------------------------------------
def test_run_forever_logs_a_redis_outage_once_and_its_end_once_and_still_counts_every_error(caplog):
    stop = RecordingStop()
    before = sample("taskqueue_redis_errors_total", loop="scripted")
    loop = ScriptedLoop([*[RedisConnectionError("down")] * 4, 0.1, RedisConnectionError("down"), 0.1], stop)
    run_forever(loop, stop)
    assert len(lines(caplog, "scripted: redis error: down")) == 2, "once per outage"
    assert len(lines(caplog, "scripted: works again")) == 2
    assert sample("taskqueue_redis_errors_total", loop="scripted") == before + 5


def test_run_forever_logs_a_persisting_bug_once_with_its_traceback(caplog):
    stop = RecordingStop()
    loop = ScriptedLoop([*[ValueError("a bug")] * 3, 0.1], stop)
    run_forever(loop, stop)
    [error] = lines(caplog, "scripted: unexpected error")
    assert error.exc_info is not None and stop.waits == [1.0, 1.0, 1.0, 0.1]
    assert len(lines(caplog, "scripted: works again")) == 1


# --- heartbeat and retiring ids ------------------------------------------------------------
def test_the_heartbeat_logs_redis_away_once_and_its_renewal_after_it(key_prefix, broker, caplog):
    loop = HeartbeatLoop(unreachable_broker(key_prefix), ["q"], lambda: "c1", LeaseClock(9.0), lambda *loss: None)
    for _ in range(3):
        loop.run_once()
    assert len(lines(caplog, "heartbeat: redis error")) == 1
    loop.broker = broker
    loop.run_once()
    loop.run_once()
    assert len(lines(caplog, "heartbeat: works again")) == 1


def test_retiring_ids_log_redis_away_once(key_prefix, broker, caplog):
    retiring = RetiringIds(unreachable_broker(key_prefix), 60.0, lambda queue, consumer_id: [])
    retiring.retire("old", ["a"])
    for _ in range(3):
        retiring.run_once()
    assert len(lines(caplog, "redis error")) == 1
    retiring.broker = broker
    retiring.run_once()
    assert len(lines(caplog, "works again")) == 1


# --- the periodic scheduler ------------------------------------------------------------------
def config(name):
    return PeriodicConfig(name=name, task_type="demo.echo", schedule=Schedule(interval_s=1))


@pytest.mark.django_db(transaction=True)
def test_a_schedule_that_hits_a_bug_at_every_pass_is_logged_once_with_its_traceback_then_its_recovery(
    broker, caplog, monkeypatch
):
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="persisting-out")
    loop = PeriodicLoop(broker, 2.0, 60.0, load=lambda: (config("buggy"),))
    monkeypatch.setattr(loop, "_tend", lambda config, now_ms: 1 / 0)
    for _ in range(3):
        loop.run_once()
    [error] = lines(caplog, "periodic task buggy: unexpected error")
    assert error.exc_info is not None
    monkeypatch.undo()
    loop.run_once()
    loop.run_once()
    assert len(lines(caplog, "periodic task buggy is tended without error again")) == 1


@pytest.mark.django_db(transaction=True)
def test_periodic_rows_that_cannot_be_reloaded_are_logged_once_until_they_can(broker, caplog):
    away = [True]

    def load():
        if away[0]:
            raise RuntimeError("the database is away")
        return ()

    loop = PeriodicLoop(broker, 0.0, 60.0, load=load)  # refresh 0: every pass reloads
    for _ in range(3):
        loop.run_once()
    assert len(lines(caplog, "cannot reload periodic tasks")) == 1
    away[0] = False
    loop.run_once()
    loop.run_once()
    assert len(lines(caplog, "periodic tasks reloaded again")) == 1


@pytest.mark.django_db(transaction=True)
def test_code_schedules_that_cannot_be_synced_yet_are_logged_once(broker, caplog, monkeypatch):
    def sync(*args):
        raise RuntimeError("the database is away")

    monkeypatch.setattr(periodic_loop, "sync_code_schedules", sync)
    loop = CodeScheduleSync(PeriodicLoop(broker, 2.0, 60.0, load=tuple))
    for _ in range(3):
        loop.run_once()
    assert len(lines(caplog, "cannot sync TASKS_PERIODIC")) == 1
    monkeypatch.undo()
    loop.run_once()
    assert len(lines(caplog, "TASKS_PERIODIC synced")) == 1


# --- task types --------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_task_types_that_cannot_be_reloaded_are_logged_once_until_they_can(caplog, monkeypatch):
    cache = TaskTypeCache()

    def away():
        raise RuntimeError("the database is away")

    monkeypatch.setattr(TaskType.objects, "all", away)
    for _ in range(3):
        cache.refresh()
    assert len(lines(caplog, "cannot reload task types")) == 1
    monkeypatch.undo()
    cache.refresh()
    cache.refresh()
    assert len(lines(caplog, "task types reloaded again")) == 1
