"""The broker's contract, against a real Redis server."""

import threading
import time
from pathlib import Path

import pytest

from tasks_app.protocol.broker import Enqueueable
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.keys import WAKE_TOKEN, delayed_member, split_delayed_member
from tasks_app.protocol.leases import MAX_RECOVERIES
from tasks_app.protocol.scripts import LUA_DIR

LEASE_MS = 200


def make_task(n: int, priority: int = 0, queue: str = "q") -> bytes:
    return encode_task(Task(id=f"task-{n}", type="demo.echo", queue=queue, priority=priority))


def ids(raws):
    return [decode_task(raw).id for raw in raws]


def register(broker, consumer_id: str, lease_ms: int = LEASE_MS, queues=("q",)) -> None:
    broker.heartbeat(list(queues), consumer_id, lease_ms, {"lease_ms": lease_ms})


def push(broker, *raws, queue="q", priority=0, delay_ms=0):
    broker.enqueue(
        [Enqueueable(queue=queue, raw=raw, priority=priority, delay_ms=delay_ms) for raw in raws], result_ttl_s=60
    )


def expire(broker, consumer_id: str, queue: str = "q") -> None:
    """Let a lease lapse without waiting for it."""
    broker.client.zadd(broker.keys.consumers(queue), {consumer_id: 0})


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
    assert ids(broker.claim("q", "c1", 10)) == ["task-5", "task-4", "task-1", "task-2", "task-3"]
    assert broker.client.llen(broker.keys.processing("q", "c1")) == 5


def test_claim_takes_no_more_than_asked(broker):
    register(broker, "c1")
    push(broker, *[make_task(n) for n in range(10)])
    assert len(broker.claim("q", "c1", 3)) == 3
    assert broker.client.llen(broker.keys.pending("q")) == 7


def test_claim_without_a_lease_takes_nothing(broker):
    push(broker, make_task(1))
    assert broker.claim("q", "ghost", 5) is None
    assert broker.client.llen(broker.keys.pending("q")) == 1


def test_prioritized_enqueue_wakes_a_blocked_claim_and_the_token_is_dropped(broker):
    register(broker, "c1")
    push(broker, make_task(1, priority=3), priority=3)
    assert broker.claim_blocking("q", "c1", 1) == (WAKE_TOKEN, 0)
    assert ids(broker.claim("q", "c1", 5, drop_wake=True)) == ["task-1"]
    assert broker.client.lrange(broker.keys.processing("q", "c1"), 0, -1) == [make_task(1, priority=3)]


def test_ack_only_finishes_tasks_this_consumer_holds(broker):
    register(broker, "c1")
    register(broker, "c2")
    push(broker, make_task(1), make_task(2))
    [first] = broker.claim("q", "c1", 1)
    [second] = broker.claim("q", "c2", 1)
    assert broker.ack("q", "c1", [first, second]) == [True, False]
    assert broker.client.lrange(broker.keys.processing("q", "c2"), 0, -1) == [second]


def test_reaper_never_touches_a_live_lease(broker):
    register(broker, "c1", lease_ms=60_000)
    push(broker, make_task(1))
    broker.claim("q", "c1", 1)
    outcome = broker.reap("q", "c1", 60_000)
    assert outcome.status == -1
    assert broker.client.llen(broker.keys.processing("q", "c1")) == 1


def test_reaping_returns_tasks_oldest_first_and_tombstones_the_consumer(broker):
    register(broker, "c1")
    push(broker, *[make_task(n) for n in range(3)])
    broker.claim("q", "c1", 3)
    expire(broker, "c1")
    expired, _ = broker.reap_candidates("q")
    assert expired == ["c1"]
    outcome = broker.reap("q", "c1", LEASE_MS)
    assert (outcome.status, outcome.requeued, outcome.remaining) == (1, 3, 0)
    # They wait as suspects, oldest at the head (each runs apart, so a death can be pinned on it).
    assert ids(reversed(broker.client.lrange(broker.keys.suspects("q"), 0, -1))) == ["task-0", "task-1", "task-2"]
    # The reaped consumer's renewals and claims now fail: it must take a new identity.
    assert broker.heartbeat(["q"], "c1", LEASE_MS) is False
    assert broker.claim("q", "c1", 1) is None


