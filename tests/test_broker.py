"""The broker's contract, against a real Redis server: claiming, acking, delays, stats and dead letters."""

import time
from pathlib import Path

import pytest

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tasks_app.protocol.enqueue import AnnouncedQueues
from tasks_app.protocol.inspection import MOVED, NOT_MOVED, DeadRequeue
from tasks_app.protocol.keys import WAKE_TOKEN, delayed_member, split_delayed_member
from tasks_app.protocol.records import ResultUpdate
from tasks_app.protocol.scripts import LUA_DIR, MisconfiguredKey
from tests.support.broker_calls import ids, make_task, push, register
from tests.support.enqueued import is_idle
from tests.support.midway import MovesMidway


def test_every_script_documents_its_keys_arguments_and_result():
    for path in Path(LUA_DIR).glob("*.lua"):
        header = path.read_text().split("\n\n")[0]
        assert "KEYS[1]" in header and "Returns" in header, f"{path.name} lacks its header"


def test_queue_keys_share_the_queue_hash_tag(broker):
    keys = broker.keys
    for key in [
        keys.pending("a.b"),
        keys.prioritized("a.b"),
        keys.delayed("a.b"),
        keys.dead("a.b"),
        keys.processing("a.b", "c1"),
        keys.consumers("a.b"),
        keys.reaped("a.b"),
        keys.recoveries("a.b"),
    ]:
        assert key.startswith(f"{keys.prefix}:{{a.b}}:")


def test_claim_takes_fifo_then_priorities_in_order(broker):
    register(broker, "c1")
    push(broker, make_task(1), make_task(2))
    push(broker, make_task(3, priority=-5), priority=-5)
    push(broker, make_task(4, priority=5), priority=5)
    push(broker, make_task(5, priority=50), priority=50)
    assert ids(broker.queue.claim("q", "c1", 10)) == ["task-5", "task-4", "task-1", "task-2", "task-3"]
    assert broker.client.llen(broker.keys.processing("q", "c1")) == 5


def test_claim_takes_no_more_than_asked(broker):
    register(broker, "c1")
    push(broker, *[make_task(n) for n in range(10)])
    assert len(broker.queue.claim("q", "c1", 3)) == 3
    assert broker.client.llen(broker.keys.pending("q")) == 7


@pytest.mark.parametrize("priority", [0, 5])
def test_a_claim_meeting_a_processing_list_of_the_wrong_type_names_it_and_moves_nothing(broker, priority):
    register(broker, "c1")
    task = make_task(1, priority=priority)
    push(broker, task, priority=priority)
    processing = broker.keys.processing("q", "c1")
    broker.client.hset(processing, "not", "a list")
    with pytest.raises(MisconfiguredKey, match=rf"script claim .*{processing} \(hash\)") as raised:
        broker.queue.claim("q", "c1", 5)
    assert f"{broker.keys.pending('q')} (" in str(raised.value)  # every key is named with its type
    pending, prioritized = broker.keys.pending("q"), broker.keys.prioritized("q")
    waits = task in broker.client.lrange(pending, 0, -1) or broker.client.zscore(prioritized, task) is not None
    assert waits, "the task still waits where it was"


def test_claim_without_a_lease_takes_nothing(broker):
    push(broker, make_task(1))
    assert broker.queue.claim("q", "ghost", 5) is None
    assert broker.client.llen(broker.keys.pending("q")) == 1


def test_prioritized_enqueue_wakes_a_blocked_claim_and_the_token_is_dropped(broker):
    register(broker, "c1")
    push(broker, make_task(1, priority=3), priority=3)
    assert broker.queue.claim_blocking("q", "c1", 1, 60) == (WAKE_TOKEN, 0, None, False)
    assert ids(broker.queue.claim("q", "c1", 5, drop_wake=True)) == ["task-1"]
    assert broker.client.lrange(broker.keys.processing("q", "c1"), 0, -1) == [make_task(1, priority=3)]


def test_ack_only_finishes_tasks_this_consumer_holds(broker):
    register(broker, "c1")
    register(broker, "c2")
    push(broker, make_task(1), make_task(2))
    [first] = broker.queue.claim("q", "c1", 1)
    [second] = broker.queue.claim("q", "c2", 1)
    assert broker.queue.ack("q", "c1", [first, second]) == [True, False]
    assert broker.client.lrange(broker.keys.processing("q", "c2"), 0, -1) == [second]


