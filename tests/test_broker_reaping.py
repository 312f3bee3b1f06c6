"""The broker's contract for leases, reaping and suspects, against a real Redis server."""

import threading
import time

import pytest

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.keys import WAKE_TOKEN
from tasks_app.protocol.leases import MAX_RECOVERIES
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.broker_calls import LEASE_MS, expire, ids, make_task, push, register


def test_reaper_never_touches_a_live_lease(broker):
    register(broker, "c1", lease_ms=60_000)
    push(broker, make_task(1))
    broker.queue.claim("q", "c1", 1)
    outcome = broker.leases.reap("q", "c1", 60_000)
    assert outcome.status == -1
    assert broker.client.llen(broker.keys.processing("q", "c1")) == 1


def test_reaping_returns_tasks_oldest_first_and_tombstones_the_consumer(broker):
    register(broker, "c1")
    push(broker, *[make_task(n) for n in range(3)])
    broker.queue.claim("q", "c1", 3)
    expire(broker, "c1")
    [(expired, _, _)] = broker.leases.reap_candidate_pages(["q"], [0])
    assert expired == ["c1"]
    outcome = broker.leases.reap("q", "c1", LEASE_MS)
    assert (outcome.status, outcome.requeued, outcome.remaining) == (1, 3, 0)
    # They wait as suspects, oldest at the head (each runs apart, so a death can be pinned on it).
    assert ids(reversed(broker.client.lrange(broker.keys.suspects("q"), 0, -1))) == ["task-0", "task-1", "task-2"]
    # The reaped consumer's renewals and claims now fail: it must take a new identity.
    assert broker.leases.heartbeat(["q"], "c1", LEASE_MS) is False
    assert broker.queue.claim("q", "c1", 1) is None


def test_a_reaped_consumer_cannot_also_retry_or_ack_its_task(broker):
    register(broker, "c1")
    push(broker, make_task(1))
    [raw] = broker.queue.claim("q", "c1", 1)
    expire(broker, "c1")
    broker.leases.reap("q", "c1", LEASE_MS)
    assert broker.queue.retry_later("q", "c1", raw, raw, 0, 1000) is False
    assert broker.queue.dead_letter("q", "c1", raw, raw) is False
    assert broker.queue.ack("q", "c1", [raw]) == [False]
    assert broker.client.zcard(broker.keys.delayed("q")) == 0
    assert broker.client.zcard(broker.keys.dead("q")) == 0
    assert broker.client.llen(broker.keys.suspects("q")) == 1


def test_tasks_moved_into_a_tombstoned_list_are_swept_back(broker):
    register(broker, "c1")
    expire(broker, "c1")
    broker.leases.reap("q", "c1", LEASE_MS)
    # A blocking claim that was in flight when the consumer froze lands in its old list.
    push(broker, make_task(9))
    broker.queue.claim_blocking("q", "c1", 1, 60)
    [(_, tombstones, _)] = broker.leases.reap_candidate_pages(["q"], [0])
    assert tombstones == ["c1"]
    assert broker.leases.reap("q", "c1", LEASE_MS).requeued == 1
    assert broker.client.llen(broker.keys.suspects("q")) == 1
    assert broker.client.lrange(broker.keys.pending("q"), 0, -1) == [WAKE_TOKEN]  # wakes blocked claims


def kill_while_holding(broker, consumer_id: str, *, take_suspect: bool, start_suspect: bool) -> list[bytes]:
    """A consumer claims, maybe starts its suspect, dies, and is reaped; return the dead letters."""
    register(broker, consumer_id)
    if take_suspect:
        claim = broker.queue.claim_with_suspect("q", consumer_id, 10)
        assert claim.took_suspect
        if start_suspect:
            broker.queue.mark_started("q", consumer_id, claim.tasks[0])
    else:
        broker.queue.claim("q", consumer_id, 10)
    expire(broker, consumer_id)
    return broker.leases.reap("q", consumer_id, LEASE_MS).dead_lettered


def test_a_task_that_keeps_killing_its_consumer_is_dead_lettered_with_a_reason(broker):
    push(broker, make_task(1))
    assert kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False) == []
    assert broker.client.llen(broker.keys.suspects("q")) == 1
    assert broker.inspect.queue_stats("q").pending == 1
    for round_number in range(1, MAX_RECOVERIES):
        assert kill_while_holding(broker, f"c{round_number}", take_suspect=True, start_suspect=True) == []
    [raw] = kill_while_holding(broker, "last", take_suspect=True, start_suspect=True)
    dead = decode_task(raw)
    assert dead.id == "task-1"
    assert "recovered 4 times" in dead.dead_reason
    assert dead.last_error.startswith("ConsumerDied")
    assert broker.client.zcard(broker.keys.dead("q")) == 1
    assert broker.inspect.queue_stats("q").pending == 0


