"""Dead letters against real Redis: capped by count and age, requeued with their priority."""

from unittest.mock import patch

import pytest
import redis

from tasks_app.consumer.loops import SchedulerLoop
from tasks_app.protocol import inspection
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.inspection import Requeued, UniqueWindow
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.records import ResultUpdate
from tests.support.broker_calls import deleted_before_the_move

pytestmark = pytest.mark.django_db

DAY_MS = 86400 * 1000


def bury(broker, n: int, died_ms: int, priority: int = 0, queue: str = "q", **fields: str) -> bytes:
    raw = encode_task(
        Task(
            id=f"dead-{n}",
            type=fields.pop("type", "demo.echo"),
            queue=queue,
            priority=priority,
            attempt=3,
            dead_reason="failed 3 of 3 attempts",
            **fields,
        )
    )
    broker.client.zadd(broker.keys.dead(queue), {raw: died_ms})
    return raw


def dead_ids(broker, queue: str = "q") -> list[str]:
    return [decode_task(member).id for member, _ in broker.inspect.list_dead(queue, limit=1000)]


def test_the_scheduler_keeps_only_the_newest_dead_letters(broker, settings):
    now_ms = broker.inspect.server_time_ms()
    for n in range(30):
        bury(broker, n, now_ms - (30 - n) * 1000)
    settings.TASKS_DEAD_LETTER_MAX, settings.TASKS_DEAD_LETTER_MAX_AGE_S = 10, 30 * 86400
    loop = SchedulerLoop(broker, ["q"])
    loop.run_once()
    assert dead_ids(broker) == [f"dead-{n}" for n in range(29, 19, -1)]


def test_the_scheduler_drops_dead_letters_older_than_the_age_cap(broker, settings):
    now_ms = broker.inspect.server_time_ms()
    for n, age_days in enumerate([400, 200, 181, 179, 10, 0]):
        bury(broker, n, now_ms - age_days * DAY_MS)
    settings.TASKS_DEAD_LETTER_MAX, settings.TASKS_DEAD_LETTER_MAX_AGE_S = 10_000, 180 * 86400
    loop = SchedulerLoop(broker, ["q"])
    assert loop.trim_dead_letters() == 3
    assert sorted(dead_ids(broker)) == ["dead-3", "dead-4", "dead-5"]


def test_the_caps_come_from_settings(broker, settings):
    settings.TASKS_DEAD_LETTER_MAX = 2
    now_ms = broker.inspect.server_time_ms()
    for n in range(5):
        bury(broker, n, now_ms - n)
    SchedulerLoop(broker, ["q"]).run_once()
    assert sorted(dead_ids(broker)) == ["dead-0", "dead-1"]


def test_trimming_nothing_leaves_every_dead_letter(broker):
    now_ms = broker.inspect.server_time_ms()
    for n in range(5):
        bury(broker, n, now_ms - n * DAY_MS)
    assert broker.inspect.trim_dead("q", 5, 180 * 86400) == 0
    assert len(dead_ids(broker)) == 5


def test_a_requeued_dead_letter_keeps_its_priority_and_wakes_a_consumer(broker):
    bury(broker, 1, broker.inspect.server_time_ms(), priority=7)
    bury(broker, 2, broker.inspect.server_time_ms(), priority=0)
    moved = broker.inspect.requeue_dead_tasks("q", broker.inspect.list_dead_tasks("q")).moved
    assert len(moved) == 2
    [prioritized] = broker.client.zrange(broker.keys.prioritized("q"), 0, -1)
    fresh = decode_task(prioritized)
    assert (fresh.id, fresh.priority, fresh.attempt, fresh.dead_reason) == ("dead-1", 7, 0, "")
    [plain] = broker.client.lrange(broker.keys.pending("q"), 0, -1)
    assert decode_task(plain).id == "dead-2"
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    assert [decode_task(raw).id for raw in broker.queue.claim("q", "c1", 5)] == ["dead-1", "dead-2"]
    assert broker.records.get_result("dead-1")["priority"] == "7"


def test_requeueing_a_prioritized_dead_letter_alone_leaves_a_wake_token(broker):
    bury(broker, 1, broker.inspect.server_time_ms(), priority=-20)
    broker.inspect.requeue_dead_tasks("q", broker.inspect.list_dead_tasks("q"))
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [WAKE_TOKEN]
    assert broker.client.zcard(broker.keys.prioritized("q")) == 1


