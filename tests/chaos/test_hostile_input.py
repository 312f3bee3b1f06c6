"""Scenario 10: hostile input among a few thousand good tasks, as real handlers and foreign producers send it."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.protocol.codec import Task, UndecodableTask, decode_task, encode_task
from tasks_app.protocol.records import ResultRecord
from tests.chaos.harness import Fleet, Summary, scaled, settled_leftovers, tally, wait_finished
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

QUEUE = "default"
CHUNK = 100
# Outcomes a bad entry may end in: failed with a reason (a FAILED record with its error, or a dead letter).
FAILED_WITH_REASON = {"failed", "dead"}


@dataclass
class Hostile:
    """The bad entries put in Redis: task ids by kind, and how many entries had no id at all."""

    ids: dict[str, str] = field(default_factory=dict)
    garbage: int = 0

    def add(self, kind: str, task_id: str) -> None:
        self.ids[task_id] = kind


def foreign(type_name: str, payload: bytes = b"", task_id: str | None = None) -> tuple[str, bytes]:
    """A task envelope as another language's producer would write it (one attempt allowed)."""
    task = Task(
        id=task_id or str(uuid.uuid4()),
        type=type_name,
        queue=QUEUE,
        payload=payload,
        max_attempts=1,
        enqueued_at_ms=int(time.time() * 1000),
    )
    return task.id, encode_task(task)


def push_foreign(
    broker: Broker, hostile: Hostile, kind: str, type_name: str, payload: bytes = b"", task_id: str | None = None
) -> None:
    task_id, raw = foreign(type_name, payload, task_id)
    broker.client.lpush(broker.keys.pending(QUEUE), raw)
    hostile.add(kind, task_id)


def enqueue_own(hostile: Hostile, kind: str, type_name: str, kwargs: dict[str, object] | None = None) -> None:
    [task] = producer.enqueue(type_name, kwargs=kwargs)
    hostile.add(kind, task.id)


def delayed_without_prefix(broker: Broker, hostile: Hostile) -> None:
    """A delayed member that is a bare task, without its 4-character priority prefix, due now."""
    task_id, raw = foreign("demo.echo")
    broker.client.zadd(broker.keys.delayed(QUEUE), {raw: broker.inspect.server_time_ms()})
    hostile.add("delayed_no_prefix", task_id)


def garbage(broker: Broker, hostile: Hostile) -> None:
    broker.client.lpush(broker.keys.pending(QUEUE), b"\xff" + os.urandom(16))
    hostile.garbage += 1


KINDS: dict[str, Callable[[Broker, Hostile], None]] = {
    "surrogate_return": lambda b, h: enqueue_own(h, "surrogate_return", "test.hostile_return", {"kind": "surrogate"}),
    "huge_return": lambda b, h: enqueue_own(h, "huge_return", "test.hostile_return", {"kind": "huge"}),
    "surrogate_error": lambda b, h: enqueue_own(h, "surrogate_error", "test.hostile_raise"),
    "past_timeout": lambda b, h: enqueue_own(h, "past_timeout", "test.hostile_sleep", {"sleep_s": 2}),
    "surrogate_payload": lambda b, h: push_foreign(b, h, "surrogate_payload", "demo.echo", b'{"args": ["\\ud800"]}'),
    "unknown_type": lambda b, h: push_foreign(b, h, "unknown_type", "no.such.type"),
    "slash_id": lambda b, h: push_foreign(b, h, "slash_id", "demo.echo", task_id=f"hostile/{uuid.uuid4()}"),
    "newline_id": lambda b, h: push_foreign(b, h, "newline_id", "demo.echo", task_id=f"hostile\n{uuid.uuid4()}"),
    "delayed_no_prefix": delayed_without_prefix,
    "undecodable": garbage,
}
# Valid tasks a consumer may also run to success; every other kind must fail with a reason.
MAY_SUCCEED = {"surrogate_payload", "slash_id", "newline_id"}


def dead_letters(broker: Broker) -> tuple[dict[str, str], int]:
    """Dead letters of the queue: reason by task id, and how many were undecodable (with a reason)."""
    by_id: dict[str, str] = {}
    undecodable = 0
    for raw, _ in broker.inspect.list_dead(QUEUE, limit=100_000):
        try:
            task = decode_task(raw)
        except UndecodableTask:
            continue
        if task.type == "_undecodable":
            undecodable += bool(task.dead_reason)
        else:
            by_id[task.id] = task.dead_reason
    return by_id, undecodable


def outcome(fields: dict[str, str] | None, dead_reason: str | None) -> str:
    """How one task ended: dead, failed (with its error), succeeded, or the status it is stuck in."""
    if dead_reason:
        return "dead"
    record = ResultRecord.from_fields(fields) if fields else None
    if record is None:
        return "no record"
    if record.status == "FAILED" and (record.errors or record.dead_reason):
        return "failed"
    return "succeeded" if record.status == "SUCCESSFUL" else record.status


