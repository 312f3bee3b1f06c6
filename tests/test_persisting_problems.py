"""A problem that persists across a loop's passes is logged once (then a reminder now and then), and its end once."""

import logging
from functools import partial

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tasks_app.collectors import QueueCollector
from tasks_app.consumer import periodic_loop
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.gates import ConcurrencyGate, RateLimiter
from tasks_app.consumer.loops import run_forever, touch, until_done
from tasks_app.consumer.membership import Membership, RetiringIds
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.periodic_loop import PeriodicLoop
from tasks_app.consumer.supervisor import ProcessGuard
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.schedule import Schedule
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.codec import Task
from tasks_app.protocol.limits import SlotSet
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig
from tests.support.counters import sample
from tests.test_consumer import make_consumer
from tests.test_loops import RecordingStop, ScriptedLoop, heartbeat_of, unreachable_broker

logger = logging.getLogger("tests.persisting")


def lines(caplog, text):
    """The records whose message holds `text`."""
    return [record for record in caplog.records if text in record.getMessage()]


def said_once_then_its_end(caplog, attempt, problem, heal, recovery):
    """Attempt three times with a problem, heal it, attempt twice: the problem and its recovery are each said once."""
    for _ in range(3):
        attempt()
    assert len(lines(caplog, problem)) == 1
    heal()
    attempt()
    attempt()
    assert len(lines(caplog, recovery)) == 1


def list_of(items):
    """Exhaust an iterator (a scrape)."""
    return list(items())


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
    assert recovery.levelno == logging.WARNING, "seen where only problems are logged, as the problem was"
    assert recovery.getMessage() == "loop: working again (after 60 s)"


def test_a_different_problem_is_logged_at_once_and_keys_are_apart(caplog):
    problems = ProblemLog(logger, remind_every_s=None)
    problems.failed("a", "redis", "a: redis away")
    problems.failed("b", "redis", "b: redis away")
    problems.failed("a", "bug", "a: a bug", level=logging.ERROR)
    problems.failed("a", "bug", "a: a bug", level=logging.ERROR)
    assert [record.getMessage() for record in caplog.records] == ["a: redis away", "b: redis away", "a: a bug"]
    problems.keep_only(lambda key: key == "a")
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
@pytest.mark.parametrize("name", ["heartbeat", "retiring"])
def test_lease_renewals_log_redis_away_once_and_their_renewal_after_it(key_prefix, broker, caplog, name):
    loop: Membership | RetiringIds
    if name == "heartbeat":
        loop = heartbeat_of(unreachable_broker(key_prefix), "c1", ["q"], [])
    else:
        loop = RetiringIds(unreachable_broker(key_prefix), 60.0, lambda queue, consumer_id: [])
        loop.retire("old", ["a"])

    class HealingStop(RecordingStop):
        def wait(self, timeout: float | None = None) -> bool:
            if len(self.waits) == 3:  # three passes with Redis away, then two with it back
                loop.broker = loop.heartbeat_broker = broker
            return super().wait(timeout)

    run_forever(loop, HealingStop(stop_after=5))
    assert len(lines(caplog, f"{name}: redis error")) == 1
    assert len(lines(caplog, f"{name}: works again")) == 1


# --- the periodic scheduler ------------------------------------------------------------------
def config(name):
    return PeriodicConfig(name=name, task_type="demo.echo", schedule=Schedule(interval_s=1))


@pytest.mark.django_db(transaction=True)
def test_a_schedule_that_hits_a_bug_at_every_pass_is_logged_once_with_its_traceback_then_its_recovery(
    broker, caplog, monkeypatch
):
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="persisting-out")
    loop = PeriodicLoop(broker, 2.0, 60.0, load=lambda: (config("buggy"),))
    monkeypatch.setattr(loop, "_look", lambda config, now_ms: 1 / 0)
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
    heal = partial(away.__setitem__, 0, False)
    said_once_then_its_end(caplog, loop.run_once, "cannot reload periodic tasks", heal, "periodic tasks reloaded again")


@pytest.mark.django_db(transaction=True)
def test_code_schedules_that_cannot_be_synced_yet_are_logged_once(broker, caplog, monkeypatch):
    def sync(*args):
        raise RuntimeError("the database is away")

    monkeypatch.setattr(periodic_loop, "sync_code_schedules", sync)
    loop = PeriodicLoop(broker, 2.0, 60.0, load=tuple)
    said_once_then_its_end(
        caplog, loop.run_once, "cannot sync TASKS_PERIODIC", monkeypatch.undo, "TASKS_PERIODIC synced"
    )


