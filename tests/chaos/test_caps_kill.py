"""max_running while consumers holding slots are killed with SIGKILL, seen from the handlers' own starts and ends."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker, get_broker
from tests.chaos.harness import LEASE_S, Fleet, scaled, seeded_rng, statuses
from tests.support.processes import wait_until
from tests.support.throttle_handlers import HOLD_KEY_SUFFIX, MODULES, most_at_once, spans

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

CAP = 2


def open_runs(broker: Broker, fleet: Fleet) -> Counter[int]:
    """Per pid of a live consumer, how many of its runs started and have not ended."""
    events = spans(broker)
    ended = {(e["task_id"], e["pid"]) for e in events if e["event"] == "end"}
    live = {process.pid for process in fleet.processes.values()}
    return Counter(
        e["pid"] for e in events if e["event"] == "start" and (e["task_id"], e["pid"]) not in ended and e["pid"] in live
    )


def runs_going(broker: Broker, fleet: Fleet, timeout_s: float = 30) -> Counter[int]:
    """The open runs once some capped run is going, from one read (a second read could find it ended)."""
    deadline = time.monotonic() + timeout_s
    while not (going := open_runs(broker, fleet)):
        assert time.monotonic() < deadline, "a capped run to be going"
        time.sleep(0.01)
    return going


def closed_at_kills(events: list[dict], killed_ms: dict[int, float]) -> list[dict]:
    """The events, with an end at its process's kill for every run a SIGKILL cut short."""
    ended = {(e["task_id"], e["pid"]) for e in events if e["event"] == "end"}
    cut = [
        {**e, "event": "end", "t_ms": killed_ms[e["pid"]]}
        for e in events
        if e["event"] == "start" and (e["task_id"], e["pid"]) not in ended and e["pid"] in killed_ms
    ]
    return events + cut


@pytest.mark.parametrize("handler", ["test.span", "test.async_span"])
def test_a_cap_holds_while_consumers_holding_its_slots_are_killed_and_their_tasks_rerun(
    broker, consumer_process, handler
):
    rng = seeded_rng(f"caps_kill[{handler}]")
    TaskType.objects.create(name="capped", handler=handler, max_running=CAP)
    fleet = Fleet(consumer_process, broker, concurrency=4, prefetch=4, TASK_HANDLER_MODULES=MODULES)
    fleet.env["TASKS_THROTTLE_RECHECK_S"] = "1"
    ids = ["c1", "c2", "c3"]
    for consumer_id in ids:
        fleet.spawn(consumer_id)
    fleet.wait_registered(ids)
    tasks = [t.id for t in producer.enqueue("capped", kwargs={"sleep_s": 0.2}, count=scaled(30, 200))]

    killed_ms: dict[int, float] = {}
    for round_ in range(scaled(2, 8)):
        # A consumer in the middle of a capped run: it holds one of the slots when it dies.
        pid = rng.choice(sorted(runs_going(broker, fleet)))
        [victim] = [cid for cid, process in fleet.processes.items() if process.pid == pid]
        fleet.kill(victim)
        killed_ms[pid] = broker.inspect.server_time_ms()
        del fleet.processes[victim]
        fleet.spawn(f"{victim}-{round_}")

    def unfinished() -> str:  # what a timeout shows: the statuses not SUCCESSFUL, and where the queue's tasks are
        left = Counter(status for status in statuses(broker, tasks).values() if status != "SUCCESSFUL")
        return f"every task to end; not yet: {dict(left)}; {broker.inspect.queue_stats('default')}"

    wait_until(lambda: set(statuses(broker, tasks).values()) == {"SUCCESSFUL"}, scaled(60, 300), message=unfinished)
    events = spans(broker)
    assert {e["task_id"] for e in events if e["event"] == "end"} == set(tasks)
    assert most_at_once(closed_at_kills(events, killed_ms)) <= CAP, fleet.logs()


@pytest.mark.timeout(120)
def test_a_run_holding_the_only_slot_through_a_redis_restart_keeps_it(start_redis, consumer_process):
    server = start_redis("--appendonly", "yes", "--appendfsync", "always")
    broker = get_broker()
    wait_until(lambda: int(broker.client.info("server")["uptime_in_seconds"]) >= LEASE_S, 10, message="uptime")
    TaskType.objects.create(name="capped", handler="test.span", max_running=1)
    hold = f"{broker.keys.prefix}:{HOLD_KEY_SUFFIX}"
    broker.client.set(hold, 1)
    fleet = Fleet(consumer_process, broker, concurrency=2, prefetch=0, TASK_HANDLER_MODULES=MODULES)
    fleet.env["TASKS_THROTTLE_RECHECK_S"] = "1"
    fleet.spawn("a")
    fleet.wait_registered(["a"])
    [held] = producer.enqueue("capped", kwargs={"hold": True})
    wait_until(lambda: spans(broker), 30, message="the held run to start")
    fleet.spawn("b")
    fleet.wait_registered(["b"])
    others = [t.id for t in producer.enqueue("capped", kwargs={"sleep_s": 0.05}, count=4)]

    server.kill()
    time.sleep(LEASE_S * 1.5)  # down for longer than a lease: the holder's deadline is past
    server.start()
    broker.client.delete(broker.keys.running("capped"))  # as if lost: not yet fsynced, or expired as idle
    time.sleep(LEASE_S * 2.5)  # past the lease after the restart: slots are given out again
    assert [e["task_id"] for e in spans(broker)] == [held.id], "a capped task started beside the held run"
    broker.client.delete(hold)
    wait_until(lambda: set(statuses(broker, [held.id, *others]).values()) == {"SUCCESSFUL"}, 30, message="every task")
    assert most_at_once(spans(broker)) == 1, fleet.logs()
