"""Scenario 5: a task that SIGKILLs every consumer that runs it."""

from __future__ import annotations

import time

import pytest

from tasks_app import producer
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.leases import MAX_RECOVERIES
from tests.chaos.harness import Fleet, Summary, scaled, statuses, tally, wait_finished

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


def respawn_until_dead_lettered(fleet: Fleet, pill: str, generation: dict[str, int]) -> int:
    """Respawn, under a new id, every consumer the pill kills until it is dead-lettered; return the deaths."""
    deaths = 0
    deadline = time.monotonic() + 120
    while statuses(fleet.broker, [pill])[pill] != "FAILED":
        assert time.monotonic() < deadline, f"the pill was never dead-lettered\n{fleet.logs()}"
        for name, number in generation.items():
            process = fleet.processes[f"{name}{number}"]
            if process.process.poll() is not None:
                deaths += 1
                generation[name] = number + 1
                fleet.spawn(f"{name}{number + 1}")
        time.sleep(0.1)
    return deaths


@pytest.mark.timeout(180)
def test_poison_pill_is_dead_lettered_after_the_recovery_limit(chaos_broker, consumer_process):
    broker = chaos_broker
    # Several threads and a prefetch: tasks claimed or running beside the pill die with it, yet
    # only the pill is blamed (after a first recovery each runs as a suspect, one per consumer).
    fleet = Fleet(consumer_process, broker, concurrency=4, prefetch=4)
    generation = {"p": 0, "q": 0}
    for name in generation:
        fleet.spawn(f"{name}0")
    fleet.wait_registered(["p0", "q0"])
    good = [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": 0.01}, count=scaled(100, 1000) // 2)]
    pill = producer.enqueue("test.kill_self")[0].id
    good += [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": 0.01}, count=scaled(100, 1000) // 2)]

    deaths = respawn_until_dead_lettered(fleet, pill, generation)
    wait_finished(broker, good, scaled(120, 600), fleet)

    result = tally(broker, good)
    dead = [decode_task(raw) for raw, _ in broker.inspect.list_dead("default")]
    Summary(
        "5-poison-pill",
        len(good) + 1,
        result.total_runs + deaths,
        len(result.lost),
        len(result.duplicates),
        len(result.duplicates),
        None,
        {"consumers_killed_by_pill": deaths, "dead_lettered": len(dead)},
    ).report()
    assert [task.id for task in dead] == [pill]
    assert f"recovered {MAX_RECOVERIES + 1} times" in dead[0].dead_reason
    assert deaths == MAX_RECOVERIES + 1
    assert broker.records.get_result(pill)["dead_reason"] == dead[0].dead_reason
    assert result.lost == [], f"tasks that were not the pill failed: {result.lost[:5]}"