# --- task types --------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_task_types_that_cannot_be_reloaded_are_logged_once_until_they_can(caplog, monkeypatch):
    cache = TaskTypeCache()
    cache.refresh()  # read once: then a failed read keeps the last ones

    def away():
        raise RuntimeError("the database is away")

    monkeypatch.setattr(TaskType.objects, "all", away)
    said_once_then_its_end(
        caplog, cache.refresh, "cannot reload task types", monkeypatch.undo, "task types reloaded again"
    )


def test_values_of_a_keyed_limit_that_cannot_be_noted_are_logged_once_until_they_can(broker, caplog):
    keyed = TaskTypeConfig(name="keyed", handler="keyed", rate_limit=1, rate_period_s=60.0, rate_limit_key="tenant")
    limiter, denials = RateLimiter(broker), iter(range(10))
    broker.client.set(broker.keys.rate_keyed("keyed"), "foreign")  # a key of the wrong type in its place

    def deny():
        assert limiter(Task(id=f"task-{next(denials)}", type="keyed"), keyed, "a").wait_ms > 0

    limiter(Task(id="first", type="keyed"), keyed, "a")  # admitted: every later one is denied
    heal = partial(broker.client.delete, broker.keys.rate_keyed("keyed"))
    said_once_then_its_end(caplog, deny, "could not note the rate-limited value", heal, "noted again")


# --- retried calls, slot renewals, beats, scrapes ------------------------------------------
class Outage:
    """A call that fails with a lost connection `times` times, then answers."""

    def __init__(self, times: int) -> None:
        self.left = times

    def __call__(self) -> str:
        if self.left:
            self.left -= 1
            raise RedisConnectionError("down")
        return "done"


def test_a_call_retried_through_an_outage_logs_it_once_and_its_end_once(caplog):
    before = sample("taskqueue_redis_errors_total", loop="persisting.call")
    assert until_done(Outage(4), what="persisting.call", give_up=RecordingStop()) == "done"
    assert len(lines(caplog, "redis error during persisting.call")) == 1
    assert len(lines(caplog, "persisting.call works again")) == 1
    assert sample("taskqueue_redis_errors_total", loop="persisting.call") == before + 4


def test_concurrency_slots_that_cannot_be_renewed_are_logged_once(key_prefix, broker, caplog):
    gate = ConcurrencyGate(broker, unreachable_broker(key_prefix), lease_s=3, recheck_s=5, give_up=RecordingStop())
    gate._held["a-run"] = SlotSet("capped", None, 1)
    heal = partial(setattr, gate, "renew_broker", broker)
    said_once_then_its_end(caplog, gate.renew, "could not renew", heal, "concurrency permits renewed again")


def test_a_beat_file_that_cannot_be_touched_is_logged_once(tmp_path, caplog):
    guard = ProcessGuard(ConsumerOptions(), lambda *limits: 0, lambda code, reason: None)
    beat = tmp_path / "gone" / "beat"
    attempt = partial(touch, beat, guard._beat_problem, "beat file")
    said_once_then_its_end(caplog, attempt, "cannot touch the beat file", beat.parent.mkdir, "touched again")


def test_queue_stats_that_cannot_be_read_are_logged_once_per_outage_and_still_counted(key_prefix, broker, caplog):
    dead = unreachable_broker(key_prefix)
    source = [dead]
    collector = QueueCollector(lambda: source[0], ["q"], timeout_s=5.0)
    before = sample("taskqueue_queue_stats_errors_total")
    attempt, heal = partial(list_of, collector.collect), partial(source.__setitem__, 0, broker)
    said_once_then_its_end(caplog, attempt, "queue stats: cannot read Redis", heal, "queue stats read again")
    assert sample("taskqueue_queue_stats_errors_total") == before + 3


def test_a_burst_consumer_that_cannot_check_its_queues_says_so_once(broker, caplog, monkeypatch):
    consumer = make_consumer(broker, burst=True)
    monkeypatch.setattr(consumer._queues_idle, "claimable", lambda: Outage(9)())
    assert not consumer._idle(), "not idle while the queues cannot be checked"
    recovery = "burst: the queues can be checked again"
    said_once_then_its_end(caplog, consumer._idle, "burst: cannot check the queues", monkeypatch.undo, recovery)
    assert consumer._idle()
    consumer.give_up.set()


def test_a_flusher_that_keeps_hitting_a_bug_logs_it_once_with_its_traceback(broker, caplog, monkeypatch):
    batcher = AckBatcher(broker, RecordingStop())
    steps = iter([ValueError("a bug"), ValueError("a bug"), 0, ValueError("a bug"), 2, None])

    def flush_once(block_s):
        step = next(steps)
        if isinstance(step, Exception):
            raise step
        return step

    monkeypatch.setattr(batcher, "flush_once", flush_once)
    batcher._run()
    [error] = lines(caplog, "unexpected error flushing results and acks")
    assert error.exc_info is not None
    assert len(lines(caplog, "results and acks flushed again")) == 1
