"""Scenario 3: a consumer frozen with SIGSTOP for three leases, then thawed with SIGCONT."""

from __future__ import annotations

import signal
import time

import pytest

from tasks_app import producer
from tests.chaos.harness import LEASE_S, Fleet, Summary, scaled, tally, task_ids, wait_finished
from tests.support.handlers import runs_key
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]


def freeze(fleet: Fleet, consumer_id: str) -> tuple[set[str], float, float]:
    """SIGSTOP a consumer; return the tasks it holds, when it was frozen and its lease deadline (ms, Redis clock)."""
    broker = fleet.broker
    held = fleet.freeze(consumer_id)
    frozen_ms = broker.inspect.server_time_ms()
    lease_deadline_ms = broker.client.zscore(broker.keys.consumers("default"), consumer_id)
    assert lease_deadline_ms is not None, f"{consumer_id} had no lease when frozen"
    return held, frozen_ms, lease_deadline_ms


def started_before(fleet: Fleet, consumer_id: str, frozen_ms: float) -> set[str]:
    """Tasks whose handler began on the consumer before it was frozen.

    Read once the run is over: a handler frozen between reading the clock and pushing its record
    pushes it only after the thaw, with the start time it read before the freeze.
    """
    runs = recorded_runs(fleet.broker)
    return {run["task_id"] for run in runs if run["consumer"] == consumer_id and run["start_ms"] <= frozen_ms}


def thaw_after_three_leases(fleet: Fleet, consumer_id: str, frozen_at: float) -> float:
    """Check the frozen consumer's tasks are back within lease + 1 s and it is reaped; SIGCONT it 3 leases in.

    Returns the seconds its tasks took to be back.
    """
    broker = fleet.broker
    wait_until(
        lambda: not fleet.held(consumer_id),
        LEASE_S + 1,
        interval_s=0.02,
        message="the frozen consumer's tasks to be back in pending within lease + 1 s",
    )
    recovery_s = time.monotonic() - frozen_at
    time.sleep(max(0.0, frozen_at + 3 * LEASE_S - time.monotonic()))
    assert consumer_id in [m.decode() for m in broker.client.zrange(broker.keys.reaped("default"), 0, -1)]
    fleet.processes[consumer_id].signal(signal.SIGCONT)
    return recovery_s


def start_three_consumers_under_load(fleet: Fleet) -> list[str]:
    """Start consumers frozen, b and c, enqueue 0.3 s tasks and wait until some run; return their ids."""
    for consumer_id in ("frozen", "b", "c"):
        fleet.spawn(consumer_id)
    fleet.wait_registered(["frozen", "b", "c"])
    ids = [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": 0.3}, count=scaled(300, 2000))]
    wait_until(lambda: fleet.broker.client.llen(runs_key()) >= 30, 60, message="tasks to start")
    return ids


@pytest.mark.timeout(180)
# A worker frozen between its lease check and its handler's first line (a few round trips to Redis)
# starts that task after the thaw: load elsewhere makes that moment long enough to be hit.
@pytest.mark.alone
def test_frozen_consumer_is_reaped_and_comes_back_under_a_new_id(chaos_broker, consumer_process):
    broker = chaos_broker
    fleet = Fleet(consumer_process, broker, concurrency=4, prefetch=4, LOG_LEVEL="INFO")
    ids = start_three_consumers_under_load(fleet)

    frozen_at = time.monotonic()
    held_at_freeze, frozen_ms, lease_deadline_ms = freeze(fleet, "frozen")
    others_held = {cid: task_ids(fleet.held(cid)) for cid in ("b", "c")}
    recovery_s = thaw_after_three_leases(fleet, "frozen", frozen_at)

    fleet.wait_registered(["frozen.1", "b", "c"], timeout_s=LEASE_S * 3)
    wait_finished(broker, ids, scaled(120, 600), fleet)
    log = fleet.processes["frozen"].log()
    running_at_freeze = started_before(fleet, "frozen", frozen_ms) & held_at_freeze

    result = tally(broker, ids)
    late_acks = log.count("its outcome here was not applied")
    started_late = [r for r in recorded_runs(broker) if r["consumer"] == "frozen" and r["start_ms"] > lease_deadline_ms]
    Summary(
        "3-frozen-consumer",
        len(ids),
        result.total_runs,
        len(result.lost),
        len(result.duplicates),
        len(running_at_freeze),
        recovery_s,
        {
            "late_acks_lost": late_acks,
            "held_at_freeze": len(held_at_freeze),
            "started_after_lease_expired": len(started_late),
        },
    ).report()
    assert running_at_freeze, "the consumer was frozen while running nothing"
    assert result.lost == []
    assert started_late == [], f"started on the frozen consumer after its lease expired: {started_late[:2]}"
    assert result.duplicates <= running_at_freeze, (
        f"ran twice, not running when frozen: {result.duplicates - running_at_freeze}"
    )
    assert late_acks >= 1, "the thawed consumer's finished tasks should have found their acks lost"
    check_identities_after_thaw(fleet, log, others_held, result.duplicates)


def check_identities_after_thaw(fleet: Fleet, log: str, others_held: dict[str, set[str]], duplicates: set[str]) -> None:
    """The thawed consumer goes on under a new id; the others were never presumed dead nor ran a task twice."""
    live = {c["id"] for c in fleet.broker.inspect.queue_stats("default").consumers}
    assert "consumer frozen lost its lease" in log and "continuing as frozen.1" in log
    assert {"frozen.1", "b", "c"} <= live and "frozen" not in live
    for cid in ("b", "c"):
        assert "lost its lease" not in fleet.processes[cid].log(), f"{cid} was wrongly presumed dead"
        assert not (others_held[cid] & duplicates), f"a task {cid} held ran twice"
    assert not fleet.held("frozen"), "the old identity's list must stay empty"