def test_a_reaped_consumer_cannot_also_retry_or_ack_its_task(broker):
    register(broker, "c1")
    push(broker, make_task(1))
    [raw] = broker.claim("q", "c1", 1)
    expire(broker, "c1")
    broker.reap("q", "c1", LEASE_MS)
    assert broker.retry_later("q", "c1", raw, raw, 0, 1000) is False
    assert broker.dead_letter("q", "c1", raw, raw) is False
    assert broker.ack("q", "c1", [raw]) == [False]
    assert broker.client.zcard(broker.keys.delayed("q")) == 0
    assert broker.client.zcard(broker.keys.dead("q")) == 0
    assert broker.client.llen(broker.keys.suspects("q")) == 1


def test_tasks_moved_into_a_tombstoned_list_are_swept_back(broker):
    register(broker, "c1")
    expire(broker, "c1")
    broker.reap("q", "c1", LEASE_MS)
    # A blocking claim that was in flight when the consumer froze lands in its old list.
    push(broker, make_task(9))
    broker.claim_blocking("q", "c1", 1)
    _, tombstones = broker.reap_candidates("q")
    assert tombstones == ["c1"]
    assert broker.reap("q", "c1", LEASE_MS).requeued == 1
    assert broker.client.llen(broker.keys.suspects("q")) == 1
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [WAKE_TOKEN]  # wakes blocked claims


def kill_while_holding(broker, consumer_id: str, *, take_suspect: bool, start_suspect: bool) -> list[bytes]:
    """A consumer claims, maybe starts its suspect, dies, and is reaped; return the dead letters."""
    register(broker, consumer_id)
    if take_suspect:
        claim = broker.claim_with_suspect("q", consumer_id, 10)
        assert claim.took_suspect
        if start_suspect:
            broker.mark_started("q", claim.tasks[0])
    else:
        broker.claim("q", consumer_id, 10)
    expire(broker, consumer_id)
    return broker.reap("q", consumer_id, LEASE_MS).dead_lettered


def test_a_task_that_keeps_killing_its_consumer_is_dead_lettered_with_a_reason(broker):
    push(broker, make_task(1))
    assert kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False) == []
    assert broker.client.llen(broker.keys.suspects("q")) == 1
    assert broker.queue_stats("q").pending == 1
    for round_number in range(1, MAX_RECOVERIES):
        assert kill_while_holding(broker, f"c{round_number}", take_suspect=True, start_suspect=True) == []
    [raw] = kill_while_holding(broker, "last", take_suspect=True, start_suspect=True)
    dead = decode_task(raw)
    assert dead.id == "task-1"
    assert "recovered 4 times" in dead.dead_reason
    assert dead.last_error.startswith("ConsumerDied")
    assert broker.client.zcard(broker.keys.dead("q")) == 1
    assert broker.queue_stats("q").pending == 0


def test_only_a_suspect_running_when_its_consumer_dies_is_blamed(broker):
    push(broker, make_task(1), make_task(2), make_task(3))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)  # all three now suspects
    for round_number in range(1, 10):
        # Each consumer holds one suspect and dies before starting it: nobody is blamed.
        assert kill_while_holding(broker, f"c{round_number}", take_suspect=True, start_suspect=False) == []
    assert broker.client.llen(broker.keys.suspects("q")) == 3
    assert broker.client.zcard(broker.keys.dead("q")) == 0


def test_a_consumer_takes_at_most_one_suspect_and_finishing_it_clears_its_record(broker):
    push(broker, make_task(1), make_task(2))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)
    push(broker, make_task(3))
    register(broker, "c1")
    claim = broker.claim_with_suspect("q", "c1", 10)
    assert claim.took_suspect and ids(claim.tasks) == ["task-1", "task-3"]
    assert claim.suspects_waiting == 1
    broker.mark_started("q", claim.tasks[0])
    assert broker.ack("q", "c1", claim.tasks) == [True, True]
    assert broker.client.hlen(broker.keys.recoveries("q")) == 1  # the other suspect's count only


def test_returned_and_deferred_suspects_stay_suspects(broker):
    push(broker, make_task(1))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)
    register(broker, "c1")
    [raw] = broker.claim_with_suspect("q", "c1", 1).tasks
    assert broker.return_unstarted("q", "c1", [raw]) == 1
    assert broker.client.llen(broker.keys.suspects("q")) == 1
    [raw] = broker.claim_with_suspect("q", "c1", 1).tasks
    broker.retry_later("q", "c1", raw, raw, 0, 0)  # rate-limited
    time.sleep(0.01)
    broker.promote_due("q")
    assert broker.client.lrange(broker.keys.suspects("q"), 0, -1) == [raw]
    assert broker.deregister("q", "c1") == 0