def wrong_outcomes(broker: Broker, hostile: Hostile) -> dict[str, Counter[str]]:
    """Per kind, the outcomes of its entries that are not allowed for it."""
    by_id, _ = dead_letters(broker)
    wrong: dict[str, Counter[str]] = {}
    for task_id, kind in hostile.ids.items():
        ended = outcome(broker.records.get_result(task_id), by_id.get(task_id))
        allowed = FAILED_WITH_REASON | ({"succeeded"} if kind in MAY_SUCCEED else set())
        if kind == "delayed_no_prefix" and ended == "no record":
            continue  # dead-lettered as undecodable bytes: counted with the garbage below
        if ended not in allowed:
            wrong.setdefault(kind, Counter())[ended] += 1
    return wrong


def mixed_load(broker: Broker, total: int) -> tuple[list[str], Hostile]:
    """Enqueue `total` entries: chunks of good tasks (some delayed), one hostile entry per chunk."""
    good: list[str] = []
    hostile = Hostile()
    kinds = list(KINDS)
    chunk = 0
    while len(good) + chunk < total:
        good += [t.id for t in producer.enqueue("test.record", count=CHUNK - 3)]
        good += [t.id for t in producer.enqueue("test.record", count=2, delay_s=0.5)]
        KINDS[kinds[chunk % len(kinds)]](broker, hostile)
        chunk += 1
    return good, hostile


def hostile_types() -> None:
    """One attempt for every hostile type (so each ends at once), 0.5 s timeout for the sleeper."""
    for name in ("test.hostile_return", "test.hostile_raise", "test.hostile_sleep", "demo.echo"):
        TaskType.objects.create(
            name=name, handler=name, max_attempts=1, timeout=0.5 if name == "test.hostile_sleep" else None
        )


@pytest.mark.timeout(300)
def test_hostile_input_fails_only_itself_and_never_stalls_a_consumer(start_redis, consumer_process):
    start_redis("--appendonly", "no", "--proto-max-bulk-len", "1mb")
    broker = get_broker()
    hostile_types()
    fleet = Fleet(consumer_process, broker, concurrency=8, prefetch=8)
    for consumer_id in ("h1", "h2"):
        fleet.spawn(consumer_id)
    fleet.wait_registered(["h1", "h2"])
    good, hostile = mixed_load(broker, scaled(2000, 10000))
    wait_finished(broker, good, scaled(60, 300), fleet)

    with contextlib.suppress(AssertionError):
        wait_until(lambda: not wrong_outcomes(broker, hostile), 20, interval_s=0.5, message="bad entries to end")
    wrong = wrong_outcomes(broker, hostile)
    by_id, undecodable = dead_letters(broker)
    unmatched_prefixless = sum(
        kind == "delayed_no_prefix" and task_id not in by_id and broker.records.get_result(task_id) is None
        for task_id, kind in hostile.ids.items()
    )
    result = tally(broker, good)
    Summary(
        "10-hostile-input",
        len(good) + len(hostile.ids) + hostile.garbage,
        result.total_runs,
        len(result.lost),
        len(result.duplicates),
        0,
        None,
        {
            "bad": dict(Counter(hostile.ids.values())),
            "garbage": hostile.garbage,
            "dead_lettered": len(by_id),
            "undecodable_dead": undecodable,
            "wrong_outcomes": {k: dict(v) for k, v in wrong.items()},
        },
    ).report()
    assert result.lost == [], f"good tasks lost: {len(result.lost)}"
    assert wrong == {}, f"bad entries not ended with a reason: {wrong}\n{fleet.logs()}"
    assert undecodable >= hostile.garbage + unmatched_prefixless, "undecodable entries not dead-lettered with a reason"
    assert_consumers_still_work(broker, fleet)


def assert_consumers_still_work(broker: Broker, fleet: Fleet) -> None:
    """New tasks enqueued at the end run within seconds on every consumer; nothing is left held."""
    fresh = [t.id for t in producer.enqueue("test.record", kwargs={"sleep_s": 0.2, "fresh": True}, count=64)]
    wait_finished(broker, fresh, 15, fleet)
    ran_on = {run["consumer"].split(".")[0] for run in recorded_runs(broker) if run.get("fresh")}
    assert ran_on == set(fleet.processes), f"only {sorted(ran_on)} ran the fresh tasks: the others stalled"
    left = settled_leftovers(broker, [QUEUE], dead=False)
    assert left == {}, f"left held or queued at the end: {left}"
    for consumer_id, process in fleet.processes.items():
        assert process.process.poll() is None, f"{consumer_id} exited"
