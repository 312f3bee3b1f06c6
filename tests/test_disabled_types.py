"""Tasks of a disabled type: deferred for long and noted, woken at once when the type is enabled again."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.keys import delayed_member
from tasks_app.protocol.scripts import MisconfiguredKey
from tests.support.broker_calls import make_task
from tests.support.processes import wait_until

FAR_MS = 10**12  # a due time no test reaches


def deferred(broker, n: int, task_type: str = "x.slow") -> bytes:
    """A task of `task_type` deferred far into the future on queue q, noted as its disabled type's."""
    raw = make_task(n)
    broker.client.zadd(broker.keys.delayed("q"), {delayed_member(0, raw): FAR_MS})
    broker.limits.note_disabled("q", task_type, 0, raw, 60_000)
    return delayed_member(0, raw)


def test_a_type_still_disabled_wakes_nothing_and_one_enabled_again_is_due_now(broker):
    members = [deferred(broker, n) for n in range(3)]
    other = deferred(broker, 9, task_type="x.other")
    assert broker.limits.wake_enabled("q", disabled=lambda task_type: True) == 0
    assert broker.limits.wake_enabled("q", disabled=lambda task_type: task_type == "x.other") == 3
    now_ms = broker.inspect.server_time_ms()
    scores = dict(broker.client.zrange(broker.keys.delayed("q"), 0, -1, withscores=True))
    assert all(scores[member] <= now_ms for member in members)
    assert scores[other] == FAR_MS
    assert broker.client.smembers(broker.keys.disabled_types("q")) == {b"x.other"}
    assert not broker.client.exists(broker.keys.disabled("q", "x.slow"))


def test_a_noted_task_no_longer_delayed_is_not_put_back(broker):
    member = deferred(broker, 1)
    broker.client.zrem(broker.keys.delayed("q"), member)  # promoted at its recheck, claimed, or cancelled
    assert broker.limits.wake_enabled("q", disabled=lambda task_type: False) == 0
    assert broker.client.zcard(broker.keys.delayed("q")) == 0


def test_a_set_of_the_wrong_type_is_a_misconfigured_key_named_with_its_type_and_nothing_moves(broker):
    member = deferred(broker, 1)
    broker.client.delete(broker.keys.disabled("q", "x.slow"))
    broker.client.set(broker.keys.disabled("q", "x.slow"), "not a set")
    with pytest.raises(MisconfiguredKey, match=r"wake_enabled.*disabled:x\.slow \(string\)"):
        broker.limits.wake_enabled("q", disabled=lambda task_type: False)
    with pytest.raises(MisconfiguredKey, match=r"note_disabled.*disabled:x\.slow \(string\)"):
        broker.limits.note_disabled("q", "x.slow", 0, make_task(2), 60_000)
    assert broker.client.zscore(broker.keys.delayed("q"), member) == FAR_MS


@pytest.mark.django_db(transaction=True)
def test_a_disabled_backlog_is_deferred_once_and_runs_as_soon_as_the_type_is_enabled(broker, consumer_in_thread):
    TaskType.objects.create(name="held.back", handler="demo.echo")
    tasks = producer.enqueue("held.back", ["x"], queue="q", count=200, broker=broker)
    TaskType.objects.filter(name="held.back").update(enabled=False)  # the producer refuses a disabled type
    with consumer_in_thread(queues=["q"], concurrency=4):
        wait_until(lambda: broker.client.zcard(broker.keys.delayed("q")) == 200, 15, message="all to be held back")
        due_ms = [score for _, score in broker.client.zrange(broker.keys.delayed("q"), 0, -1, withscores=True)]
        # not claimed and deferred again every few seconds
        assert min(due_ms) >= broker.inspect.server_time_ms() + 240_000
        TaskType.objects.filter(name="held.back").update(enabled=True)
        wait_until(
            lambda: all((broker.records.get_result(t.id) or {}).get("status") == "SUCCESSFUL" for t in tasks),
            20,
            message="every task to run once the type is enabled",
        )
    assert {broker.records.get_result(t.id)["attempts"] for t in tasks} == {"1"}
