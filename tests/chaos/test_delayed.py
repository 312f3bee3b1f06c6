"""Scenario 7: delayed tasks due after more than a lease, with a consumer killed while it runs promoted ones."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.producer import TaskRequest
from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled, seeded_rng, started_on, tally, wait_finished
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

TASK_SLEEP_S = 0.02
# Never-killed tasks start this soon after their due time (the scheduler wakes at the next due time).
ON_TIME_P99_S = 0.5
ON_TIME_MAX_S = 1.5
# Tasks the killed consumer held start again this soon after their due time: a lease, the reap, a run.
RECOVERED_MAX_S = LEASE_S + 1.5


def percentile(values: list[float], fraction: float) -> float:
    """The value below which `fraction` of the values lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def start_lateness(runs: list[dict], due_ms: dict[str, int], held: set[str]) -> tuple[list, list[float], list[float]]:
    """Runs that started early, and how late (s) the last start of each task was: other tasks, then those `held`."""
    early = [run for run in runs if run["start_ms"] < due_ms[run["task_id"]]]
    last_start_ms: dict[str, float] = {}
    for run in runs:
        last_start_ms[run["task_id"]] = max(run["start_ms"], last_start_ms.get(run["task_id"], 0))
    on_time_s = [(start - due_ms[tid]) / 1000 for tid, start in last_start_ms.items() if tid not in held]
    recovered_s = [(last_start_ms[tid] - due_ms[tid]) / 1000 for tid in held]
    return early, on_time_s, recovered_s


def enqueue_due_after_a_lease(rng) -> dict[str, int]:
    """Enqueue tasks due at random times more than a lease from now; return their due times (ms) by id."""
    requests = [
        TaskRequest(
            "test.record",
            kwargs={"sleep_s": TASK_SLEEP_S},
            delay_s=rng.uniform(LEASE_S * 1.2, LEASE_S * scaled(2.5, 15)),
        )
        for _ in range(scaled(300, 3000))
    ]
    return {t.id: t.run_after_ms for t in producer.enqueue_many(requests)}


@pytest.mark.timeout(180)
@pytest.mark.alone  # how late the tasks start is what it checks: load elsewhere would delay them
def test_delayed_tasks_run_once_and_never_early_across_a_kill(chaos_broker, consumer_process):
    broker = chaos_broker
    fleet = Fleet(consumer_process, broker, concurrency=4, prefetch=4)
    for consumer_id in ("d1", "d2"):
        fleet.spawn(consumer_id)
    fleet.wait_registered(["d1", "d2"])
    due_ms = enqueue_due_after_a_lease(seeded_rng("7-delayed-across-kill"))
    wait_until(lambda: started_on(broker, "d1"), 30, message="d1 to start a promoted task")
    held, running = fleet.kill_while_running("d1")
    fleet.spawn("d1-respawned")
    ids = list(due_ms)
    wait_finished(broker, ids, scaled(120, 600), fleet)

    result = tally(broker, ids)
    early, on_time_s, recovered_s = start_lateness(recorded_runs(broker), due_ms, held)
    Summary(
        "7-delayed-across-kill",
        len(ids),
        result.total_runs,
        len(result.lost),
        len(result.duplicates),
        len(running),
        None,
        {
            "held_at_kill": len(held),
            "early": len(early),
            "lateness_p99_s": round(percentile(on_time_s, 0.99), 3),
            "lateness_max_s": round(max(on_time_s), 3),
            "recovered_lateness_max_s": round(max(recovered_s), 3),
        },
    ).report()
    assert early == [], f"ran before their due time: {early[:3]}"
    assert result.lost == []
    assert result.duplicates <= running, f"ran twice, not running on the killed consumer: {result.duplicates - running}"
    assert percentile(on_time_s, 0.99) <= ON_TIME_P99_S and max(on_time_s) <= ON_TIME_MAX_S, (
        f"late: p99 {percentile(on_time_s, 0.99):.3f} s, max {max(on_time_s):.3f} s"
    )
    assert max(recovered_s) <= RECOVERED_MAX_S, f"recovered tasks started up to {max(recovered_s):.2f} s late"
