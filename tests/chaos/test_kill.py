"""Scenarios 1 and 2: consumers killed with SIGKILL (and one SIGTERM) while they work, on one queue or many."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Sequence

import pytest

from tasks_app import producer
from tasks_app.producer import TaskRequest
from tasks_app.protocol.broker import Broker
from tests.chaos.harness import (
    LEASE_S,
    Fleet,
    Summary,
    scaled,
    seeded_rng,
    settled_leftovers,
    statuses,
    tally,
    wait_finished,
)
from tests.support.handlers import runs_key
from tests.support.processes import ConsumerProcess, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

TASK_SLEEP_S = 0.01
SPREAD_TASK_SLEEP_S = 0.005


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
    summary = Summary(
        scenario, len(task_ids), result.total_runs, len(result.lost), len(result.duplicates), len(allowed), recovery_s
    )
    summary.report()
    assert result.lost == [], f"lost tasks: {result.lost[:10]}"
    assert result.duplicates <= allowed, (
        f"ran twice without being held by a killed consumer: {result.duplicates - allowed}"
    )
    return summary


def enqueue_everywhere(queues: list[str], per_queue: int, sleep_s: float) -> list[str]:
    """Enqueue `per_queue` recorded tasks on each queue; return their ids."""
    return [
        t.id
        for queue in queues
        for t in producer.enqueue("test.record", kwargs={"sleep_s": sleep_s}, count=per_queue, queue=queue)
    ]


def assert_all_done(broker: Broker, fleet: Fleet, ids: list[str], label: str, allowed: set[str] | None) -> Summary:
    """Every task ran and succeeded, every structure of every queue is empty; report the run."""
    wait_finished(broker, ids, scaled(90, 180), fleet)
    left = settled_leftovers(broker, fleet.queues)
    result = tally(broker, ids)
    summary = Summary(
        label,
        len(ids),
        sum(result.runs[task_id] for task_id in ids),
        len(result.lost),
        len(result.duplicates & set(ids)),
        len(allowed) if allowed is not None else len(ids),
        extra={"queues": len(fleet.queues), "left_in_redis": left},
    )
    summary.report()
    lost = result.lost[:10]
    assert not lost, (
        f"{label}: lost tasks (status, runs): {[(statuses(broker, lost)[t], result.runs[t]) for t in lost]}"
    )
    assert all(result.runs[task_id] >= 1 for task_id in ids), f"{label}: a task never ran"
    assert left == {}, f"{label}: left in Redis after every task finished: {left}\n{fleet.logs()}"
    if allowed is not None:
        extra = (result.duplicates & set(ids)) - allowed
        assert not extra, f"{label}: ran twice without being held by the killed consumer: {sorted(extra)[:5]}"
    return summary


def kill_one_of_two(
    broker: Broker,
    consumer_process: Callable[..., ConsumerProcess],
    queues: list[str],
    *,
    scenario: str,
    run: int,
    per_queue: int,
) -> Summary:
    """Two consumers on every queue (4 threads, lease 2 s); one is SIGKILLed (its process group) halfway."""
    fleet = Fleet(consumer_process, broker, queues, concurrency=4, prefetch=None)
    victim, survivor = f"r{run}-a", f"r{run}-b"
    for consumer_id in (victim, survivor):
        fleet.spawn(consumer_id)
    fleet.wait_registered([victim, survivor])
    runs_before = broker.client.llen(runs_key())
    ids = enqueue_everywhere(queues, per_queue, SPREAD_TASK_SLEEP_S)
    wait_until(
        lambda: broker.client.llen(runs_key()) - runs_before >= len(ids) // 2, 60, message="half of the tasks to start"
    )
    held = fleet.kill(victim)
    summary = assert_all_done(broker, fleet, ids, f"{scenario}-run-{run}", held)
    assert fleet.processes[survivor].terminate() == 0, fleet.processes[survivor].log()
    return summary


@pytest.mark.timeout(240)
def test_kill_9_mid_batch_loses_nothing(chaos_broker, consumer_process):
    kill_mid_batch(chaos_broker, consumer_process, scenario="1-kill-9-mid-batch", tasks=scaled(2000, 10000))


class SteadyLoad:
    """About 200 tasks/s of 5-100 ms each (10 every 50 ms): every consumer is always running some."""

    def __init__(self, rng: random.Random, queues: Sequence[str] = ("default",)) -> None:
        self.durations = random.Random(rng.random())  # its own stream: the kill choices replay whatever the timing
        self.queues = list(queues)
        self.task_ids: list[str] = []
        self._last_batch_at = 0.0

    def __call__(self) -> None:
        """Enqueue the next batch if it is due."""
        if time.monotonic() - self._last_batch_at < 0.05:
            return
        self._last_batch_at = time.monotonic()
        requests = [
            TaskRequest(
                "test.record",
                kwargs={"sleep_s": round(self.durations.uniform(0.005, 0.1), 3)},
                queue=self.durations.choice(self.queues),
            )
            for _ in range(10)
        ]
        self.task_ids.extend(t.id for t in producer.enqueue_many(requests))


def steady_load_with_kills(
    fleet: Fleet, rng: random.Random, current: dict[str, str], duration_s: float
) -> tuple[list[str], set[str], list[float]]:
    """Enqueue ~200 tasks/s on the fleet's queues; every 0.5-3 s SIGKILL a random consumer while a handler of its
    runs, and respawn it.

    Returns the task ids, the tasks running on the killed consumers, and each kill's recovery time.
    """
    load = SteadyLoad(rng, fleet.queues)
    running_at_kills: set[str] = set()
    recovering: dict[str, None] = {}
    recovery_s: list[float] = []

    def keep_going() -> None:
        """Keep the load up and time every recovery, also while waiting for the next victim to look busy."""
        load()
        for consumer_id in [cid for cid in recovering if not fleet.held(cid)]:
            recovery_s.append(time.monotonic() - fleet.killed_at[consumer_id])
            del recovering[consumer_id]

    end = time.monotonic() + duration_s
    next_kill = time.monotonic() + rng.uniform(0.5, 3)
    while time.monotonic() < end:
        keep_going()
        if time.monotonic() >= next_kill:
            name = rng.choice(sorted(current))
            _, running = fleet.kill_while_running(current[name], between_looks=keep_going)
            running_at_kills |= running
            recovering[current[name]] = None
            current[name] = f"{name}{int(current[name][1:]) + 1}"
            fleet.spawn(current[name])
            next_kill = time.monotonic() + rng.uniform(0.5, 3)
        time.sleep(0.01)
    recovery_s += [fleet.recovered_within(consumer_id, LEASE_S + 1) for consumer_id in recovering]
    return load.task_ids, running_at_kills, recovery_s


def random_kills(fleet: Fleet, scenario: str, duration_s: float) -> None:
    """Three consumers under a steady load, one SIGKILLed at random moments while its handlers run, and respawned:
    nothing is lost, only tasks held at a kill run twice, and each kill's tasks are back within lease + 1 s."""
    broker = fleet.broker
    rng = seeded_rng(scenario)
    current = {name: f"{name}0" for name in ("a", "b", "c")}
    for consumer_id in current.values():
        fleet.spawn(consumer_id)
    fleet.wait_registered(current.values())

    task_ids, running_at_kills, recovery_s = steady_load_with_kills(fleet, rng, current, duration_s)
    wait_finished(broker, task_ids, scaled(120, 600), fleet)

    result = tally(broker, task_ids)
    allowed = fleet.in_flight_at_kills
    Summary(
        scenario,
        len(task_ids),
        result.total_runs,
        len(result.lost),
        len(result.duplicates),
        len(allowed),
        max(recovery_s, default=None),
        {"kills": len(fleet.killed_at), "running_at_kills": len(running_at_kills), "queues": len(fleet.queues)},
    ).report()
    assert fleet.killed_at, "the run was too short to kill anything"
    assert result.lost == [], f"lost tasks: {result.lost[:10]}"
    assert result.duplicates <= allowed, (
        f"ran twice without being held by a killed consumer: {result.duplicates - allowed}"
    )
    assert max(recovery_s) <= LEASE_S + 1, f"a killed consumer's tasks took {max(recovery_s):.1f} s to be recovered"


