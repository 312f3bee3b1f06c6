"""The ack batcher: results before acks in one flush, lost acks flagged, barriers, merged updates, refused entries."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis

from tasks_app import producer
from tasks_app.consumer.ack_batcher import AckBatcher, merge_updates, storable
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.records import ResultUpdate

pytestmark = pytest.mark.django_db


def test_successive_updates_of_a_task_merge_unless_both_append():
    started = ResultUpdate("a", {"status": "RUNNING", "attempts": "1"}, 60, append_worker_id="w1")
    done = ResultUpdate("a", {"status": "SUCCESSFUL"}, 90)
    other = ResultUpdate("b", {"status": "RUNNING"}, 60, append_worker_id="w1")
    rerun = ResultUpdate("a", {"status": "RUNNING"}, 60, append_worker_id="w2")

    merged = merge_updates([started, other, done, rerun])

    assert [u.task_id for u in merged] == ["a", "b", "a"]
    assert merged[0].fields == {"status": "SUCCESSFUL", "attempts": "1"}
    assert merged[0].append_worker_id == "w1" and merged[0].ttl_s == 90
    assert merged[2].append_worker_id == "w2"


def test_an_outcome_merged_into_an_earlier_write_keeps_its_queue_and_type():
    progress = ResultUpdate("a", {"progress": "50"}, 60, fence=7)  # a write that knows no queue
    done = ResultUpdate("a", {"status": "SUCCESSFUL"}, 60, fence=7, queue="q", task_type="t", run_s=0.5)

    (merged,) = merge_updates([progress, done])

    assert merged.fields == {"progress": "50", "status": "SUCCESSFUL"}
    assert (merged.queue, merged.task_type, merged.run_s) == ("q", "t", 0.5)  # filed and charted


def _claimed(broker: Broker, consumer_id: str, count: int) -> tuple[list[str], list[bytes]]:
    tasks = producer.enqueue("demo.echo", count=count)
    broker.leases.heartbeat(["default"], consumer_id, 10_000, {})
    return [t.id for t in tasks], broker.queue.claim("default", consumer_id, count)


def test_one_flush_records_results_then_acks_and_reports_each_task(broker):
    ids, raws = _claimed(broker, "c1", 3)
    give_up = threading.Event()
    batcher = AckBatcher(broker, give_up)
    outcomes: list[bool | None] = []
    for task_id, raw in zip(ids, raws, strict=True):
        batcher.record(ResultUpdate(task_id, {"status": "RUNNING"}, 60, append_worker_id="c1"))
        batcher.ack("default", "c1", raw, ResultUpdate(task_id, {"status": "SUCCESSFUL"}, 60), outcomes.append)
    # As if c1 was reaped (its id out of the consumers, as reap takes it first) and raws[1] recovered.
    broker.client.zrem(broker.keys.consumers("default"), "c1")
    broker.client.lrem(broker.keys.processing("default", "c1"), 1, raws[1])

    assert batcher.flush_once(block_s=0.1) == 6

    assert outcomes == [True, False, True]
    assert broker.client.llen(broker.keys.processing("default", "c1")) == 0
    for task_id in (ids[0], ids[2]):
        record = broker.records.get_result(task_id)
        assert record["status"] == "SUCCESSFUL" and record["worker_ids"] == '["c1"]'
    assert broker.records.get_result(ids[1])["status"] == "READY"  # the writes of a run that lost its task are held


def test_barrier_returns_after_earlier_writes_and_close_flushes_the_rest(broker):
    ids, raws = _claimed(broker, "c2", 2)
    batcher = AckBatcher(broker, threading.Event())
    batcher.start()
    batcher.record(ResultUpdate(ids[0], {"status": "RUNNING"}, 60))
    batcher.barrier()
    assert broker.records.get_result(ids[0])["status"] == "RUNNING"

    acked: list[bool | None] = []
    batcher.ack("default", "c2", raws[0], None, acked.append)
    batcher.ack("default", "c2", raws[1], None, acked.append)
    batcher.close(timeout_s=10)

    assert acked == [True, True]
    assert broker.client.llen(broker.keys.processing("default", "c2")) == 0


def test_a_barrier_with_no_flusher_running_writes_every_batch_submitted_before_it(broker):
    _ids, raws = _claimed(broker, "c3", 5)
    batcher = AckBatcher(broker, threading.Event(), max_batch=2)  # never started, or already closed
    acked: list[bool | None] = []
    for raw in raws:
        batcher.ack("default", "c3", raw, None, acked.append)

    batcher.barrier()

    assert acked == [True] * 5
    assert broker.client.llen(broker.keys.processing("default", "c3")) == 0


class FlakyBroker(Broker):
    """A real broker whose next `failures` batch writes fail as a dropped connection would."""

    def __init__(self, broker: Broker, failures: int) -> None:
        super().__init__(broker.client, broker.keys.prefix, broker.scripts)
        self.failures = failures
        self.calls = 0
        real = self.queue.ack_many_reporting

        def ack_many_reporting(results, raws_by_owner, releases=None):
            self.calls += 1
            if self.calls <= self.failures:
                raise redis.exceptions.ConnectionError("connection reset by peer")
            return real(results, raws_by_owner, releases)

        self.queue.ack_many_reporting = ack_many_reporting


def _ack_all(
    batcher: AckBatcher,
    ids: list[str],
    raws: list[bytes],
    consumer_id: str,
    fields: dict[str, dict[str, str]] | None = None,
) -> list[bool | None]:
    outcomes: list[bool | None] = []
    for task_id, raw in zip(ids, raws, strict=True):
        update = ResultUpdate(task_id, (fields or {}).get(task_id, {"status": "SUCCESSFUL"}), 60)
        batcher.ack("default", consumer_id, raw, update, outcomes.append)
    return outcomes


def test_a_result_that_redis_refuses_fails_only_its_own_task(broker, caplog):
    ids, raws = _claimed(broker, "c3", 3)
    broker.client.delete(broker.keys.result(ids[1]))
    broker.client.rpush(broker.keys.result(ids[1]), "not a hash")  # every write to it: WRONGTYPE
    batcher = AckBatcher(broker, threading.Event())
    outcomes = _ack_all(batcher, ids, raws, "c3")

    assert batcher.flush_once(block_s=0.1) == 3

    assert outcomes == [True, True, True]  # all acked: the refused record held up nothing
    assert broker.client.llen(broker.keys.processing("default", "c3")) == 0
    assert [broker.records.get_result(i)["status"] for i in (ids[0], ids[2])] == ["SUCCESSFUL", "SUCCESSFUL"]
    assert "could not be stored" in caplog.text


def test_a_result_with_a_lone_surrogate_is_recorded_as_failed_and_its_batch_mates_succeed(broker):
    ids, raws = _claimed(broker, "c4", 3)
    batcher = AckBatcher(broker, threading.Event())
    bad = {"status": "SUCCESSFUL", "return_value": '"caf\udce9"'}
    outcomes = _ack_all(batcher, ids, raws, "c4", {ids[1]: bad})

    batcher.flush_once(block_s=0.1)

    assert outcomes == [True, True, True]
    records = [broker.records.get_result(i) for i in ids]
    assert [r["status"] for r in records] == ["SUCCESSFUL", "FAILED", "SUCCESSFUL"]
    assert "lone surrogate" in records[1]["dead_reason"] and "return_value" not in records[1]


def test_connection_errors_are_retried_until_the_batch_is_written(broker):
    ids, raws = _claimed(broker, "c5", 2)
    flaky = FlakyBroker(broker, failures=2)
    batcher = AckBatcher(flaky, threading.Event())
    outcomes = _ack_all(batcher, ids, raws, "c5")

    batcher.flush_once(block_s=0.1)

    assert flaky.calls == 3 and outcomes == [True, True]
    assert [broker.records.get_result(i)["status"] for i in ids] == ["SUCCESSFUL", "SUCCESSFUL"]


class LosesFirstReply(Broker):
    """A real broker whose first batch write Redis applies but whose reply is lost, as on a dropped connection."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker.client, broker.keys.prefix, broker.scripts)
        self.calls = 0
        real = self.queue.ack_many_reporting

        def ack_many_reporting(results, raws_by_owner, releases=None):
            self.calls += 1
            report = real(results, raws_by_owner, releases)
            if self.calls == 1:
                raise redis.exceptions.ConnectionError("connection reset by peer")
            return report

        self.queue.ack_many_reporting = ack_many_reporting


