"""Scenario 9: garbage bytes and unknown task types mixed into a large batch."""

from __future__ import annotations

import os
import random
import uuid

import pytest
from django.conf import settings

from tasks_app import producer
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.enqueue import Enqueueable
from tests.chaos.harness import Fleet, Summary, scaled, tally, wait_finished
from tests.support.processes import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

CHUNK = 100


def garbage(rng: random.Random) -> bytes:
    """Bytes that are no task: invalid protobuf, or an envelope without id/type, or plain text."""
    return rng.choice(
        [
            b"\xff" + os.urandom(rng.randint(1, 64)),  # field 31, wire type 7: never valid protobuf
            b"",
            b'{"type": "test.record"}',
            encode_task(Task(type="test.record")),  # no id
            b"\x0a\x05hello",  # an id, no type
        ]
    )


def unknown_type(queue: str) -> Enqueueable:
    task = Task(id=str(uuid.uuid4()), type="no.such.type", queue=queue, payload=b"{}")
    return Enqueueable(queue=queue, raw=encode_task(task), task_id=task.id)


def enqueue_mixed(broker, total: int) -> tuple[list[str], int, int]:
    """Enqueue `total` entries, two bad ones (garbage, unknown type) per chunk; return good ids and bad counts."""
    rng = random.Random()
    good: list[str] = []
    bad_garbage = bad_unknown = 0
    while len(good) + bad_garbage + bad_unknown < total:
        good += [t.id for t in producer.enqueue("test.record", count=CHUNK - 2)]
        broker.client.lpush(broker.keys.pending("default"), garbage(rng))
        broker.enqueuer.enqueue([unknown_type("default")], settings.TASKS_RESULT_TTL)
        bad_garbage += 1
        bad_unknown += 1
    return good, bad_garbage, bad_unknown


@pytest.mark.timeout(240)
def test_bad_input_is_dead_lettered_and_never_stops_the_consumer(chaos_broker, consumer_process):
    broker = chaos_broker
    fleet = Fleet(consumer_process, broker, concurrency=8, prefetch=8)
    consumer = fleet.spawn("steady")
    fleet.wait_registered(["steady"])
    good, bad_garbage, bad_unknown = enqueue_mixed(broker, scaled(2000, 10000))
    wait_finished(broker, good, scaled(180, 600), fleet)
    bad = bad_garbage + bad_unknown

    wait_until(
        lambda: broker.inspect.queue_stats("default").dead >= bad, 60, message="every bad entry to be dead-lettered"
    )

    result = tally(broker, good)
    dead = [decode_task(raw) for raw, _ in broker.inspect.list_dead("default", limit=bad + 10)]
    Summary(
        "9-bad-input",
        len(good) + bad,
        result.total_runs,
        len(result.lost),
        len(result.duplicates),
        0,
        None,
        {"garbage": bad_garbage, "unknown_type": bad_unknown, "dead_lettered": len(dead)},
    ).report()
    assert result.lost == []
    assert len(dead) == bad
    assert all(task.dead_reason for task in dead)
    assert sum(task.type == "_undecodable" for task in dead) == bad_garbage
    assert sum("unknown task type" in task.dead_reason for task in dead) == bad_unknown
    assert consumer.process.poll() is None, "the consumer exited"
    assert [c["id"] for c in broker.inspect.queue_stats("default").consumers] == ["steady"]
    log = consumer.log()
    assert "lost its lease" not in log and "unexpected error" not in log and "Traceback" not in log