def test_only_a_suspect_running_when_its_consumer_dies_is_blamed(broker):
    push(broker, make_task(1), make_task(2), make_task(3))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)  # all three now suspects
    for round_number in range(1, 10):
        # Each consumer holds one suspect and dies before starting it: nobody is blamed.
        assert kill_while_holding(broker, f"c{round_number}", take_suspect=True, start_suspect=False) == []
    assert broker.client.llen(broker.keys.suspects("q")) == 3
    assert broker.client.zcard(broker.keys.dead("q")) == 0


def test_a_suspect_whose_lease_lapsed_before_its_start_is_not_marked_nor_blamed(broker):
    push(broker, make_task(1))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)
    register(broker, "c1")
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    expire(broker, "c1")
    assert broker.queue.mark_started("q", "c1", raw) is False
    assert broker.client.hlen(broker.keys.recoveries("q")) == 1  # its recovery count, no start mark
    assert broker.leases.reap("q", "c1", LEASE_MS).dead_lettered == []
    digest = __import__("hashlib").sha1(raw).hexdigest()
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1", "blamed for a run that never began"


def test_a_suspects_start_is_not_marked_for_another_instance_of_its_consumer_id(broker):
    push(broker, make_task(1))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)
    register(broker, "c1")
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    broker.leases.heartbeat(["q"], "c1", LEASE_MS, {"lease_ms": LEASE_MS, "instance": "restarted"})
    broker.queue.instance = "frozen"
    assert broker.queue.mark_started("q", "c1", raw) is False
    broker.queue.instance = "restarted"
    assert broker.queue.mark_started("q", "c1", raw) is True


def test_a_consumer_takes_at_most_one_suspect_and_finishing_it_clears_its_record(broker):
    push(broker, make_task(1), make_task(2))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)
    push(broker, make_task(3))
    register(broker, "c1")
    claim = broker.queue.claim_with_suspect("q", "c1", 10)
    assert claim.took_suspect and ids(claim.tasks) == ["task-1", "task-3"]
    assert claim.suspects_waiting == 1
    broker.queue.mark_started("q", "c1", claim.tasks[0])
    assert broker.queue.ack("q", "c1", claim.tasks) == [True, True]
    assert broker.client.hlen(broker.keys.recoveries("q")) == 1  # the other suspect's count only


def test_returned_and_deferred_suspects_stay_suspects(broker):
    push(broker, make_task(1))
    kill_while_holding(broker, "c0", take_suspect=False, start_suspect=False)
    register(broker, "c1")
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    assert broker.queue.return_unstarted("q", "c1", [raw]) == 1
    assert broker.client.llen(broker.keys.suspects("q")) == 1
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    broker.queue.retry_later("q", "c1", raw, raw, 0, 0)  # rate-limited
    time.sleep(0.01)
    broker.queue.promote_due("q")
    assert broker.client.lrange(broker.keys.suspects("q"), 0, -1) == [raw]
    assert broker.leases.deregister("q", "c1") == 0