def test_retry_later_moves_to_delayed_and_promotion_waits_for_the_due_time(broker):
    register(broker, "c1", lease_ms=5000)  # claims again after the delay: only under a live lease
    push(broker, make_task(1, priority=7), priority=7)
    [raw] = broker.queue.claim("q", "c1", 1)
    assert broker.queue.retry_later("q", "c1", raw, raw, 7, 300) is True
    assert broker.queue.promote_due("q")[0] == 0
    [(member, _)] = broker.client.zrange(broker.keys.delayed("q"), 0, -1, withscores=True)
    assert split_delayed_member(member) == (7, raw)
    time.sleep(0.35)
    assert broker.queue.promote_due("q")[0] == 1
    assert ids(broker.queue.claim("q", "c1", 5, drop_wake=True)) == ["task-1"]


def test_retry_later_with_a_delay_that_is_not_a_number_makes_the_task_due_now(broker):
    register(broker, "c1")
    push(broker, make_task(1))
    [raw] = broker.queue.claim("q", "c1", 1)
    keys = [broker.keys.processing("q", "c1"), broker.keys.delayed("q"), broker.keys.recoveries("q")]
    assert broker.scripts.run(broker.client, "retry_later", keys, [raw, delayed_member(0, raw), "soon"]) == 1
    [(_, due_ms)] = broker.client.zrange(broker.keys.delayed("q"), 0, -1, withscores=True)
    assert abs(due_ms - broker.inspect.server_time_ms()) < 5_000
    assert broker.queue.held_by("q", "c1") == []


def test_promotion_reports_the_next_due_time(broker):
    now_ms = broker.inspect.server_time_ms()
    push(broker, make_task(1), delay_ms=60_000)
    moved, next_due_ms, server_now_ms, malformed = broker.queue.promote_due("q")
    assert (moved, malformed) == (0, 0)
    assert 0 <= next_due_ms - (now_ms + 60_000) < 5_000
    assert abs(server_now_ms - now_ms) < 5_000


def test_delayed_members_keep_their_priority():
    assert split_delayed_member(delayed_member(-100, b"x")) == (-100, b"x")
    assert split_delayed_member(delayed_member(5, b"\x00")) == (5, b"\x00")


def test_return_unstarted_puts_tasks_back_at_the_head_in_order(broker):
    register(broker, "c1")
    push(broker, *[make_task(n) for n in range(4)])
    claimed = broker.queue.claim("q", "c1", 4)
    assert broker.queue.return_unstarted("q", "c1", claimed[2:]) == 2
    push(broker, make_task(99))
    assert ids(broker.queue.claim("q", "c1", 3)) == ["task-2", "task-3", "task-99"]


@pytest.mark.parametrize("leave", ["return_unstarted", "deregister"])
def test_returned_tasks_go_back_where_their_priority_puts_them(broker, leave):
    """A priority -50 task returned must not run before newer priority-0 ones, nor a +50 one after newer +1 ones."""
    register(broker, "c1", lease_ms=60_000)
    low, high, same = make_task(1, priority=-50), make_task(2, priority=50), make_task(3, priority=50)
    push(broker, low, priority=-50)
    push(broker, high, priority=50)
    held = broker.queue.claim("q", "c1", 2)
    push(broker, make_task(4), make_task(5))
    push(broker, make_task(6, priority=1), priority=1)
    push(broker, same, priority=50)  # enqueued after `high`: it stays behind it
    if leave == "return_unstarted":
        assert broker.queue.return_unstarted("q", "c1", held) == 2
    else:
        assert broker.leases.deregister("q", "c1") == 2
        register(broker, "c1", lease_ms=60_000)
    order = ids(broker.queue.claim("q", "c1", 10))
    assert order == ["task-2", "task-3", "task-6", "task-4", "task-5", "task-1"]


def test_a_returned_task_goes_first_among_its_priority_in_the_order_given(broker):
    register(broker, "c1", lease_ms=60_000)
    push(broker, *[make_task(n, priority=5) for n in range(3)], priority=5)
    claimed = broker.queue.claim("q", "c1", 3)
    push(broker, make_task(7, priority=5), priority=5)
    assert broker.queue.return_unstarted("q", "c1", claimed) == 3
    assert ids(broker.queue.claim("q", "c1", 10)) == ["task-0", "task-1", "task-2", "task-7"]


