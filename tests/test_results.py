"""Result records: fenced writes against real Redis, storable error text, the result size cap."""

import json

import pytest

from tasks_app.exceptions import ResultNotJson, ResultTooLarge
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Arguments, Task, encode_task
from tasks_app.protocol.enqueue import Enqueueable

ARGS = Arguments([], {})
LATIN1 = b"caf\xe9".decode("utf-8", "surrogateescape")


def claim_twice(broker: Broker) -> tuple[Task, int, int]:
    """Claim a task as c1, let c1 be presumed dead and reaped, claim it again as c2: both tokens."""
    task = Task(id="fenced-1", type="demo.echo", queue="q")
    broker.enqueuer.enqueue([Enqueueable(queue="q", raw=encode_task(task))], result_ttl_s=60)
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    first = broker.queue.claim_with_suspect("q", "c1", 1)
    broker.client.zadd(broker.keys.consumers("q"), {"c1": 0})  # c1's lease lapses
    assert broker.leases.reap("q", "c1", 10_000).requeued == 1
    broker.leases.heartbeat(["q"], "c2", 10_000, {"lease_ms": 10_000})
    second = broker.queue.claim_with_suspect("q", "c2", 1)
    assert second.took_suspect and second.tasks == first.tasks
    return task, first.first_fence, second.first_fence


def test_a_late_running_write_of_a_presumed_dead_run_cannot_override_the_reruns_success(broker):
    task, old, new = claim_twice(broker)
    assert new > old > 0
    task.attempt = 1
    assert broker.records.record_result(records.started(task, ARGS, "c1", 1, 3, 60, old))
    assert broker.records.record_result(records.started(task, ARGS, "c2", 2, 3, 60, new))
    assert broker.records.record_result(records.succeeded(task, '"from c2"', 3, 60, new))

    # c1 was only frozen: it writes RUNNING (as its batcher flushes late), then its own failure.
    assert not broker.records.record_result(records.started(task, ARGS, "c1", 4, 3, 60, old))
    error = records.error_record("builtins.RuntimeError", "late")
    assert not broker.records.record_result(
        records.attempt_failed(task, error, 5, 60, final=True, dead_reason="x", fence=old)
    )

    record = broker.records.get_result(task.id)
    assert (record["status"], record["return_value"], record["finished_at_ms"]) == ("SUCCESSFUL", '"from c2"', "3")
    assert record["worker_ids"] == '["c1","c2"]' and "errors" not in record


def test_a_rerun_after_its_receipt_is_a_new_write_and_a_write_sent_twice_appends_once(broker):
    task, old, new = claim_twice(broker)
    task.attempt = 1
    assert broker.records.record_result(records.started(task, ARGS, "c1", 1, 3, 60, old)) == 1  # c1 dies RUNNING
    assert broker.queue.claim_receipts([(task.id, new)], 60) == [1]  # the record now holds c2's token
    task.attempt = 2
    rerun = records.started(task, ARGS, "c2", 2, 3, 60, new)
    assert broker.records.record_result(rerun) == 1  # RUNNING again, same token: still c2's first write
    assert broker.records.record_result(rerun) == 4  # sent again after a lost reply
    error = records.error_record("builtins.RuntimeError", "boom")
    failure = records.attempt_failed(task, error, 3, 60, final=True, fence=new)
    assert [broker.records.record_result(failure), broker.records.record_result(failure)] == [1, 4]

    record = broker.records.get_result(task.id)
    assert record["worker_ids"] == '["c1","c2"]' and len(json.loads(record["errors"])) == 1


def test_a_later_token_takes_the_record_over_and_tokens_survive_a_lost_counter(broker):
    task = Task(id="fenced-2", type="demo.echo", queue="q", attempt=1)
    first = broker.queue.issue_fence("q")
    assert broker.records.record_result(records.succeeded(task, '"one"', 1, 60, first))
    broker.client.delete(broker.keys.fence("q"))  # a restart without persistence
    later = broker.queue.issue_fence("q")
    assert later > first
    assert broker.records.record_result(
        records.attempt_failed(task, records.error_record("E", "t"), 2, 60, final=False, retry_at_ms=9, fence=later)
    )
    assert broker.records.get_result(task.id)["status"] == "READY"


