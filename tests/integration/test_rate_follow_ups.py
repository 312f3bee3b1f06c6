"""Deferred tasks following a changed or removed rate limit, once, on real Redis."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from tasks_app import producer
from tasks_app.consumer.gates import RateLimiter, RatePolicy
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.keys import delayed_member
from tasks_app.task_types import TaskTypeCache, TaskTypeConfig
from tests.support.processes import wait_until
from tests.support.recording import remove_limit_and_wait_for_runs

TYPE = "test.limited"
LIMITED = TaskTypeConfig(name=TYPE, handler=TYPE, rate_limit=1, rate_period_s=60.0)
REMOVED = TaskTypeConfig(name=TYPE, handler=TYPE)
FASTER = TaskTypeConfig(name=TYPE, handler=TYPE, rate_limit=2, rate_period_s=60.0)
KEYED = TaskTypeConfig(name=TYPE, handler=TYPE, rate_limit=1, rate_period_s=60.0, rate_limit_key="tenant")
KEYED_FASTER = TaskTypeConfig(name=TYPE, handler=TYPE, rate_limit=2, rate_period_s=60.0, rate_limit_key="tenant")
RECORDED = "test.record"


class ScanCountingClient:
    """A Redis client that counts the scans of each key and passes everything on."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.scans: Counter[str] = Counter()

    def zscan_iter(self, name: str, **options: Any) -> Any:
        self.scans[name] += 1
        return self.client.zscan_iter(name, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def defer(
    broker: Broker, queue: str, count: int, config: TaskTypeConfig = LIMITED, key_token: str | None = None
) -> list[bytes]:
    """Deny `count` tasks of TYPE on `queue` (after one admitted) and put them in its delayed set, as consumers do."""
    limiter, deferred = RateLimiter(broker), []
    named = queue if key_token is None else f"{queue}-{key_token}"
    limiter(Task(id=f"{named}-first", type=TYPE, queue=queue), config, key_token)
    for n in range(count):
        task = Task(id=f"{named}-{n}", type=TYPE, queue=queue)
        wait_ms = limiter(task, config, key_token).wait_ms
        member = delayed_member(0, encode_task(task))
        broker.client.zadd(broker.keys.delayed(queue), {member: broker.inspect.server_time_ms() + wait_ms})
        deferred.append(member)
    return deferred


def due_now(broker: Broker, queue: str, members: list[bytes]) -> bool:
    scores = broker.client.zmscore(broker.keys.delayed(queue), members)
    return all(score is not None and score <= broker.inspect.server_time_ms() for score in scores)


def following() -> bool:
    return any(thread.name == "rate-follow-up" for thread in threading.enumerate())


def test_a_removed_limit_is_followed_up_once_however_many_consumers_notice_it(broker, monkeypatch):
    deferred = defer(broker, "default", 20)
    counting = ScanCountingClient(broker.client)
    consumers = [RateLimiter(Broker(counting, broker.keys.prefix, broker.scripts)) for _ in range(3)]

    # Each one's refresh finds the limit gone before any follow-up has scanned (a notice landing
    # mid-scan lists the queue again, and rightly scans it once more: see the listed-again tests).
    start_following = RateLimiter._start_following
    noticed: list[tuple[RateLimiter, str, list[str | None]]] = []
    with monkeypatch.context() as patch:
        patch.setattr(
            RateLimiter, "_start_following", lambda self, name, changed: noticed.append((self, name, changed))
        )
        for limiter in consumers:
            limiter.follow(REMOVED)
    assert len(noticed) == 3
    for limiter, name, changed in noticed:
        start_following(limiter, name, changed)

    wait_until(lambda: due_now(broker, "default", deferred), 10, message="the deferred tasks to be due now")
    wait_until(lambda: not following(), 10, message="every consumer to be done following the removal")
    assert counting.scans == {broker.keys.delayed("default"): 1}
    assert broker.limits.rate_follow_ups(TYPE, None) == {}


def test_a_follower_that_dies_leaves_the_rest_to_another(broker):
    deferred = {queue: defer(broker, queue, 5) for queue in ("default", "elsewhere")}
    assert broker.limits.rate_removed(TYPE, None, LIMITED.queue) == 2
    # A consumer took the lease and was killed before it moved anything: it never gives it back.
    assert broker.limits.rate_follower(TYPE, None, "killed", 300)

    moved = broker.limits.follow_up(TYPE, None, threading.Event(), lease_ms=300)

    assert moved == 10
    assert all(due_now(broker, queue, members) for queue, members in deferred.items())
    assert broker.limits.rate_follow_ups(TYPE, None) == {}
    assert broker.client.hgetall(broker.keys.rate_queues(TYPE)) == {}


def test_a_limit_removed_while_its_slots_are_moved_still_makes_them_due_now(broker):
    defer(broker, "elsewhere", 2)
    faster = RatePolicy.for_config(FASTER)
    args = (faster.limit, faster.period_us, faster.emission_us, faster.tolerance_us)
    assert broker.limits.rate_limit(TYPE, faster.algorithm, "", *args).rescaled  # "elsewhere" listed
    assert broker.limits.rate_follow_ups(TYPE, None) == {"elsewhere": "slots"}

    broker.limits.rate_removed(TYPE, None, LIMITED.queue)  # meanwhile, before the slots were moved

    assert not broker.limits.rate_followed(TYPE, None, "elsewhere", "slots", broker.inspect.server_time_ms() * 1000)
    assert broker.limits.rate_follow_ups(TYPE, None) == {"elsewhere": "now", LIMITED.queue: "now"}


@pytest.mark.parametrize("late_id", ["late", "elsewhere-1"], ids=["new_task", "task_holding_a_slot"])
def test_a_task_denied_while_a_removal_is_followed_up_is_listed_again_at_the_next_notice(broker, late_id):
    defer(broker, "elsewhere", 2)
    broker.limits.rate_removed(TYPE, None, LIMITED.queue)
    scan_began_us = broker.inspect.server_time_ms() * 1000
    # Meanwhile a consumer that has not noticed the removal yet denies a task there under the old
    # limit: a new one, or one the scan made due now that comes back before its slot.
    late = Task(id=late_id, type=TYPE, queue="elsewhere")
    assert RateLimiter(broker)(late, LIMITED).wait_ms > 0

    assert broker.limits.rate_followed(TYPE, None, "elsewhere", "now", scan_began_us)

    broker.limits.rate_removed(TYPE, None, LIMITED.queue)  # that consumer's own notice of the removal
    assert broker.limits.rate_follow_ups(TYPE, None)["elsewhere"] == "now"


def test_the_list_of_queues_to_follow_expires_with_the_limiter(broker):
    defer(broker, "elsewhere", 1)
    broker.limits.rate_removed(TYPE, None, LIMITED.queue)
    lives_ms = broker.client.pttl(broker.keys.rate(TYPE))

    assert 0 < broker.client.pttl(broker.keys.rate_follow_ups(TYPE)) <= lives_ms
    assert 0 < broker.client.pttl(broker.keys.rate_queues(TYPE)) <= lives_ms


@pytest.mark.django_db(transaction=True)
def test_three_consumers_noticing_a_removed_limit_run_its_deferrals_on_another_queue_at_once(broker, consumer_process):
    # Each delayed set is scanned once per change (counted above); here, real consumers racing:
    # one that has not noticed the removal yet may deny a task made due again, and its own notice
    # then lists the queue again.
    row = TaskType.objects.create(name=RECORDED, handler=RECORDED, rate_limit=1, rate_period=60)
    consumers = [consumer_process("--concurrency", "2", "--lease", "2", "--queue", "elsewhere") for _ in range(3)]
    waiting = producer.enqueue(RECORDED, count=6, queue="elsewhere")
    wait_until(  # three consumers start at once on a loaded machine: a minute, not the limit's slots, is the bound
        lambda: broker.inspect.queue_stats("elsewhere").delayed == 5,
        60,
        message=lambda: "five tasks to wait for slots; logs:\n" + "\n".join(each.log() for each in consumers),
    )

    remove_limit_and_wait_for_runs(
        broker, row, waiting, "every waiting task to run once the limit is gone, not minutes apart"
    )


@pytest.mark.django_db
@pytest.mark.parametrize("config", [LIMITED, KEYED], ids=["unkeyed", "keyed"])
def test_the_deferrals_of_a_type_whose_row_is_deleted_are_due_at_the_next_refresh(broker, config):
    # With no row, its tasks run unlimited (a handler of its name) or are dead-lettered: none waits out a slot.
    row = TaskType.objects.create(
        name=TYPE, handler=TYPE, rate_limit=1, rate_period=60, rate_limit_key=config.rate_limit_key
    )
    types = TaskTypeCache()
    types.refresh()
    RateLimiter(broker, follows=types)
    deferred = defer(broker, "elsewhere", 3, config, "a" if config.rate_limit_key else None)

    row.delete()
    types.refresh()

    wait_until(lambda: due_now(broker, "elsewhere", deferred), 10, message="the deferred tasks to be due now")


@pytest.mark.parametrize("changed", [REMOVED, FASTER], ids=["removed", "rescaled"])
def test_deferrals_made_before_queues_were_recorded_follow_on_the_types_own_queue(broker, changed):
    deferred = defer(broker, "default", 3)
    old_slots = broker.client.zmscore(broker.keys.delayed("default"), deferred)
    broker.client.delete(broker.keys.rate_queues(TYPE))  # denied before the hash of queues existed

    RateLimiter(broker).follow(changed)

    wait_until(lambda: not following(), 10, message="the follow-up to be done")
    new_slots = broker.client.zmscore(broker.keys.delayed("default"), deferred)
    assert all(new < old for new, old in zip(new_slots, old_slots, strict=True))
    assert changed.rate_limit or due_now(broker, "default", deferred)


def test_a_removal_followed_up_leaves_no_reservation_to_queue_new_tasks_behind(broker):
    defer(broker, "elsewhere", 3)
    RateLimiter(broker).follow(REMOVED)
    wait_until(lambda: not following(), 10, message="the follow-up to be done")

    fields = {name.decode() for name in broker.client.hkeys(broker.keys.rate(TYPE))}
    assert "cursor" not in fields and not any(name.startswith("r:") for name in fields)
    # Set again, the limit admits a newcomer by its own state, not after the slots of tasks long gone.
    policy = RatePolicy.for_config(FASTER)
    args = (policy.limit, policy.period_us, policy.emission_us, policy.tolerance_us)
    assert broker.limits.rate_limit(TYPE, policy.algorithm, "newcomer", *args).wait_us <= policy.emission_us


@pytest.mark.parametrize("changed", [REMOVED, KEYED_FASTER], ids=["removed", "rescaled"])
def test_the_deferrals_of_each_value_of_a_keyed_limit_follow_its_change(broker, changed):
    deferred = [*defer(broker, "default", 2, KEYED, "a"), *defer(broker, "elsewhere", 2, KEYED, "b")]
    delayed = [broker.keys.delayed(queue) for queue in ("default", "default", "elsewhere", "elsewhere")]
    old_slots = [broker.client.zscore(key, member) for key, member in zip(delayed, deferred, strict=True)]

    RateLimiter(broker).follow(changed)

    wait_until(lambda: not following(), 10, message="the follow-up to be done")
    new_slots = [broker.client.zscore(key, member) for key, member in zip(delayed, deferred, strict=True)]
    assert all(new < old for new, old in zip(new_slots, old_slots, strict=True))
    if not changed.rate_limit:
        assert due_now(broker, "default", deferred[:2]) and due_now(broker, "elsewhere", deferred[2:])


def test_the_values_of_a_keyed_limit_noted_are_bounded_and_leave_when_their_slots_have_passed(broker):
    minute_us = 60_000_000
    assert broker.limits.rate_keyed(TYPE, "gone", 0, 2)  # its slots have passed by the next note
    assert broker.limits.rate_keyed(TYPE, "a", minute_us, 2) and broker.limits.rate_keyed(TYPE, "b", minute_us, 2)

    assert not broker.limits.rate_keyed(TYPE, "c", minute_us, 2)  # full
    assert broker.limits.rate_keyed(TYPE, "a", minute_us, 2)  # one noted already is kept up to date
    assert sorted(broker.limits.rate_keyed_values(TYPE)) == ["a", "b"]
    assert 0 < broker.client.pttl(broker.keys.rate_keyed(TYPE)) <= minute_us // 1000


def test_one_note_of_a_keyed_value_covers_the_denials_of_half_a_period(broker, monkeypatch):
    notes = []
    monkeypatch.setattr(broker.limits, "rate_keyed", lambda *args: notes.append(args) or True)
    ten_a_minute = TaskTypeConfig(name=TYPE, handler=TYPE, rate_limit=10, rate_period_s=60.0, rate_limit_key="tenant")

    defer(broker, "default", 10, ten_a_minute, "a")  # slots about 6 s apart, up to a minute away

    assert 2 <= len(notes) <= 3


def test_a_queue_of_slots_drained_before_the_follow_up_of_a_raised_limit_leaves_its_tasks_due(broker):
    deferred = defer(broker, "elsewhere", 3)  # slots a minute apart
    much_faster = RatePolicy.for_config(TaskTypeConfig(name=TYPE, handler=TYPE, rate_limit=100_000, rate_period_s=60))
    args = (much_faster.limit, much_faster.period_us, much_faster.emission_us, much_faster.tolerance_us)
    assert broker.limits.rate_limit(TYPE, much_faster.algorithm, "", *args).rescaled  # slots now ms away
    wait_until(lambda: broker.limits.rate_limit(TYPE, much_faster.algorithm, "newcomer", *args).wait_us == 0, 5)
    # That admission found every slot passed before the follow-up had moved a task to its slot.

    broker.limits.follow_up(TYPE, None, threading.Event())

    assert due_now(broker, "elsewhere", deferred)


def test_a_list_of_queues_nobody_follows_up_expires_as_listed_however_many_decisions_come(broker):
    defer(broker, "elsewhere", 2)
    broker.limits.rate_removed(TYPE, None, LIMITED.queue)  # every consumer that noticed it dies
    listed_for_ms = broker.client.pttl(broker.keys.rate_follow_ups(TYPE))

    defer(broker, "default", 2)  # denials under the limit set again, slots further away

    assert broker.client.pttl(broker.keys.rate(TYPE)) > listed_for_ms
    assert 0 < broker.client.pttl(broker.keys.rate_follow_ups(TYPE)) <= listed_for_ms


def test_a_denial_in_the_millisecond_before_a_removal_is_scanned_is_forgotten_with_its_queue(broker, monkeypatch):
    deferred = defer(broker, "elsewhere", 2)
    broker.limits.rate_removed(TYPE, None, LIMITED.queue)
    denied_us = int(broker.client.hget(broker.keys.rate_queues(TYPE), "elsewhere"))
    monkeypatch.setattr(broker.client, "time", lambda: (denied_us // 1_000_000, denied_us % 1_000_000 + 1))

    broker.limits.follow_up(TYPE, None, threading.Event())  # its scan begins 1 µs after the last denial

    assert due_now(broker, "elsewhere", deferred)
    assert broker.client.hgetall(broker.keys.rate_queues(TYPE)) == {}  # not listed again at the next notice