@pytest.mark.parametrize("leave", ["return_unstarted", "deregister"])
def test_a_prioritized_task_returned_to_an_empty_queue_wakes_a_blocked_claim(broker, leave):
    register(broker, "c1", lease_ms=60_000)
    push(broker, make_task(1, priority=3), priority=3)
    held = broker.queue.claim("q", "c1", 1)
    assert broker.client.rpop(broker.keys.pending("q")) == WAKE_TOKEN  # the enqueue's, taken by a claim
    if leave == "return_unstarted":
        broker.queue.return_unstarted("q", "c1", held)
    else:
        broker.leases.deregister("q", "c1")
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [WAKE_TOKEN]
    assert broker.client.zrange(broker.keys.prioritized("q"), 0, -1) == held


@pytest.mark.parametrize(
    "raw",
    [
        b"not a task",  # field 13, wire type 6: not protobuf
        b"\x28\x32\x0a\x05ab",  # priority 50, then a string field cut short
        b"\x28\x32\x08",  # priority 50, then a varint that never ends
        b"\x28\x32\x0b\x08\x01",  # priority 50, then a group that never ends
        b"\x28\x32\x0b\x0c\x0c",  # priority 50, then a group ended twice
        b"\x00wake",
    ],
)
def test_returned_bytes_that_are_not_a_task_go_back_to_the_head_of_pending(broker, raw):
    register(broker, "c1", lease_ms=60_000)
    broker.client.rpush(broker.keys.processing("q", "c1"), raw)
    push(broker, make_task(1))
    assert broker.queue.return_unstarted("q", "c1", [raw]) == 1
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [make_task(1), raw]
    assert broker.client.zcard(broker.keys.prioritized("q")) == 0


@pytest.mark.parametrize(
    ("priority", "encoded"),
    [
        (-7, Task(id="t", priority=-7).SerializeToString()),  # a ten-byte varint
        (100, Task(id="t", priority=250).SerializeToString()),  # clamped, as the producer's range
        (-3, Task(id="t", priority=9).SerializeToString() + b"\x28\xfd\xff\xff\xff\x0f"),  # the last one wins
        (0, Task(id="t").SerializeToString() + b"\x2a\x01\x05"),  # field 5 with another wire type is not it
        (50, b"\x28\x32\x0b\x08\x01\x13\x14\x0c"),  # groups (nested) are unknown fields
        (9, Task(id="t", priority=9, payload=b"x" * 300, headers={"a": "b"}).SerializeToString() + b"\x6d1234"),
    ],
)
def test_a_returned_task_s_priority_is_read_from_its_envelope(broker, priority, encoded):
    register(broker, "c1", lease_ms=60_000)
    broker.client.rpush(broker.keys.processing("q", "c1"), encoded)
    assert broker.queue.return_unstarted("q", "c1", [encoded]) == 1
    scores = broker.client.zrange(broker.keys.prioritized("q"), 0, -1, withscores=True)
    if priority == 0:
        assert scores == [] and broker.client.lrange(broker.keys.pending("q"), 0, -1) == [encoded]
    else:
        [(member, score)] = scores
        assert member == encoded and int(score) >> 42 == 100 - priority


def test_deregister_returns_what_is_held_and_drops_the_lease(broker):
    register(broker, "c1")
    push(broker, make_task(1))
    broker.queue.claim("q", "c1", 1)
    assert broker.leases.deregister("q", "c1") == 1
    assert broker.inspect.queue_stats("q").consumers == []
    assert broker.client.llen(broker.keys.pending("q")) == 1


def test_queue_stats_and_idleness(broker):
    register(broker, "c1")
    push(broker, make_task(1), make_task(2))
    push(broker, make_task(3, priority=1), priority=1)
    push(broker, make_task(4), delay_ms=60_000)
    broker.queue.claim("q", "c1", 1, drop_wake=True)
    stats = broker.inspect.queue_stats("q")
    assert (stats.pending, stats.processing, stats.delayed, stats.dead) == (2, 1, 1, 0)
    assert [c["id"] for c in stats.consumers] == ["c1"]
    assert stats.consumers[0]["in_flight"] == 1
    assert not is_idle(broker, ["q"])
    assert broker.inspect.known_queues() == ["q"]


# A task's moves as the consumer makes them: (from, to).
TRANSITS = {"claim": ("pending", "processing"), "retry": ("processing", "delayed"), "promotion": ("delayed", "pending")}


def _put(broker, queue: str, place: str, raw: bytes) -> None:
    if place == "delayed":
        broker.client.zadd(broker.keys.delayed(queue), {delayed_member(0, raw): 0})
    else:
        key = broker.keys.pending(queue) if place == "pending" else broker.keys.processing(queue, "c1")
        broker.client.rpush(key, raw)