def test_the_record_script_survives_malformed_fields_left_by_a_foreign_writer(broker):
    key = broker.keys.result("foreign-1")
    broker.client.hset(key, mapping={"fence": "not a number", "worker_ids": "{oops", "errors": "[1,"})
    task = Task(id="foreign-1", type="demo.echo", queue="q", attempt=1)
    assert broker.records.record_result(
        records.attempt_failed(
            task, records.error_record("E", "tb"), 1, 60, final=True, fence=broker.queue.issue_fence("q")
        )
    )
    assert json.loads(broker.records.get_result("foreign-1")["errors"]) == [
        {"exception_class_path": "E", "traceback": "tb"}
    ]


def test_error_text_is_made_storable_and_capped():
    assert records.clean_text("cannot open " + LATIN1, 100) == "cannot open caf\\udce9"
    cut = records.clean_text("é" * 1000, 64)
    assert len(cut.encode()) <= 64 and cut.endswith(records.TRUNCATED_MARK)
    assert records.clean_text("plain", 100) == "plain"


def test_a_return_value_is_stored_only_if_it_is_utf8_json_within_the_cap():
    assert records.result_json({"a": [1, "é"]}, 100) == '{"a":[1,"é"]}'
    with pytest.raises(ResultNotJson, match="lone surrogate"):
        records.result_json(LATIN1, 100)
    with pytest.raises(ResultNotJson, match="not JSON-serializable"):
        records.result_json(float("nan"), 100)
    with pytest.raises(ResultTooLarge, match="TASKS_MAX_RESULT_BYTES"):
        records.result_json("x" * 200, 100)


def test_arguments_with_lone_surrogates_are_escaped_in_records():
    task = Task(id="t", type="demo.echo", queue="q")
    fields = records.enqueued_fields(task, Arguments(["\ud800"], {}))
    assert fields["args"] == r'["\ud800"]'
    fields["args"].encode("utf-8")


@pytest.mark.parametrize("final", [False, True], ids=["retry", "dead-letter"])
def test_a_run_that_lost_its_task_writes_no_record_when_it_retries_or_dead_letters(broker, final):
    task = Task(id="lost-1", type="demo.echo", queue="q", attempt=1)
    raw = encode_task(task)
    broker.enqueuer.enqueue([Enqueueable(queue="q", raw=raw)], result_ttl_s=60)
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    fence = broker.queue.claim_with_suspect("q", "c1", 1).first_fence
    assert broker.records.record_result(records.started(task, ARGS, "c1", 1, 3, 60, fence)) == 1
    broker.client.zadd(broker.keys.consumers("q"), {"c1": 0})  # c1 froze: its lease lapses
    assert broker.leases.reap("q", "c1", 10_000).requeued == 1  # the task waits as a suspect, unclaimed yet

    # c1 wakes and settles its failure; no other claim has written to the record yet.
    error = records.error_record("builtins.RuntimeError", "late")
    failure = records.attempt_failed(task, error, 5, 60, final=final, retry_at_ms=9, dead_reason="x", fence=fence)
    if final:
        assert broker.queue.dead_letter("q", "c1", raw, raw, failure) is False
    else:
        assert broker.queue.retry_later("q", "c1", raw, raw, 0, 1000, failure) is False

    record = broker.records.get_result(task.id)
    assert (record["status"], record["last_attempted_at_ms"], record["fence"]) == ("RUNNING", "1", str(fence))
    assert "errors" not in record and "dead_reason" not in record and "run_after_ms" not in record
    assert broker.client.zcard(broker.keys.delayed("q")) == broker.client.zcard(broker.keys.dead("q")) == 0
    assert broker.client.zscore(broker.keys.history_status("q", "RUNNING"), task.id) is not None
