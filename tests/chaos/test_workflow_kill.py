"""A chord through kills and duplicate deliveries: its callback runs exactly once, with every result in order."""

from __future__ import annotations

import json

import pytest

from tasks_app import workflows
from tasks_app.producer import TaskRequest
from tasks_app.protocol.broker import Broker
from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled
from tests.support.processes import wait_until
from tests.support.workflow_handlers import kill_key, runs_key

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

MEMBERS = scaled(100, 1000)
DUPLICATED = 10
QUEUES = ("wf-a", "wf-b")
HANDLERS = "tests.support.handlers,tests.support.workflow_handlers"


def chord_through_kills(broker: Broker, consumer_process, scenario: str) -> None:
    """Run a chord of MEMBERS over two queues on four consumers; two die at a member's settle, ten are pushed twice."""
    members = [TaskRequest("wf.value", args=[n], kwargs={"sleep_s": 0.02}, queue=QUEUES[n % 2]) for n in range(MEMBERS)]
    handle = workflows.chord(members, then=TaskRequest("wf.collect", queue=QUEUES[0])).enqueue()
    client = broker.client
    # Duplicate deliveries: the same envelopes pushed a second time, as a producer retrying blindly would.
    duplicated = [raw for queue in QUEUES for raw in client.lrange(broker.keys.pending(queue), 0, DUPLICATED // 2 - 1)]
    for queue in QUEUES:
        client.lpush(broker.keys.pending(queue), *client.lrange(broker.keys.pending(queue), 0, DUPLICATED // 2 - 1))
    assert len(duplicated) == DUPLICATED
    # One consumer dies after a member's handler returned, before its end is recorded; another after
    # the record and its pushes, before the ack.
    client.set(kill_key("before"), "0.0.20")
    client.set(kill_key("after"), "0.0.61")

    fleet = Fleet(consumer_process, broker, QUEUES, concurrency=4, prefetch=4, TASK_HANDLER_MODULES=HANDLERS)
    ids = [f"c{n}" for n in range(1, 5)]
    for consumer_id in ids:
        fleet.spawn(consumer_id)
    wait_until(
        lambda: sum(fleet.processes[c].process.poll() is not None for c in ids) == 2,
        scaled(120, 300),
        message="two consumers to kill themselves at a member's settle",
    )
    assert not client.exists(kill_key("before")) and not client.exists(kill_key("after"))
    for consumer_id in ids:
        if fleet.processes[consumer_id].process.poll() is not None:
            fleet.spawn(f"{consumer_id}-respawned")

    wait_until(
        lambda: workflows.get_workflow(handle.id).status == workflows.SUCCESSFUL,
        scaled(120, 300),
        message=lambda: f"the chord to end: {workflows.get_workflow(handle.id).counts}",
    )
    wait_until(lambda: not any(fleet.held(c) for c in fleet.processes), LEASE_S * 10, message="every task settled")
    runs = [json.loads(line) for line in client.lrange(runs_key(), 0, -1)]
    callbacks = [run for run in runs if run["type"] == "wf.collect"]
    state = workflows.get_workflow(handle.id)
    extra = {"callback_runs": len(callbacks), "pushed_twice": DUPLICATED, "killed_at_settle": 2}
    # Every run beyond one a task is by design: a duplicate pushed, or a task held by a consumer killed.
    Summary(scenario, MEMBERS + 1, len(runs), 0, len(runs) - MEMBERS - 1, len(runs) - MEMBERS - 1, extra=extra).report()
    assert len(callbacks) == 1, callbacks
    assert callbacks[0]["args"] == [list(range(MEMBERS))]
    assert callbacks[0]["task_id"] == handle.task_ids["0.1"]
    assert state.counts == {workflows.SUCCESSFUL: MEMBERS + 1}
    assert state.result == MEMBERS
    member_runs = {run["task_id"] for run in runs if run["type"] == "wf.value"}
    assert member_runs == {handle.task_ids[f"0.0.{n}"] for n in range(MEMBERS)}


def test_a_chord_calls_back_once_through_kills_and_duplicates(chaos_broker, consumer_process):
    chord_through_kills(chaos_broker, consumer_process, "workflow_chord_kills")


def test_a_chord_calls_back_once_on_redis_cluster(cluster_broker, consumer_process):
    slots = {cluster_broker.client.keyslot(cluster_broker.keys.pending(queue)) for queue in QUEUES}
    workflow_slot = cluster_broker.client.keyslot(cluster_broker.keys.workflow("any")[0])
    assert len(slots) == 2 and workflow_slot not in slots
    chord_through_kills(cluster_broker, consumer_process, "workflow_chord_kills_cluster")
