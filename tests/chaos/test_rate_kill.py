"""Scenario 11: a rate-limited type drained by three consumers while one at a time is SIGKILLed and replaced."""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from typing import Any

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tests.chaos.harness import Fleet, Summary, scaled, seeded_rng, settled_leftovers, statuses, wait_finished
from tests.support.recording import handler_starts, most_starts_in_any_window

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

LIMITED = "test.handler_start"  # notes time.time() as its first line, then sleeps
LIMIT, PERIOD_S = 20, 1.0
RUN_S = 0.1  # long enough that most kills catch a handler running


def kill_and_replace(
    fleet: Fleet, rng: random.Random, current: dict[str, str], interrupted: set[tuple[str, str]]
) -> None:
    """SIGKILL one registered consumer at random, note (task, consumer id) for each task it held, start a successor."""
    live = {c["id"] for c in fleet.broker.inspect.queue_stats(fleet.queues[0]).consumers}
    names = sorted(name for name, consumer_id in current.items() if consumer_id in live)
    if not names:  # every one is still starting (or just replaced): try again at the next moment
        return
    name = rng.choice(names)
    victim = current[name]
    held = fleet.kill(victim)
    interrupted.update((task_id, identity) for task_id in held for identity in fleet.identities(victim))
    current[name] = f"{name}{int(victim[1:]) + 1}"
    fleet.spawn(current[name])


def kill_at_random_moments(
    fleet: Fleet, rng: random.Random, current: dict[str, str], task_count: int, duration_s: float
) -> set[tuple[str, str]]:
    """Every 0.3-1.5 s kill and replace a consumer, for `duration_s` or until every task has started once.

    Returns (task id, consumer id) for every task a killed consumer held under each id it had.
    """
    interrupted: set[tuple[str, str]] = set()
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.3, 1.5))
        if len({start["task_id"] for start in handler_starts(fleet.broker)}) >= task_count:
            break
        kill_and_replace(fleet, rng, current, interrupted)
    return interrupted


def tightest_span_ms(starts_ms: list[float], limit: int) -> float | None:
    """The shortest time from a start to the `limit`-th start after it: under the period, a window held too many."""
    ordered = sorted(starts_ms)
    return min((ordered[i + limit] - ordered[i] for i in range(len(ordered) - limit)), default=None)


def reruns_outside_kills(starts: list[dict[str, Any]], interrupted: set[tuple[str, str]]) -> dict[str, list[str]]:
    """Tasks whose handler began again after a run that no kill interrupted: task id -> consumers of its runs."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for start in starts:
        runs[start["task_id"]].append(start)
    wrong = {}
    for task_id, task_runs in runs.items():
        earlier = sorted(task_runs, key=lambda run: run["start_ms"])[:-1]
        if any((task_id, run["consumer"]) not in interrupted for run in earlier):
            wrong[task_id] = [run["consumer"] for run in task_runs]
    return wrong


def report_and_check(fleet: Fleet, ids: list[str], interrupted: set[tuple[str, str]]) -> None:
    """Report the run, then check the limit at the handlers' starts, that every task succeeded, and every rerun."""
    broker = fleet.broker
    left = settled_leftovers(broker, fleet.queues)  # a copy still waiting would run again later
    starts = handler_starts(broker)
    starts_ms = [start["start_ms"] for start in starts]
    most, tightest = most_starts_in_any_window(starts_ms, PERIOD_S * 1000), tightest_span_ms(starts_ms, LIMIT)
    final = statuses(broker, ids)
    lost = sorted(task_id for task_id in ids if final[task_id] != "SUCCESSFUL")
    runs = Counter(start["task_id"] for start in starts)
    wrong_reruns = reruns_outside_kills(starts, interrupted)
    extra = {"kills": len(fleet.killed_at), "most_starts_in_a_period": most, "limit": LIMIT}
    extra |= {"tightest_span_ms": round(tightest or 0, 1), "left_in_redis": left}
    duplicates = sum(count > 1 for count in runs.values())
    allowed = len({task_id for task_id, _ in interrupted})
    Summary("11-rate-limit-kills", len(ids), len(starts), len(lost), duplicates, allowed, extra=extra).report()
    assert len(fleet.killed_at) >= 3, "the run was too short to kill several consumers"
    assert most <= LIMIT, f"{most} handlers began within one {PERIOD_S} s window; the limit is {LIMIT}"
    assert not lost, f"tasks not succeeded: {[(task_id, final[task_id]) for task_id in lost[:10]]}"
    assert runs.keys() == set(ids), f"tasks succeeded whose handler never began: {sorted(set(ids) - runs.keys())[:10]}"
    assert not wrong_reruns, f"ran again with no kill of the consumer running it: {list(wrong_reruns.items())[:5]}"
    assert left == {}, f"left in Redis after every task succeeded: {left}"


@pytest.mark.alone  # its start times are read at the handlers' first lines: load elsewhere would shift them
@pytest.mark.timeout(600)
def test_rate_limit_holds_at_the_handlers_while_consumers_are_killed(chaos_broker, consumer_process):
    """20 starts per second at most in any 1 s window, counted at the handlers, whatever is killed when."""
    rng = seeded_rng("11-rate-limit-kills")
    TaskType.objects.create(name=LIMITED, handler=LIMITED, rate_limit=LIMIT, rate_period=PERIOD_S)
    fleet = Fleet(consumer_process, chaos_broker, concurrency=4, prefetch=4)
    current = {name: f"{name}0" for name in ("a", "b", "c")}
    for consumer_id in current.values():
        fleet.spawn(consumer_id)
    fleet.wait_registered(current.values())

    ids = [task.id for task in producer.enqueue(LIMITED, kwargs={"sleep_s": RUN_S}, count=scaled(200, 1200))]
    interrupted = kill_at_random_moments(fleet, rng, current, len(ids), scaled(8, 55))
    wait_finished(chaos_broker, ids, scaled(120, 600), fleet)
    report_and_check(fleet, ids, interrupted)
