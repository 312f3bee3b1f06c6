"""Scenarios 1 and 2: consumers killed with SIGKILL (and one SIGTERM) while they work."""
from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from tasks_app import producer
from tests.support.handlers import runs_key
from tests.support.processes import wait_until

from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled, tally, wait_finished

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

TASK_SLEEP_S = 0.01


def kill_mid_batch(broker, consumer_process, *, scenario: str, tasks: int, consumers: int = 4) -> Summary:
    """Run `tasks` ~10 ms tasks on `consumers` x 8 threads; at 50% SIGKILL two, SIGTERM one, respawn them."""
    fleet = Fleet(consumer_process, broker, concurrency=8, prefetch=8)
    ids = [f"c{n}" for n in range(1, consumers + 1)]
    for consumer_id in ids:
        fleet.spawn(consumer_id)
    fleet.wait_registered(ids)
    task_ids = [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": TASK_SLEEP_S}, count=tasks)]
    wait_until(lambda: broker.client.llen(runs_key()) >= tasks // 2, 120, message="half of the tasks to start")

    snapshots = {consumer_id: fleet.kill(consumer_id) for consumer_id in ids[:2]}
    fleet.processes[ids[2]].signal(signal.SIGTERM)
    recovery_s = max(fleet.recovered_within(consumer_id, LEASE_S + 1) for consumer_id in snapshots)
    assert fleet.processes[ids[2]].wait(30) == 0, fleet.processes[ids[2]].log()
    assert not fleet.held(ids[2]), "a consumer stopped with SIGTERM left tasks in its list"
    for consumer_id in ids[:3]:
        fleet.spawn(f"{consumer_id}-respawned")
    wait_finished(broker, task_ids, scaled(120, 600), fleet)

    result = tally(broker, task_ids)
    allowed = set().union(*snapshots.values())
    summary = Summary(scenario, len(task_ids), result.total_runs, len(result.lost), len(result.duplicates),
                      len(allowed), recovery_s)
    summary.report()
    assert result.lost == [], f"lost tasks: {result.lost[:10]}"
    assert result.duplicates <= allowed, f"ran twice without being held by a killed consumer: {result.duplicates - allowed}"
    return summary


@pytest.mark.timeout(240)
def test_kill_9_mid_batch_loses_nothing(chaos_broker, consumer_process):
    kill_mid_batch(chaos_broker, consumer_process, scenario="1-kill-9-mid-batch", tasks=scaled(2000, 10000))


@pytest.mark.timeout(240)
def test_random_kills_lose_nothing(chaos_broker, consumer_process):
    broker = chaos_broker
    fleet = Fleet(consumer_process, broker, concurrency=8, prefetch=8)
    names = ["a", "b", "c"]
    current = {name: f"{name}0" for name in names}
    for consumer_id in current.values():
        fleet.spawn(consumer_id)
    fleet.wait_registered(current.values())

    rng = random.Random()
    task_ids: list[str] = []
    recovering: dict[str, None] = {}
    recovery_s: list[float] = []
    end = time.monotonic() + scaled(10, 90)
    next_kill = time.monotonic() + rng.uniform(0.5, 3)
    while time.monotonic() < end:
        task_ids += [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": TASK_SLEEP_S}, count=40)]
        if time.monotonic() >= next_kill:
            name = rng.choice(names)
            fleet.kill(current[name])
            recovering[current[name]] = None
            current[name] = f"{name}{int(current[name][1:]) + 1}"
            fleet.spawn(current[name])
            next_kill = time.monotonic() + rng.uniform(0.5, 3)
        for consumer_id in list(recovering):
            if not fleet.held(consumer_id):
                recovery_s.append(time.monotonic() - fleet.killed_at[consumer_id])
                del recovering[consumer_id]
        time.sleep(0.1)
    for consumer_id in recovering:
        recovery_s.append(fleet.recovered_within(consumer_id, LEASE_S + 1))
    wait_finished(broker, task_ids, scaled(120, 600), fleet)

    result = tally(broker, task_ids)
    allowed = fleet.in_flight_at_kills
    Summary("2-random-kills", len(task_ids), result.total_runs, len(result.lost), len(result.duplicates),
            len(allowed), max(recovery_s, default=None), {"kills": len(fleet.killed_at)}).report()
    assert fleet.killed_at, "the run was too short to kill anything"
    assert result.lost == [], f"lost tasks: {result.lost[:10]}"
    assert result.duplicates <= allowed, f"ran twice without being held by a killed consumer: {result.duplicates - allowed}"
    assert max(recovery_s) <= LEASE_S + 1