@pytest.mark.alone  # it bounds recovery at lease + 1 s after each kill: a loaded machine delays the reaper
@pytest.mark.timeout(240)
def test_random_kills_lose_nothing(chaos_broker, consumer_process):
    random_kills(Fleet(consumer_process, chaos_broker, concurrency=8, prefetch=8), "2-random-kills", scaled(10, 90))


@pytest.mark.alone  # as above; and its tasks spread over 100 queues that each consumer claims from
@pytest.mark.timeout(300)
def test_random_kills_on_a_hundred_queues_lose_nothing(chaos_broker, consumer_process):
    queues = [f"q{n:03}" for n in range(100)]
    fleet = Fleet(consumer_process, chaos_broker, queues, concurrency=4, prefetch=None)
    random_kills(fleet, "2-random-kills-100-queues", scaled(10, 60))
    assert settled_leftovers(chaos_broker, queues, dead=False) == {}, fleet.logs()


@pytest.mark.timeout(240)
def test_kill_9_with_several_queues_runs_every_recovered_task(chaos_broker, consumer_process):
    """Six queues drain before the kill's tasks are recovered: every queue's suspects must still run."""
    kill_one_of_two(
        chaos_broker,
        consumer_process,
        [f"q{n}" for n in range(6)],
        scenario="1-kill-9-several-queues",
        run=0,
        per_queue=scaled(30, 100),
    )