def test_a_second_operator_requeueing_the_same_page_changes_nothing(broker):
    """Two tabs (or operators) showing the same dead letter: the later click finds it gone and writes nothing."""
    bury(broker, 1, broker.inspect.server_time_ms())
    seen_by_both = broker.inspect.list_dead_tasks("q")
    assert [dead.task_id for dead in broker.inspect.requeue_dead_tasks("q", seen_by_both).moved] == ["dead-1"]
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    claim = broker.queue.claim_with_suspect("q", "c1", 1, allow_suspect=False)
    [raw] = claim.tasks
    done = ResultUpdate("dead-1", {"status": "SUCCESSFUL", "attempts": "1"}, 60, fence=claim.first_fence)
    assert broker.queue.ack("q", "c1", [raw], [done]) == [True]
    broker.client.zadd(broker.keys.cancel_requests("q"), {"dead-1": 1})  # as if asked of a run meanwhile

    assert broker.inspect.requeue_dead_tasks("q", seen_by_both) == ([], [])
    assert broker.records.get_result("dead-1")["status"] == "SUCCESSFUL"
    assert broker.client.zscore(broker.keys.cancel_requests("q"), "dead-1") == 1
    stats = broker.inspect.queue_stats("q")
    assert (stats.pending, stats.dead) == (0, 0)


def test_a_requeued_dead_letter_whose_last_run_was_asked_to_cancel_runs_when_claimed_at_once(broker, monkeypatch):
    """An idle consumer blocked on pending takes the task as it is pushed: its receipt must not see the old cancel."""
    bury(broker, 1, broker.inspect.server_time_ms())
    broker.records.record_result(
        ResultUpdate("dead-1", {"status": "FAILED", "cancel_requested_at_ms": "1"}, 60, fence=1)
    )
    broker.leases.heartbeat(["q"], "c1", 10_000, {"lease_ms": 10_000})
    receipts: list[int] = []
    push = broker.inspect.requeue_dead

    def push_and_claim_at_once(queue, entries, fence):
        moved = push(queue, entries, fence)
        claim = broker.queue.claim_with_suspect("q", "c1", 1, allow_suspect=False)
        receipts.extend(broker.queue.claim_receipts([("dead-1", claim.first_fence)], 60))
        return moved

    monkeypatch.setattr(broker.inspect, "requeue_dead", push_and_claim_at_once)
    assert len(broker.inspect.requeue_dead_tasks("q", broker.inspect.list_dead_tasks("q")).moved) == 1
    assert receipts == [1]
    assert broker.records.get_result("dead-1")["status"] == "READY"


def test_a_record_redis_refuses_stops_no_other_requeue(broker, caplog):
    """One task's record key of a foreign type: the others are requeued with their READY records, and it too."""
    for n in (1, 2, 3):
        bury(broker, n, broker.inspect.server_time_ms())
        broker.records.record_result(ResultUpdate(f"dead-{n}", {"status": "FAILED"}, 60, fence=1))
    broker.client.delete(broker.keys.result("dead-2"))
    broker.client.set(broker.keys.result("dead-2"), "a foreign writer's")
    moved = broker.inspect.requeue_dead_tasks("q", broker.inspect.list_dead_tasks("q")).moved
    assert sorted(dead.task_id for dead in moved) == ["dead-1", "dead-2", "dead-3"]
    assert broker.inspect.queue_stats("q").dead == 0
    assert sorted(decode_task(raw).id for raw in broker.client.lrange(broker.keys.pending("q"), 0, -1)) == [
        "dead-1",
        "dead-2",
        "dead-3",
    ]
    assert [broker.records.get_result(f"dead-{n}")["status"] for n in (1, 3)] == ["READY", "READY"]
    assert broker.records.history_count(["q"], "READY", None) == 2
    assert "dead-2 without its READY record" in caplog.text