def test_racing_reapers_requeue_each_task_exactly_once(broker):
    push(broker, *[make_task(n) for n in range(200)])
    register(broker, "victim")  # after the push: its short lease must still hold for the claim
    broker.queue.claim("q", "victim", 200)
    expire(broker, "victim")
    moved = []
    barrier = threading.Barrier(8)

    def reap() -> None:
        barrier.wait()
        outcome = broker.leases.reap("q", "victim", LEASE_MS)
        moved.append(outcome.requeued if outcome.status == 1 else 0)

    threads = [threading.Thread(target=reap) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(moved) == 200
    suspects = broker.client.lrange(broker.keys.suspects("q"), 0, -1)
    assert len(suspects) == len(set(suspects)) == 200


def test_a_deferral_keeps_the_recovery_count_but_a_retry_clears_it(broker):
    push(broker, make_task(1))
    register(broker, "c0")
    [raw] = broker.queue.claim("q", "c0", 1)
    expire(broker, "c0")
    broker.leases.reap("q", "c0", LEASE_MS)
    digest = __import__("hashlib").sha1(raw).hexdigest()
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1"
    register(broker, "c1")
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    broker.queue.retry_later("q", "c1", raw, raw, 0, 0)  # rate-limited: it never ran
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1"
    broker.queue.promote_due("q")
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    retried = encode_task(Task(id="task-1", type="demo.echo", queue="q", attempt=1))
    broker.queue.retry_later("q", "c1", raw, retried, 0, 0)  # it ran and failed: a fresh start
    assert broker.client.hget(broker.keys.recoveries("q"), digest) is None


def test_a_clean_exit_clears_the_start_mark_of_the_suspect_it_returns(broker):
    register(broker, "c0")
    push(broker, make_task(1))
    [raw] = broker.queue.claim("q", "c0", 1)
    expire(broker, "c0")
    broker.leases.reap("q", "c0", LEASE_MS)
    register(broker, "c1")
    [raw] = broker.queue.claim_with_suspect("q", "c1", 1).tasks
    broker.queue.mark_started("q", "c1", raw)
    assert broker.leases.deregister("q", "c1") == 1
    digest = __import__("hashlib").sha1(raw).hexdigest()
    assert broker.client.hget(broker.keys.recoveries("q"), f"s:{digest}") is None
    assert broker.client.hget(broker.keys.recoveries("q"), digest) == b"1"
    assert broker.client.lrange(broker.keys.suspects("q"), 0, -1) == [raw]


def test_every_tombstone_is_examined_in_turn_not_only_the_first_page(broker):
    from tasks_app.consumer.membership import ReaperLoop
    from tasks_app.protocol.leases import TOMBSTONE_PAGE

    now_ms = broker.inspect.server_time_ms()
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


@pytest.mark.parametrize("settle", ["ack", "retry", "dead-letter", "return"])
def test_a_frozen_run_settles_nothing_in_the_list_of_a_restart_that_took_its_id(broker, settle):
    # Instance "old" froze past its lease; a restart ("new") took the fixed id "x", recovered the
    # task and claimed it again: the same bytes now sit in the same list, as the restart's run.
    old = Broker(broker.client, broker.keys.prefix, broker.scripts)
    old.queue.instance = "old"
    old.leases.heartbeat(["q"], "x", LEASE_MS, {"lease_ms": LEASE_MS, "instance": "old"})
    push(broker, make_task(1))
    [raw] = old.queue.claim("q", "x", 1)
    broker.queue.instance = "new"
    assert broker.leases.reap("q", "x", LEASE_MS, own_earlier_run=True).requeued == 1
    broker.leases.heartbeat(["q"], "x", LEASE_MS, {"lease_ms": LEASE_MS, "instance": "new"})
    claim = broker.queue.claim_with_suspect("q", "x", 1)
    assert claim.took_suspect and claim.tasks == [raw]
    assert broker.queue.mark_started("q", "x", raw)
    marks = broker.client.hgetall(broker.keys.recoveries("q"))

    # The old run thaws and settles its copy: it is not its own any more.
    if settle == "ack":
        assert old.queue.ack("q", "x", [raw]) == [False]
    elif settle == "retry":
        assert old.queue.retry_later("q", "x", raw, raw + b"\x58\x01", 0, 1000) is False
    elif settle == "dead-letter":
        assert old.queue.dead_letter("q", "x", raw, raw) is False
    else:  # it stops before the task started there
        assert old.queue.return_unstarted("q", "x", [raw]) == 0

    assert broker.client.lrange(broker.keys.processing("q", "x"), 0, -1) == [raw], "the restart's run is left alone"
    assert broker.client.hgetall(broker.keys.recoveries("q")) == marks, "and so are its marks"
    assert broker.client.zcard(broker.keys.delayed("q")) == broker.client.zcard(broker.keys.dead("q")) == 0
    waiting = broker.client.lrange(broker.keys.pending("q"), 0, -1)
    waiting += broker.client.lrange(broker.keys.suspects("q"), 0, -1)
    assert raw not in waiting, "nor is it queued again"
    assert broker.queue.ack("q", "x", [raw]) == [True]


def commands_per_queue_of_a_renewal(broker, queues) -> float:
    """Redis commands one renewal of `queues` runs per queue (its script's inner calls), beyond those of one queue."""

    def calls() -> int:  # the INFO reading them counts in the next reading
        return sum(int(entry["calls"]) for entry in broker.client.info("commandstats").values())

    before = calls()
    assert broker.leases.renew_leases(queues, "c1", 60_000, "ours") == []
    after = calls()
    assert broker.leases.renew_leases(queues[:1], "c1", 60_000, "ours") == []
    return ((after - before) - (calls() - after)) / (len(queues) - 1)


def test_a_renewal_of_an_unchanged_lease_is_one_write_a_queue(tmp_path, key_prefix):
    server = RedisServer(tmp_path).start()  # its commands counted alone
    try:
        broker = Broker(connect(server.url), key_prefix)
        queues = [f"q{n}" for n in range(10)]
        broker.leases.heartbeat(queues, "c1", 60_000, {"lease_ms": 60_000, "instance": "ours"})
        assert commands_per_queue_of_a_renewal(broker, queues) == 1
        # Another process has no last renewal to compare with: it checks everything.
        assert commands_per_queue_of_a_renewal(Broker(connect(server.url), key_prefix), queues) >= 4
    finally:
        server.remove()


@pytest.mark.parametrize("change", ["reaped", "lapsed", "registered elsewhere", "renewed elsewhere"])
def test_a_one_write_renewal_still_sees_what_changed_since_the_last(broker, change):
    queues = ["q", "r"]
    broker.leases.heartbeat(queues, "c1", 60_000, {"lease_ms": 60_000, "instance": "ours"})
    assert broker.leases.renew_leases(queues, "c1", 60_000, "ours") == []
    other = Broker.from_settings()  # another process
    if change == "reaped":
        expire(broker, "c1", "r")
        assert broker.leases.reap("r", "c1", 60_000).status == 1
    elif change == "lapsed":
        expire(broker, "c1", "r")
    elif change == "registered elsewhere":
        other.leases.heartbeat(["r"], "c1", 60_000, {"lease_ms": 60_000, "instance": "theirs"})
        theirs = broker.client.zscore(broker.keys.consumers("r"), "c1")
        time.sleep(0.005)  # a renewal of ours would write a later deadline
    else:  # this process's own renewal whose reply was lost: the lease holds
        broker.client.zadd(
            broker.keys.consumers("r"), {"c1": broker.client.zscore(broker.keys.consumers("r"), "c1") + 5}
        )
    lost = broker.leases.renew_leases(queues, "c1", 60_000, "ours")
    assert lost == ([] if change == "renewed elsewhere" else ["r"])
    deadline = broker.client.zscore(broker.keys.consumers("q"), "c1")
    if change == "registered elsewhere":
        assert broker.client.zscore(broker.keys.consumers("r"), "c1") == theirs != deadline, "theirs is left alone"
    elif change == "renewed elsewhere":
        assert broker.client.zscore(broker.keys.consumers("r"), "c1") == deadline


def test_a_task_left_staged_by_a_consumer_that_died_is_recovered(broker):
    # Killed between the blocking move and the script behind it: the task sits in its staging list.
    register(broker, "c1")
    push(broker, make_task(1))
    broker.client.lmove(broker.keys.pending("q"), broker.keys.staging("q", "c1"), "RIGHT", "LEFT")
    expire(broker, "c1")
    assert [expired for expired, _, _ in broker.leases.reap_candidate_pages(["q"], [0])] == [["c1"]]
    assert broker.leases.reap("q", "c1", LEASE_MS).requeued == 1
    assert ids(broker.client.lrange(broker.keys.suspects("q"), 0, -1)) == ["task-1"]
    assert broker.client.llen(broker.keys.staging("q", "c1")) == 0


def test_a_task_staged_in_a_tombstoned_list_is_swept_back(broker):
    register(broker, "c1")
    expire(broker, "c1")
    broker.leases.reap("q", "c1", LEASE_MS)
    broker.client.lpush(broker.keys.staging("q", "c1"), make_task(9))
    [(_, tombstones, _)] = broker.leases.reap_candidate_pages(["q"], [0])
    assert tombstones == ["c1"]
    assert broker.leases.reap("q", "c1", LEASE_MS).requeued == 1
    assert ids(broker.client.lrange(broker.keys.suspects("q"), 0, -1)) == ["task-9"]


def test_a_clean_exit_returns_a_staged_task_too(broker):
    register(broker, "c1")
    push(broker, make_task(1), make_task(2))
    assert len(broker.queue.claim("q", "c1", 1)) == 1
    broker.client.lmove(broker.keys.pending("q"), broker.keys.staging("q", "c1"), "RIGHT", "LEFT")
    assert broker.leases.deregister("q", "c1") == 2
    assert sorted(ids(broker.client.lrange(broker.keys.pending("q"), 0, -1))) == ["task-1", "task-2"]
    assert broker.queue.held_and_staged("q", "c1") == ([], [])
