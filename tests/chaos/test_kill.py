"""Scenarios 1 and 2: consumers killed with SIGKILL (and one SIGTERM) while they work."""
from __future__ import annotations

import signal
import time

import pytest

from tasks_app import producer
from tasks_app.producer import TaskRequest
from tests.support.handlers import runs_key
from tests.support.processes import wait_until

from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled, seeded_rng, tally, wait_finished

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
    """A steady load; at random moments a random consumer is SIGKILLed while its handlers run, and respawned."""
    broker = chaos_broker
    rng = seeded_rng("2-random-kills")
    fleet = Fleet(consumer_process, broker, concurrency=8, prefetch=8)
    current = {name: f"{name}0" for name in ("a", "b", "c")}
    for consumer_id in current.values():
        fleet.spawn(consumer_id)
    fleet.wait_registered(current.values())

    task_ids: list[str] = []
    running_at_kills: set[str] = set()
    recovering: dict[str, None] = {}
    recovery_s: list[float] = []
    end = time.monotonic() + scaled(10, 90)
    next_kill = time.monotonic() + rng.uniform(0.5, 3)
    while time.monotonic() < end:
        # About 200 tasks/s of 5-100 ms each: every consumer is always running some.
        requests = [TaskRequest("test.record", kwargs={"sleep_s": round(rng.uniform(0.005, 0.1), 3)})
                    for _ in range(10)]
        task_ids += [t.id for t in producer.enqueue_many(requests)]
        if time.monotonic() >= next_kill:
            name = rng.choice(sorted(current))
            _, running = fleet.kill_while_running(current[name])
            running_at_kills |= running
            recovering[current[name]] = None
            current[name] = f"{name}{int(current[name][1:]) + 1}"
            fleet.spawn(current[name])
            next_kill = time.monotonic() + rng.uniform(0.5, 3)
        for consumer_id in [cid for cid in recovering if not fleet.held(cid)]:
            recovery_s.append(time.monotonic() - fleet.killed_at[consumer_id])
            del recovering[consumer_id]
        time.sleep(0.05)
    recovery_s += [fleet.recovered_within(consumer_id, LEASE_S + 1) for consumer_id in recovering]
    wait_finished(broker, task_ids, scaled(120, 600), fleet)

    result = tally(broker, task_ids)
    allowed = fleet.in_flight_at_kills
    Summary("2-random-kills", len(task_ids), result.total_runs, len(result.lost), len(result.duplicates),
            len(allowed), max(recovery_s, default=None),
            {"kills": len(fleet.killed_at), "running_at_kills": len(running_at_kills)}).report()
    assert fleet.killed_at, "the run was too short to kill anything"
    assert result.lost == [], f"lost tasks: {result.lost[:10]}"
    assert result.duplicates <= allowed, f"ran twice without being held by a killed consumer: {result.duplicates - allowed}"
    assert max(recovery_s) <= LEASE_S + 1, f"a killed consumer's tasks took {max(recovery_s):.1f} s to be recovered"