def _take(broker, queue: str, place: str, raw: bytes) -> None:
    if place == "delayed":
        broker.client.zrem(broker.keys.delayed(queue), delayed_member(0, raw))
    else:
        key = broker.keys.pending(queue) if place == "pending" else broker.keys.processing(queue, "c1")
        broker.client.lrem(key, 1, raw)


@pytest.mark.parametrize("transit", TRANSITS)
def test_stats_count_a_task_once_and_see_the_queue_busy_whenever_it_moves_during_the_read(broker, transit):
    origin, destination = TRANSITS[transit]
    raw = make_task(1)
    for before in range(8):  # more round trips than a read makes: the last ones see no move
        for read in ("stats", "idle"):
            queue = f"q-{read}-{before}"
            register(broker, "c1", lease_ms=60_000, queues=[queue])
            _put(broker, queue, origin, raw)

            def move(queue: str = queue) -> None:
                _take(broker, queue, origin, raw)
                _put(broker, queue, destination, raw)

            reader = Broker(MovesMidway(broker.client, move, before), broker.keys.prefix)
            if read == "stats":
                stats = reader.inspect.queue_stats(queue)
                assert stats.pending + stats.processing + stats.delayed == 1, f"moved before round trip {before}"
            else:
                assert not is_idle(reader, [queue]), f"moved before round trip {before}"


def test_dead_letters_can_be_listed_requeued_and_deleted(broker):
    register(broker, "c1")
    push(broker, make_task(1), make_task(2))
    first, second = broker.queue.claim("q", "c1", 2)
    broker.queue.dead_letter("q", "c1", first, first)
    broker.queue.dead_letter("q", "c1", second, second)
    assert {raw for raw, _ in broker.inspect.list_dead("q")} == {first, second}
    entry = DeadRequeue(first, 0, first, "t1", ResultUpdate("t1", {"status": "READY"}, 60))
    assert broker.inspect.requeue_dead("q", [entry], broker.queue.issue_fence("q")) == [MOVED]
    assert broker.inspect.requeue_dead("q", [entry], broker.queue.issue_fence("q")) == [NOT_MOVED]
    assert broker.inspect.delete_dead_tasks("q", broker.inspect.list_dead_tasks("q")) == 1
    assert broker.inspect.list_dead("q") == []
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [first]


@pytest.mark.parametrize("priority", [1, -1])
def test_non_zero_priority_tasks_count_as_pending(broker, priority):
    push(broker, make_task(1, priority=priority), priority=priority)
    assert broker.inspect.queue_stats("q").pending == 1


def test_a_late_outcome_of_an_earlier_run_cannot_overwrite_a_later_run(broker):
    from tasks_app.protocol import records
    from tasks_app.protocol.codec import Arguments

    task = Task(id="rerun-1", type="demo.echo", queue="q", attempt=1)
    args = Arguments([], {})
    first, second = broker.queue.issue_fence("q"), broker.queue.issue_fence("q")
    broker.records.record_result(records.started(task, args, "c1", 1, 3, 60, first))
    broker.records.record_result(records.started(task, args, "c2", 2, 3, 60, second))  # c1 was presumed dead
    broker.records.record_result(records.succeeded(task, '"from c1"', 3, 60, first))
    assert broker.records.get_result("rerun-1")["status"] == "RUNNING"
    broker.records.record_result(records.succeeded(task, '"from c2"', 4, 60, second))
    record = broker.records.get_result("rerun-1")
    assert (record["status"], record["return_value"]) == ("SUCCESSFUL", '"from c2"')


@pytest.mark.parametrize("tasks_per_call", [1, 3])
def test_a_producer_lists_its_queue_again_a_while_after_the_queue_set_was_deleted(broker, tasks_per_call):
    now = [1000.0]
    broker.enqueuer.announced = AnnouncedQueues(again_s=60.0, clock=lambda: now[0])
    push(broker, make_task(1))
    assert broker.inspect.known_queues() == ["q"]
    broker.client.delete(broker.keys.queues())
    push(broker, *[make_task(n) for n in range(2, 2 + tasks_per_call)])
    assert broker.inspect.known_queues() == []  # trusted for a while: one SADD per queue a minute, not per enqueue
    now[0] += 61.0
    push(broker, *[make_task(n) for n in range(10, 10 + tasks_per_call)])
    assert broker.inspect.known_queues() == ["q"]
    assert broker.client.llen(broker.keys.pending("q")) == 1 + 2 * tasks_per_call