def test_a_task_no_longer_dead_when_the_requeue_moves_keeps_its_record(broker, monkeypatch):
    """Another operator deletes one dead letter while this requeue is under way: its record stays as it was."""
    for n in (1, 2):
        bury(broker, n, broker.inspect.server_time_ms())
        broker.records.record_result(ResultUpdate(f"dead-{n}", {"status": "FAILED"}, 60, fence=1))
    shown = broker.inspect.list_dead_tasks("q")
    deleted_before_the_move(monkeypatch, broker, "q", "dead-2", shown)
    assert [dead.task_id for dead in broker.inspect.requeue_dead_tasks("q", shown).moved] == ["dead-1"]
    assert broker.records.get_result("dead-1")["status"] == "READY"
    record = broker.records.get_result("dead-2")
    assert (record["status"], record["fence"]) == ("FAILED", "1")
    assert [decode_task(raw).id for raw in broker.client.lrange(broker.keys.pending("q"), 0, -1)] == ["dead-1"]


# The uniqueness windows a caller that reads the task types passes: uniq.echo is unique, demo.echo not.
WINDOWS = {"uniq.echo": UniqueWindow(600_000, until_finished=True)}


def requeue_all(broker, windows=WINDOWS) -> Requeued:
    return broker.inspect.requeue_dead_tasks("q", broker.inspect.list_dead_tasks("q"), windows)


def test_a_unique_types_dead_letter_stays_dead_while_another_task_holds_its_key(broker):
    """Beside it a free key's task and one of a type not unique (its envelope naming a held key) are requeued."""
    now_ms = broker.inspect.server_time_ms()
    bury(broker, 1, now_ms - 2, type="uniq.echo", unique_digest="held")
    bury(broker, 2, now_ms - 1, type="uniq.echo", unique_digest="free")
    bury(broker, 3, now_ms, unique_digest="held")
    broker.client.set(broker.keys.unique("q", "held"), "other", px=60_000)
    outcome = requeue_all(broker)
    assert sorted(dead.task_id for dead in outcome.moved) == ["dead-2", "dead-3"]
    assert [(dead.task_id, holder) for dead, holder in outcome.held] == [("dead-1", "other")]
    assert dead_ids(broker) == ["dead-1"] and broker.records.get_result("dead-1") is None  # nothing written for it
    assert broker.client.get(broker.keys.unique("q", "held")) == b"other"
    assert broker.client.get(broker.keys.unique("q", "free")) == b"dead-2"
    assert 590_000 < broker.client.pttl(broker.keys.unique("q", "free")) <= 600_000
    assert broker.records.get_result("dead-2")["unique_digest"] == "free"


def test_a_requeue_takes_a_key_its_own_task_still_holds_for_a_new_window(broker):
    """unique_until = window: the dead task's key lives on; requeued, its new run holds it for a whole window."""
    bury(broker, 1, broker.inspect.server_time_ms(), type="uniq.echo", unique_digest="d")
    broker.client.set(broker.keys.unique("q", "d"), "dead-1", px=5_000)
    outcome = requeue_all(broker, {"uniq.echo": UniqueWindow(600_000, until_finished=False)})
    assert [dead.task_id for dead in outcome.moved] == ["dead-1"] and outcome.held == []
    assert broker.client.pttl(broker.keys.unique("q", "d")) > 590_000
    assert broker.records.get_result("dead-1")["unique_digest"] == ""  # its window, not its end, frees it


def test_a_uniqueness_key_of_another_type_stops_the_requeue_before_any_write(broker):
    bury(broker, 1, broker.inspect.server_time_ms())
    bury(broker, 2, broker.inspect.server_time_ms(), type="uniq.echo", unique_digest="d")
    broker.client.rpush(broker.keys.unique("q", "d"), "a foreign writer's")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        requeue_all(broker)
    assert sorted(dead_ids(broker)) == ["dead-1", "dead-2"] and broker.inspect.queue_stats("q").pending == 0


def test_a_set_far_over_its_caps_is_trimmed_in_bounded_calls(broker):
    """Lowering the cap under a huge set must not run one script that holds Redis for seconds."""
    now_ms = broker.inspect.server_time_ms()
    for n in range(25):
        bury(broker, n, now_ms - (40 - n) * DAY_MS)  # the first 5 are older than 35 days
    one_call = broker.scripts.run(broker.client, "trim_dead", [broker.keys.dead("q")], [5, 35 * 86400_000, 10])
    assert one_call == 10
    assert sorted(dead_ids(broker)) == sorted(f"dead-{n}" for n in range(10, 25))
    with patch.object(inspection, "TRIM_BATCH", 4):
        assert broker.inspect.trim_dead("q", 5, 35 * 86400) == 10
    assert sorted(dead_ids(broker)) == sorted(f"dead-{n}" for n in range(20, 25))