def test_racing_reapers_requeue_each_task_exactly_once(broker):
    register(broker, "victim")
    push(broker, *[make_task(n) for n in range(200)])
    broker.claim("q", "victim", 200)
    expire(broker, "victim")
    moved = []
    barrier = threading.Barrier(8)

    def reap() -> None:
        barrier.wait()
        outcome = broker.reap("q", "victim", LEASE_MS)
        moved.append(outcome.requeued if outcome.status == 1 else 0)

    threads = [threading.Thread(target=reap) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(moved) == 200
    suspects = broker.client.lrange(broker.keys.suspects("q"), 0, -1)
    assert len(suspects) == len(set(suspects)) == 200


def test_retry_later_moves_to_delayed_and_promotion_waits_for_the_due_time(broker):
    register(broker, "c1", lease_ms=5000)  # claims again after the delay: only under a live lease
    push(broker, make_task(1, priority=7), priority=7)
    [raw] = broker.claim("q", "c1", 1)
    assert broker.retry_later("q", "c1", raw, raw, 7, 300) is True
    assert broker.promote_due("q")[0] == 0
    [(member, _)] = broker.client.zrange(broker.keys.delayed("q"), 0, -1, withscores=True)
    assert split_delayed_member(member) == (7, raw)
    time.sleep(0.35)
    assert broker.promote_due("q")[0] == 1
    assert ids(broker.claim("q", "c1", 5, drop_wake=True)) == ["task-1"]


def test_promotion_reports_the_next_due_time(broker):
    now_ms = broker.server_time_ms()
    push(broker, make_task(1), delay_ms=60_000)
    moved, next_due_ms, server_now_ms, malformed = broker.promote_due("q")
    assert (moved, malformed) == (0, 0)
    assert 0 <= next_due_ms - (now_ms + 60_000) < 5_000
    assert abs(server_now_ms - now_ms) < 5_000


def test_delayed_members_keep_their_priority():
    assert split_delayed_member(delayed_member(-100, b"x")) == (-100, b"x")
    assert split_delayed_member(delayed_member(5, b"\x00")) == (5, b"\x00")


def test_return_unstarted_puts_tasks_back_at_the_head_in_order(broker):
    register(broker, "c1")
    push(broker, *[make_task(n) for n in range(4)])
    claimed = broker.claim("q", "c1", 4)
    assert broker.return_unstarted("q", "c1", claimed[2:]) == 2
    push(broker, make_task(99))
    assert ids(broker.claim("q", "c1", 3)) == ["task-2", "task-3", "task-99"]


def test_deregister_returns_what_is_held_and_drops_the_lease(broker):
    register(broker, "c1")
    push(broker, make_task(1))
    broker.claim("q", "c1", 1)
    assert broker.deregister("q", "c1") == 1
    assert broker.live_consumers("q") == []
    assert broker.client.llen(broker.keys.pending("q")) == 1


def test_queue_stats_and_idleness(broker):
    register(broker, "c1")
    push(broker, make_task(1), make_task(2))
    push(broker, make_task(3, priority=1), priority=1)
    push(broker, make_task(4), delay_ms=60_000)
    broker.claim("q", "c1", 1, drop_wake=True)
    stats = broker.queue_stats("q")
    assert (stats.pending, stats.processing, stats.delayed, stats.dead) == (2, 1, 1, 0)
    assert [c["id"] for c in stats.consumers] == ["c1"]
    assert stats.consumers[0]["in_flight"] == 1
    assert not broker.is_idle(["q"])
    assert broker.known_queues() == ["q"]


def test_dead_letters_can_be_listed_requeued_and_deleted(broker):
    register(broker, "c1")
    push(broker, make_task(1), make_task(2))
    first, second = broker.claim("q", "c1", 2)
    broker.dead_letter("q", "c1", first, first)
    broker.dead_letter("q", "c1", second, second)
    assert {raw for raw, _ in broker.list_dead("q")} == {first, second}
    assert broker.requeue_dead("q", [(first, 0, first)]) == 1
    assert broker.requeue_dead("q", [(first, 0, first)]) == 0
    assert broker.delete_dead("q", [second]) == 1
    assert broker.list_dead("q") == []
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [first]


@pytest.mark.parametrize("priority", [1, -1])
def test_non_zero_priority_tasks_count_as_pending(broker, priority):
    push(broker, make_task(1, priority=priority), priority=priority)
    assert broker.queue_stats("q").pending == 1


def test_a_late_outcome_of_an_earlier_run_cannot_overwrite_a_later_run(broker):
    from tasks_app.protocol import results
    from tasks_app.protocol.codec import Arguments

    task = Task(id="rerun-1", type="demo.echo", queue="q", attempt=1)
    args = Arguments([], {})
    first, second = broker.issue_fence("q"), broker.issue_fence("q")
    broker.record_result(results.started(task, args, "c1", 1, 3, 60, first))
    broker.record_result(results.started(task, args, "c2", 2, 3, 60, second))  # c1 was presumed dead
    broker.record_result(results.succeeded(task, '"from c1"', 3, 60, first))
    assert broker.get_result("rerun-1")["status"] == "RUNNING"
    broker.record_result(results.succeeded(task, '"from c2"', 4, 60, second))
    record = broker.get_result("rerun-1")
    assert (record["status"], record["return_value"]) == ("SUCCESSFUL", '"from c2"')


def test_a_deferral_keeps_the_recovery_count_but_a_retry_clears_it(broker):
    push(broker, make_task(1))
    register(broker, "c0")
    [raw] = broker.claim("q", "c0", 1)
    expire(broker, "c0")
    broker.reap("q", "c0", LEASE_MS)
    digest = __import__("hashlib").sha1(raw).hexdigest()
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1"
    register(broker, "c1")
    [raw] = broker.claim_with_suspect("q", "c1", 1).tasks
    broker.retry_later("q", "c1", raw, raw, 0, 0)  # rate-limited: it never ran
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1"
    broker.promote_due("q")
    [raw] = broker.claim_with_suspect("q", "c1", 1).tasks
    retried = encode_task(Task(id="task-1", type="demo.echo", queue="q", attempt=1))
    broker.retry_later("q", "c1", raw, retried, 0, 0)  # it ran and failed: a fresh start
    assert broker.client.hget(broker.keys.recoveries("q"), digest) is None


@pytest.mark.parametrize("info", [b"not json", b"5", b"[1, 2]", b'{"lease_ms": "soon"}', b'{"lease_ms": {}}', b"\xff"])
def test_reaping_never_fails_on_consumer_info_a_foreign_process_wrote(broker, info):
    register(broker, "c1")
    push(broker, make_task(1))
    broker.claim("q", "c1", 1)
    broker.client.hset(broker.keys.consumer_info("q"), "c1", info)
    expire(broker, "c1")
    outcome = broker.reap("q", "c1", LEASE_MS)
    assert (outcome.status, outcome.requeued) == (1, 1)


def test_a_clean_exit_clears_the_start_mark_of_the_suspect_it_returns(broker):
    register(broker, "c0")
    push(broker, make_task(1))
    [raw] = broker.claim("q", "c0", 1)
    expire(broker, "c0")
    broker.reap("q", "c0", LEASE_MS)
    register(broker, "c1")
    [raw] = broker.claim_with_suspect("q", "c1", 1).tasks
    broker.mark_started("q", raw)
    assert broker.deregister("q", "c1") == 1
    digest = __import__("hashlib").sha1(raw).hexdigest()
    assert broker.client.hget(broker.keys.recoveries("q"), f"s:{digest}") is None
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1"
    assert broker.client.lrange(broker.keys.suspects("q"), 0, -1) == [raw]


def test_every_tombstone_is_examined_in_turn_not_only_the_first_page(broker):
    from tasks_app.consumer.loops import ReaperLoop
    from tasks_app.protocol.leases import TOMBSTONE_PAGE

    now_ms = broker.server_time_ms()
    count = 2 * TOMBSTONE_PAGE + 50
    broker.client.zadd(broker.keys.reaped("q"), {f"gone-{n}": now_ms - count + n for n in range(count)})
    for n in (0, TOMBSTONE_PAGE + 10, count - 1):  # the oldest, a middle one, the newest
        broker.client.lpush(broker.keys.processing("q", f"gone-{n}"), make_task(n))
    reaper = ReaperLoop(broker, ["q"], LEASE_MS / 1000, lambda queue, dead: None)
    for _ in range(count // TOMBSTONE_PAGE + 1):
        reaper.run_once()
    assert sorted(ids(broker.client.lrange(broker.keys.suspects("q"), 0, -1))) == sorted(
        f"task-{n}" for n in (0, TOMBSTONE_PAGE + 10, count - 1)
    )


def test_a_consumer_id_no_consumer_could_have_written_does_not_stop_the_reaper(broker):
    broker.client.zadd(broker.keys.consumers("q"), {b"\xff\xfe": 1, "bad id{}": 1})
    register(broker, "c1")
    push(broker, make_task(1))
    broker.claim("q", "c1", 1)
    expire(broker, "c1")
    expired, _ = broker.reap_candidates("q")
    assert expired == ["c1"]