def test_a_batch_sent_again_after_its_reply_was_lost_appends_counts_and_reports_nothing_twice(broker):
    ids, raws = _claimed(broker, "c7", 2)
    minute = int(time.time()) // 60
    batcher = AckBatcher(LosesFirstReply(broker), threading.Event())
    outcomes: list[bool | None] = []
    for index, raw in enumerate(raws):
        task = decode_task(raw)
        task.attempt = 1
        fence = 10 + index
        batcher.record(records.started(task, None, "c7", 1000.5, 3, 60, fence, receipt=records.RECEIPT_OF_RECORD))  # type: ignore[arg-type]
        ending = (
            records.succeeded(task, "null", 2000.5, 60, fence, run_s=0.1)
            if index == 0
            else records.attempt_failed(task, {"exception_class_path": "E"}, 2000.5, 60, final=True, fence=fence)
        )
        batcher.ack("default", "c7", raw, ending, outcomes.append)

    batcher.flush_once(block_s=0.1)

    assert outcomes == [None, None]  # acked by the lost send: not taken for tasks recovered elsewhere
    assert broker.client.llen(broker.keys.processing("default", "c7")) == 0
    ok, failed = (broker.records.get_result(task_id) for task_id in ids)
    assert ok["status"] == "SUCCESSFUL" and ok["worker_ids"] == '["c7"]'
    assert failed["status"] == "FAILED" and failed["worker_ids"] == '["c7"]'
    assert len(json.loads(failed["errors"])) == 1
    counts = broker.inspect.minute_counts("default", [minute, minute + 1])  # the flush may fall in the next minute
    assert [sum(c.get(name, 0) for c in counts) for name in ("ok", "failed")] == [1, 1]


