"""The delayed set against real Redis: malformed members, the server clock, record lifetimes."""

import types

import pytest

from tasks_app import producer
from tasks_app.consumer.loops import SchedulerLoop
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.keys import UNDECODABLE_TYPE, delayed_member, split_delayed_member
from tests.support.processes import wait_until
from tests.support.recording import runs_per_task

pytestmark = pytest.mark.django_db(transaction=True)


def foreign_task(n: int, priority: int = 0) -> bytes:
    return encode_task(Task(id=f"foreign-{n}", type="test.record", queue="default", priority=priority))


def malformed_members() -> dict[bytes, str]:
    """Members a careless foreign producer can ZADD, and the reason each is refused for."""
    raw = foreign_task(99)
    return {
        raw: "does not start with a priority",  # the prefix forgotten
        b"abcd" + raw: "does not start with a priority",
        b"": "does not start with a priority",
        b"99999999999999999999" + raw: "does not start with a priority",  # a huge number, no sign
        b"+999" + raw: "outside -100..100",
        b"-00": "does not start with a priority",
        b"+000": "no task after its priority",
    }


def test_malformed_members_are_dead_lettered_and_the_good_ones_run(broker, consumer_process):
    good = producer.enqueue("test.record", delay_s=0.2, count=20)
    due_ms = broker.inspect.server_time_ms() - 1000
    bad = malformed_members()
    foreign_good = {delayed_member(5, foreign_task(1, 5)): due_ms, delayed_member(0, foreign_task(2)): due_ms}
    broker.client.zadd(broker.keys.delayed("default"), {**dict.fromkeys(bad, due_ms), **foreign_good})

    consumer = consumer_process("--concurrency", "4")
    expected = {task.id for task in good} | {"foreign-1", "foreign-2"}
    wait_until(lambda: set(runs_per_task(broker)) >= expected, 30, message="every good delayed task to run")

    dead = [decode_task(member) for member, _ in broker.inspect.list_dead("default")]
    assert sorted(task.payload for task in dead) == sorted(bad)
    for task in dead:
        assert task.type == UNDECODABLE_TYPE and task.queue == "default"
        assert bad[task.payload] in task.dead_reason and task.last_error.startswith("MalformedDelayedMember: ")
    assert broker.client.zcard(broker.keys.delayed("default")) == 0
    assert set(runs_per_task(broker)) == expected and max(runs_per_task(broker).values()) == 1
    assert consumer.process.poll() is None, consumer.log()


def test_promotion_reports_malformed_members_and_never_raises(broker):
    due_ms = broker.inspect.server_time_ms() - 1000
    broker.client.zadd(
        broker.keys.delayed("q"),
        {**dict.fromkeys(malformed_members(), due_ms), delayed_member(-3, foreign_task(1)): due_ms},
    )
    promotion = broker.queue.promote_due("q")
    assert (promotion.moved, promotion.malformed) == (1, len(malformed_members()))
    assert broker.client.zcard(broker.keys.dead("q")) == len(malformed_members())
    assert broker.client.zrange(broker.keys.prioritized("q"), 0, -1) == [foreign_task(1)]


def test_a_foreign_infinite_score_does_not_make_the_scheduler_spin(broker):
    broker.client.zadd(broker.keys.delayed("q"), {delayed_member(0, foreign_task(1)): float("inf")})
    promotion = broker.queue.promote_due("q")
    assert promotion.moved == 0 and promotion.next_due_ms > promotion.now_ms
    assert SchedulerLoop(broker, ["q"]).run_once() == SchedulerLoop.MAX_SLEEP_S


@pytest.mark.parametrize(
    ("script", "keys", "args"),
    [
        ("promote_due", 6, ["lots", "\x00wake", "q", "t"]),
        ("promote_due", 6, ["nan", "\x00wake", "q", "t"]),
        ("promote_due", 6, []),
        ("enqueue_prioritized", 2, ["\x00wake", "high", b"task", "1e400", b"task2", "7"]),
        ("requeue_dead", 6, ["\x00wake", "0", "x", "2", "y", b"member", "-inf", b"task", b"id", "z", "9", b"f"]),
        ("requeue_dead", 6, ["\x00wake", "lots", "-1", "nan", b"member", "1e400", b"task", b"id", "-5", "3"]),
        ("trim_dead", 1, ["many", "old"]),
        ("enqueue_batch", 4, ["\x00wake", "x", "y", "1", "3", "q", "9", b"t", "5", "", "p", "d"]),
    ],
)
def test_scripts_never_raise_on_odd_arguments(broker, script, keys, args):
    names = [
        broker.keys.delayed("q"),
        broker.keys.pending("q"),
        broker.keys.prioritized("q"),
        broker.keys.recoveries("q"),
        broker.keys.suspects("q"),
        broker.keys.dead("q"),
    ]
    broker.client.zadd(broker.keys.dead("q"), {b"member": 1})
    broker.scripts.run(broker.client, script, names[:keys], args)


def test_delayed_member_is_well_formed_whatever_the_priority():
    for priority in (-(10**12), -101, -100, -1, 0, 7, 100, 101, 2**40):
        member = delayed_member(priority, b"task")
        assert split_delayed_member(member) == (max(-100, min(100, priority)), b"task")
    assert split_delayed_member(b"abcdtask") is None and split_delayed_member(b"+000") is None


def test_a_delay_is_scored_on_the_redis_clock_not_the_producers(broker, monkeypatch):
    skewed_s = 3600.0  # this producer's clock is an hour slow
    monkeypatch.setattr(producer, "time", types.SimpleNamespace(time=lambda: _real_time() - skewed_s))
    producer.enqueue("demo.echo", delay_s=60)
    [(_, score)] = broker.client.zrange(broker.keys.delayed("default"), 0, -1, withscores=True)
    assert abs(score - (broker.inspect.server_time_ms() + 60_000)) < 5_000


def test_a_ready_record_outlives_its_tasks_due_time(broker, settings):
    settings.TASKS_RESULT_TTL = 3600
    # A caller's id keeps a READY record (a generated one gets a waiting mark, which never expires).
    [task] = producer.enqueue_many([producer.TaskRequest("demo.echo", delay_s=30 * 86400, task_id="late")])
    requests = [producer.TaskRequest("demo.echo", delay_s=2 * 86400, task_id=f"soon-{n}") for n in range(2)]
    [batch_task, _] = producer.enqueue_many(requests)
    assert broker.client.ttl(broker.keys.result(task.id)) > 30 * 86400 + 3000
    assert broker.client.ttl(broker.keys.result(batch_task.id)) > 2 * 86400 + 3000


def _real_time() -> float:
    import time

    return time.time()
