"""The history index behind the task browser, and the per-minute chart counters, on real Redis."""

import contextlib
import threading
import time

import pytest

from tasks_app import producer
from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.consumer.claiming import Claimed
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import fire_slot, run_id
from tasks_app.periodic.schedule import Schedule
from tasks_app.protocol import history, records
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.history import RECORDS_PER_CALL
from tasks_app.protocol.periodic import SlotFiring
from tasks_app.protocol.records import ResultRecord, ResultUpdate
from tasks_app.registry import Handler, Registry
from tests.support.claims import claim, push, register, task_bytes
from tests.support.enqueued import file_ready
from tests.support.executing import executor_of
from tests.support.midway import MovesMidway
from tests.support.periodic import current_slot_ms

pytestmark = pytest.mark.django_db

RESULT_TTL_MS = 7 * 24 * 3600 * 1000  # the default TASKS_RESULT_TTL, which the index keys get


def _ids(broker, key):
    return [member.decode() for member in broker.client.zrange(key, 0, -1)]


def _wait_status(broker, task_ids, status, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = [ResultRecord.from_fields(fields or {}) for fields in broker.records.get_results(task_ids)]
        if all(record.status == status for record in records):
            return
        time.sleep(0.05)
    raise AssertionError(f"tasks did not reach {status}")


def _assert_indexed_ready(broker, queue, expected):
    """`expected` are the queue's history, oldest first, all READY; the index keys live as long as the records."""
    assert _ids(broker, broker.keys.history(queue)) == expected
    assert _ids(broker, broker.keys.history_status(queue, "READY")) == expected
    assert sorted(_ids(broker, broker.keys.history_ids(queue))) == sorted(expected)
    for key in history.index_keys(broker.keys, queue)[:3]:
        assert 0 < broker.client.pttl(key) <= RESULT_TTL_MS


def test_enqueued_tasks_enter_the_index_at_their_first_write_not_before(broker):
    first = producer.enqueue("demo.echo", queue="h")[0].id  # a new queue: enqueue_batch
    rest = [task.id for task in producer.enqueue("demo.echo", queue="h", count=3)]
    single = producer.enqueue("demo.echo", queue="h")[0].id  # a known queue: enqueue_one
    expected = [first, *rest, single]
    assert all(not broker.client.exists(key) for key in history.index_keys(broker.keys, "h"))  # a mark each
    file_ready(broker, expected, "h")
    _assert_indexed_ready(broker, "h", expected)


def _enqueue_filed(queue: str, count: int = 1) -> list[str]:
    ids = [task.id for task in producer.enqueue("demo.echo", queue=queue, count=count)]
    file_ready(get_broker(), ids, queue)
    return ids


def test_a_first_write_gives_the_index_its_time_to_live_again_only_once_it_has_run_down(broker):
    _enqueue_filed("h", 2)
    keys = history.index_keys(broker.keys, "h")
    broker.client.pexpire(keys[2], 60_000)  # a status index whose time to live a write cut short
    _enqueue_filed("h")  # the index was given its TTL just now: nothing rewritten
    assert broker.client.pttl(keys[2]) <= 60_000
    broker.client.pexpire(keys[0], RESULT_TTL_MS - 3_600_000)  # run down by an hour, beyond the 10 min slack
    _enqueue_filed("h")
    for key in keys[:3]:
        assert RESULT_TTL_MS - 60_000 < broker.client.pttl(key) <= RESULT_TTL_MS


def test_statuses_move_as_tasks_run_and_fail(broker, consumer_in_thread):
    ok = [task.id for task in producer.enqueue("demo.echo", queue="h", count=2)]
    bad = producer.enqueue("demo.fail", queue="h")[0].id
    from tasks_app.models import TaskType

    TaskType.objects.filter(name="demo.fail").update(max_attempts=1)
    with consumer_in_thread(queues=["h"], concurrency=2):
        _wait_status(broker, ok, "SUCCESSFUL")
        _wait_status(broker, [bad], "FAILED")
    assert sorted(_ids(broker, broker.keys.history_status("h", "SUCCESSFUL"))) == sorted(ok)
    assert _ids(broker, broker.keys.history_status("h", "FAILED")) == [bad]
    for status in ("READY", "RUNNING"):
        assert _ids(broker, broker.keys.history_status("h", status)) == []
    assert len(_ids(broker, broker.keys.history("h"))) == 3


def test_a_run_that_reports_progress_and_ends_at_once_is_filed_and_counted(broker, consumer_in_thread):
    # Its progress and its outcome share a flush and merge into one write, which must keep the queue.
    ids = [task.id for task in producer.enqueue("test.progress", [1, 0], queue="h", count=5)]
    with consumer_in_thread(queues=["h"], concurrency=2):
        _wait_status(broker, ids, "SUCCESSFUL")
    assert sorted(_ids(broker, broker.keys.history_status("h", "SUCCESSFUL"))) == sorted(ids)
    assert _ids(broker, broker.keys.history_status("h", "RUNNING")) == []
    assert all(broker.records.get_result(task_id)["progress"] for task_id in ids)
    minute = broker.inspect.minute_counts("h", [int(time.time()) // 60 + offset for offset in (-1, 0)])
    assert sum(counts.get("ok|test.progress", 0) for counts in minute) == 5, minute


def test_the_cap_drops_the_oldest_entries(broker):
    broker.records.history_max = 3
    ids = [_enqueue_filed("h")[0] for _ in range(5)]
    assert _ids(broker, broker.keys.history("h")) == ids[2:]
    assert _ids(broker, broker.keys.history_status("h", "READY")) == ids[2:]
    assert sorted(_ids(broker, broker.keys.history_ids("h"))) == sorted(ids[2:])


def test_entries_older_than_the_result_ttl_drop_out(broker, settings):
    old = _enqueue_filed("h")[0]
    aged_ms = (time.time() - settings.TASKS_RESULT_TTL - 60) * 1000
    broker.client.zadd(broker.keys.history("h"), {old: aged_ms})
    new = _enqueue_filed("h")[0]
    assert _ids(broker, broker.keys.history("h")) == [new]
    assert _ids(broker, broker.keys.history_status("h", "READY")) == [new]


def _unique_echo_on_h() -> None:
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="h", unique_for_s=600)


def _each_second(catch_up: str = "skip") -> PeriodicConfig:
    return PeriodicConfig(name="tick", task_type="demo.echo", schedule=Schedule(interval_s=1), catch_up=catch_up)


def test_periodic_runs_are_indexed_ready_when_fired_catch_up_first(broker):
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="h")
    once, now_ms = _each_second("once"), current_slot_ms(broker)
    assert fire_slot(once, SlotFiring(now_ms - 10_000, now_ms - 11_000, 60_000, "once"), broker).outcome == "fired"
    firing = SlotFiring(now_ms, now_ms - 1000, 60_000, "once")
    assert fire_slot(once, firing, broker).outcome == "fired_and_caught_up"
    assert fire_slot(once, firing, broker).outcome == "done"  # pushes nothing, files nothing
    expected = [run_id("tick", now_ms - 10_000), run_id("tick", now_ms, "catch_up"), run_id("tick", now_ms)]
    _assert_indexed_ready(broker, "h", expected)


def test_unique_tasks_are_indexed_ready_when_pushed_and_duplicates_are_not(broker):
    _unique_echo_on_h()
    first = producer.enqueue("demo.echo", [1], count=3)
    delayed = producer.enqueue("demo.echo", [2], delay_s=60)[0]
    urgent = producer.enqueue("demo.echo", [3], priority=5)[0]
    assert [task.duplicate for task in first] == [False, True, True]
    expected = [first[0].id, delayed.id, urgent.id]
    assert _ids(broker, broker.keys.history("h")) == expected
    assert _ids(broker, broker.keys.history_status("h", "READY")) == expected
    assert sorted(_ids(broker, broker.keys.history_ids("h"))) == sorted(expected)
    assert 0 < broker.client.pttl(broker.keys.history_status("h", "READY")) <= RESULT_TTL_MS


def test_a_task_filed_at_enqueue_leaves_ready_at_its_first_write_with_its_score(broker, consumer_in_thread):
    _unique_echo_on_h()
    filed = producer.enqueue("demo.echo", [1])[0].id  # a unique task: READY in the index, its record without a status
    score = broker.client.zscore(broker.keys.history("h"), filed)
    with consumer_in_thread(queues=["h"]):
        _wait_status(broker, [filed], "SUCCESSFUL")
    assert _ids(broker, broker.keys.history_status("h", "READY")) == []
    assert _ids(broker, broker.keys.history_status("h", "SUCCESSFUL")) == [filed]
    assert broker.client.zscore(broker.keys.history_status("h", "SUCCESSFUL"), filed) == score
    assert _ids(broker, broker.keys.history("h")) == [filed]


def test_periodic_and_unique_enqueues_keep_the_cap_and_drop_aged_entries(broker, settings):
    _unique_echo_on_h()
    broker.enqueuer.history_max = 3
    old = producer.enqueue("demo.echo", [0])[0].id
    broker.client.zadd(broker.keys.history("h"), {old: (time.time() - settings.TASKS_RESULT_TTL - 60) * 1000})
    ids = [producer.enqueue("demo.echo", [n])[0].id for n in range(1, 4)]
    assert _ids(broker, broker.keys.history("h")) == ids  # the aged entry dropped by the first of them
    slot_ms = current_slot_ms(broker)
    assert fire_slot(_each_second(), SlotFiring(slot_ms, slot_ms - 1000, 60_000, "skip"), broker).pushed
    assert _ids(broker, broker.keys.history("h")) == [*ids[1:], run_id("tick", slot_ms)]
    assert _ids(broker, broker.keys.history_status("h", "READY")) == [*ids[1:], run_id("tick", slot_ms)]


def test_window_prefix_and_delete(broker):
    ids = _enqueue_filed("h", 4)
    other = _enqueue_filed("h2")[0]
    window = broker.records.history_window(["h", "h2"], None, None, None, 3)
    assert [entry.task_id for entry in window] == [other, ids[3], ids[2]]
    older = broker.records.history_window(["h", "h2"], "READY", window[-1].score_ms, None, 10)
    assert [entry.task_id for entry in older] == [ids[1], ids[0]]
    assert broker.records.history_count(["h", "h2"], None, None) == 5
    assert [entry.task_id for entry in broker.records.history_by_prefix(["h", "h2"], ids[2][:8], 5)] == [ids[2]]
    assert broker.records.delete_finished([("h", ids[0])]) == [history.KEPT]  # READY: it waits, it keeps its record
    broker.records.record_result(ResultUpdate(ids[0], {"status": "SUCCESSFUL"}, 60, queue="h"))
    assert broker.records.delete_finished([("h", ids[0]), ("h", "no-such-task")]) == [history.DELETED, history.GONE]
    assert broker.records.get_result(ids[0]) is None
    assert ids[0] not in _ids(broker, broker.keys.history("h"))
    assert ids[0] not in _ids(broker, broker.keys.history_ids("h"))


def test_a_prefix_finds_ids_that_go_on_with_any_character(broker):
    ids = ["tâche-a", "tâche-€", "tâche-\U0001f600", "tâchf"]
    producer.enqueue_many([producer.TaskRequest("demo.echo", queue="h", task_id=task_id) for task_id in ids])
    file_ready(broker, ids, "h")
    assert sorted(entry.task_id for entry in broker.records.history_by_prefix(["h"], "tâche-", 10)) == sorted(ids[:3])


def test_a_foreign_index_key_loses_only_index_entries(broker):
    _enqueue_filed("h")
    broker.client.delete(broker.keys.history_status("h", "READY"))
    broker.client.set(broker.keys.history_status("h", "READY"), "not a zset")
    task = producer.enqueue("demo.echo", queue="h")[0]
    file_ready(broker, [task.id], "h")
    assert broker.records.get_result(task.id)["type"] == "demo.echo"
    assert task.id in _ids(broker, broker.keys.history("h"))


def test_runs_are_counted_per_minute(broker, consumer_in_thread):
    ids = [task.id for task in producer.enqueue("demo.echo", queue="h", count=3)]
    with consumer_in_thread(queues=["h"], concurrency=2):
        _wait_status(broker, ids, "SUCCESSFUL")
    minute = int(time.time()) // 60
    counts = broker.inspect.minute_counts("h", [minute - 1, minute])
    total = {key: sum(c.get(key, 0) for c in counts) for key in ("ok", "ok|demo.echo")}
    assert total == {"ok": 3, "ok|demo.echo": 3}
    assert sum(v for c in counts for k, v in c.items() if k.startswith("d|demo.echo|")) == 3
    # The first sample of a minute is its point: this one, or the consumer's scheduler's while it drained.
    broker.inspect.sample_backlog("h")
    assert broker.inspect.minute_counts("h", [int(time.time()) // 60])[0]["backlog"] in (0, 1, 2, 3)


def test_every_status_a_record_can_have_has_an_index():
    assert set(history.STATUSES) == {records.READY, records.RUNNING, *records.FINISHED}


def test_one_flush_files_the_tasks_of_several_queues_in_calls_of_bounded_size(broker):
    per_queue = {
        queue: [t.id for t in producer.enqueue("demo.echo", queue=queue, count=RECORDS_PER_CALL + 3)]
        for queue in ("h", "h2")
    }
    updates = [
        ResultUpdate(task_id, {"status": "SUCCESSFUL" if n % 2 else "FAILED"}, 60, queue=queue)
        for queue, ids in per_queue.items()
        for n, task_id in enumerate(ids)
    ]
    unfiled = ResultUpdate(per_queue["h"][0], {"progress": "1"}, 60)  # no status, no queue: no index
    updates.insert(5, unfiled)
    report = broker.queue.ack_many_reporting(updates, {})

    assert report.written == (1,) * len(updates) and not report.refused
    for queue, ids in per_queue.items():
        assert set(_ids(broker, broker.keys.history_status(queue, "SUCCESSFUL"))) == set(ids[1::2])
        assert set(_ids(broker, broker.keys.history_status(queue, "FAILED"))) == set(ids[0::2])
        assert _ids(broker, broker.keys.history_status(queue, "READY")) == []
    assert broker.records.get_result(per_queue["h"][0])["progress"] == "1"


def test_a_refused_record_in_a_call_stops_none_of_the_others(broker):
    ids = [task.id for task in producer.enqueue("demo.echo", queue="h", count=3)]
    broker.client.delete(broker.keys.result(ids[1]))
    broker.client.rpush(broker.keys.result(ids[1]), "not a hash")
    report = broker.queue.ack_many_reporting(
        [ResultUpdate(i, {"status": "SUCCESSFUL"}, 60, queue="h") for i in ids], {}
    )

    assert list(report.refused) == [1] and "WRONGTYPE" in str(report.refused[1])
    assert [report.written[0], report.written[2]] == [1, 1]
    assert set(_ids(broker, broker.keys.history_status("h", "SUCCESSFUL"))) == {ids[0], ids[2]}


@pytest.mark.parametrize(
    "argv",
    [
        ["999", "READY"],  # more status indexes than keys and arguments
        ["0", "0", "60", "", "", "", "id"],  # a group cut short before its pair count
        ["0", "0", "60", "", "", "", "id", "99999", "status"],  # more pairs than given
        ["0", "0", "x", "w", "{not json", "nan", "id", "1", "status", "SUCCESSFUL"],
        ["0", "1"],  # held, without the task or the list
        ["-3"],
        [],
    ],
)
def test_record_result_takes_any_arguments_without_raising(broker, argv):
    keys = [broker.keys.result("hostile-1"), broker.keys.result("hostile-2")]
    replies = broker.scripts.run(broker.client, "record_result", keys, argv)
    assert isinstance(replies, list) and len(replies) <= 2
    assert not any(isinstance(reply, Exception) and "attempt to" in str(reply) for reply in replies)


def test_a_foreign_task_without_an_enqueue_time_stays_in_the_history_index(broker):
    registry = Registry()
    registry.add(Handler("demo.echo", lambda *a: list(a)))
    register(broker, "w", lease_ms=30_000)
    executor = executor_of(broker, registry, "w")
    push(broker, task_bytes("t5", "demo.echo"))  # a plain LPUSH; enqueued_at_ms left at 0 (protobuf's default)
    [raw] = claim(broker, "w", 1)
    executor.execute(Claimed("q", "w", raw, fence=1))
    assert broker.records.get_result("t5")["status"] == "SUCCESSFUL"
    producer.enqueue("demo.echo", queue="q")  # any enqueue trims the queue's index of aged entries
    assert "t5" in _ids(broker, broker.keys.history_status("q", "SUCCESSFUL"))


def _minute_total(broker, queue, field):
    minute = int(time.time()) // 60
    return sum(counts.get(field, 0) for counts in broker.inspect.minute_counts(queue, [minute - 1, minute]))


def test_an_outcome_the_record_turned_away_is_not_charted(broker):
    # A later run (token 10) owns the record: the late outcome of the run that lost its claim
    # (token 5) is ignored by record_result, so the chart does not count it either.
    broker.records.record_result(ResultUpdate("t1", {"status": "SUCCESSFUL"}, 60, fence=10, queue="h", task_type="x"))
    before = _minute_total(broker, "h", "ok")
    batcher = AckBatcher(broker, threading.Event())
    batcher.record(ResultUpdate("t1", {"status": "SUCCESSFUL"}, 60, fence=5, queue="h", task_type="x", run_s=0.1))
    batcher.flush_once(block_s=0.1)
    assert broker.records.get_result("t1")["fence"] == "10"
    assert _minute_total(broker, "h", "ok") == before


class Killed(BaseException):
    """The consumer process dies here (kill -9): nothing after this runs."""


def test_a_consumer_killed_right_after_a_flush_leaves_no_count_of_an_outcome_the_record_turned_away(broker):
    broker.records.record_result(ResultUpdate("t1", {"status": "SUCCESSFUL"}, 60, fence=10, queue="h", task_type="x"))
    before = _minute_total(broker, "h", "ok")

    def die() -> None:
        raise Killed

    dying = Broker(MovesMidway(broker.client, die, before=1), broker.keys.prefix, broker.scripts)  # after the flush
    late = ResultUpdate("t1", {"status": "SUCCESSFUL"}, 60, fence=5, queue="h", task_type="x", run_s=0.1)
    with contextlib.suppress(Killed):  # it dies before any round trip after the flush's own
        dying.queue.ack_many_reporting([late], {})
    assert broker.records.get_result("t1")["fence"] == "10"
    assert _minute_total(broker, "h", "ok") == before


def test_an_outcome_redis_refused_is_not_charted(broker):
    # The record's key holds a string: the SUCCESSFUL write is refused, and so is the FAILED one
    # tried instead. Nothing is recorded, so nothing is charted.
    broker.client.set(broker.keys.result("t2"), "not a hash")
    push(broker, task_bytes("t2", queue="h"), queue="h")
    broker.leases.heartbeat(["h"], "c", 10_000, {})
    [raw] = claim(broker, "c", 1, queue="h")
    batcher = AckBatcher(broker, threading.Event())
    done: list[bool | None] = []
    outcome = ResultUpdate("t2", {"status": "SUCCESSFUL"}, 60, fence=1, queue="h", task_type="x", run_s=0.1)
    batcher.ack("h", "c", raw, outcome, done.append)
    batcher.flush_once(block_s=0.1)
    assert done == [True]
    assert (_minute_total(broker, "h", "ok"), _minute_total(broker, "h", "failed")) == (0, 0)


def test_a_group_too_large_to_unpack_fails_alone(broker):
    keys = [broker.keys.result("huge"), broker.keys.result("fine")]
    huge = ["60", "", "", "", "huge", "5000", *(["f", "v"] * 5000)]
    fine = ["60", "", "", "", "fine", "1", "status", "SUCCESSFUL"]
    replies = broker.scripts.run(broker.client, "record_result", keys, ["0", "0", *huge, *fine])
    assert isinstance(replies[0], Exception) and replies[1] == 1
    assert broker.records.get_result("fine")["status"] == "SUCCESSFUL"


def test_the_backlog_is_sampled_once_a_minute_however_many_consumers_sample_it(broker):
    # Before: every consumer of a queue read its four keys and wrote the minute's point every 45 s.
    producer.enqueue("demo.echo", queue="h", count=2)
    assert broker.inspect.sample_backlog("h") == 2
    producer.enqueue("demo.echo", queue="h", count=3)
    assert broker.inspect.sample_backlog("h") is None
    assert broker.inspect.minute_counts("h", [int(time.time()) // 60])[0]["backlog"] == 2


def test_an_empty_queues_backlog_is_sampled_as_zero(broker):
    # An empty queue, what most of a consumer's queues are, is one EXISTS and no count.
    assert broker.inspect.sample_backlog("empty") == 0
    assert broker.inspect.minute_counts("empty", [int(time.time()) // 60])[0]["backlog"] == 0