class RefusesBatches(Broker):
    """A real broker that drops the connection on any write of more than one ack, as Redis does
    for a batch holding a value over its proto-max-bulk-len."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        real = self.queue.ack_many_reporting

        def ack_many_reporting(results, raws_by_owner, releases=None):
            if sum(len(raws) for raws in raws_by_owner.values()) > 1:
                raise redis.exceptions.ConnectionError("connection reset by peer")
            return real(results, raws_by_owner, releases)

        self.queue.ack_many_reporting = self.queue.ack_many = ack_many_reporting


def test_a_write_failing_on_the_wire_while_redis_answers_is_isolated_not_retried_forever(broker):
    ids, raws = _claimed(broker, "c6", 2)
    give_up = threading.Event()
    batcher = AckBatcher(RefusesBatches(broker.client, broker.keys.prefix, broker.scripts), give_up)
    outcomes = _ack_all(batcher, ids, raws, "c6")

    flusher = threading.Thread(target=batcher.flush_once, args=(0.1,), daemon=True)
    flusher.start()
    flusher.join(timeout=20)
    give_up.set()

    assert not flusher.is_alive(), "the flusher retried the refused batch forever"
    assert outcomes == [True, True]  # written one by one
    assert [broker.records.get_result(i)["status"] for i in ids] == ["SUCCESSFUL", "SUCCESSFUL"]


def test_every_done_callback_is_called_even_when_writing_fails_unexpectedly(broker):
    ids, raws = _claimed(broker, "c7", 2)

    def broken(results, raws_by_owner, releases=None):
        raise TypeError("a bug")

    with_bug = Broker(broker.client, broker.keys.prefix, broker.scripts)
    with_bug.queue.ack_many_reporting = broken
    batcher = AckBatcher(with_bug, threading.Event())
    outcomes = _ack_all(batcher, ids, raws, "c7")
    written = threading.Event()
    batcher._entries.put(written)

    batcher.flush_once(block_s=0.1)

    assert outcomes == [None, None] and written.is_set()


class FailingOver(Broker):
    """A real broker on a cluster that answers PING but CLUSTERDOWN to the next `failures` batches."""

    def __init__(self, broker: Broker, failures: int) -> None:
        super().__init__(broker.client, broker.keys.prefix, broker.scripts)
        self.failures = failures
        real = self.queue.ack_many_reporting

        def ack_many_reporting(results, raws_by_owner, releases=None):
            self.failures -= 1
            if self.failures >= 0:
                raise redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down")
            return real(results, raws_by_owner, releases)

        self.queue.ack_many_reporting = ack_many_reporting
        self.inspect.serves_every_slot = lambda: self.failures <= 0


def test_a_cluster_failing_over_is_waited_out_not_taken_as_refusing_the_batch(broker):
    ids, raws = _claimed(broker, "c8", 1)
    batcher = AckBatcher(FailingOver(broker, failures=6), threading.Event())  # over two REFUSED_AFTER
    outcomes = _ack_all(batcher, ids, raws, "c8")

    batcher.flush_once(block_s=0.1)

    assert outcomes == [True]
    assert broker.records.get_result(ids[0])["status"] == "SUCCESSFUL"  # not FAILED "could not be stored"


@pytest.mark.parametrize(
    ("fields", "error", "expected"),
    [
        ({"status": "SUCCESSFUL", "return_value": '"café ☃"'}, None, True),
        ({"return_value": '"caf\udce9"'}, None, False),
        ({"a": "\ud83d", "b": "\ude00"}, None, False),  # two halves of a pair in two texts are still lone
        ({"status": "FAILED"}, {"message": "bad \udcff byte"}, False),
    ],
)
def test_an_update_is_storable_only_if_every_text_is_valid_unicode(fields, error, expected):
    assert storable(ResultUpdate("t1", fields, 60, append_error=error)) is expected
