"""A consumer whose database goes away: tasks wait for their settings, and the database is not hammered."""

from __future__ import annotations

import math

import pytest
from django.db import OperationalError, connection

from tasks_app.consumer.claiming import Claimed
from tasks_app.consumer.executor import Executor
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_task, encode_arguments, payload_of
from tasks_app.protocol.keys import split_delayed_member
from tasks_app.registry import Handler, Registry
from tasks_app.task_types import TaskTypeCache
from tests.support.claims import claim, push, register, task_bytes
from tests.support.counters import sample
from tests.support.executing import executor_of

pytestmark = pytest.mark.django_db

CONSUMER = "worker-a"


@pytest.fixture
def executor(broker: Broker) -> Executor:
    registry = Registry()
    registry.add(Handler("x.add", lambda a, b: a + b))
    register(broker, CONSUMER, lease_ms=30_000)
    return executor_of(broker, registry, CONSUMER)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The database away from the start; the list counts the reads of the TaskType rows."""
    return break_the_database(monkeypatch)


def break_the_database(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of the TaskType rows from now on fails, as with the database away; the list counts them."""
    attempts: list[str] = []

    def database_down() -> None:
        attempts.append("read")
        raise OperationalError("the database is restarting")

    monkeypatch.setattr(TaskType.objects, "all", database_down)
    return attempts


def claimed_one(broker: Broker, task_id: str, type_name: str) -> Claimed:
    push(broker, task_bytes(task_id, type_name, payload=payload_of(*encode_arguments([1, 2], {}))))
    [raw] = claim(broker, CONSUMER, 1)
    return Claimed("q", CONSUMER, raw)


def delayed_ids(broker: Broker) -> list[str]:
    members = broker.client.zrange(broker.keys.delayed("q"), 0, -1)
    return [decode_task(split_delayed_member(member)[1]).id for member in members]


def test_a_type_created_after_the_last_read_waits_while_the_database_is_away(broker, executor, monkeypatch):
    executor.task_types.refresh()  # read once, while the database was up: no row yet
    TaskType.objects.create(name="x.new", handler="x.add", queue="q")  # then its row, then the outage
    failed_reads = break_the_database(monkeypatch)
    assert executor.execute(claimed_one(broker, "t1", "x.new")) is False
    assert failed_reads, "the rows were asked for before calling the type unknown"
    assert broker.inspect.list_dead("q") == [], "a type the database could not be asked about is not unknown"
    assert delayed_ids(broker) == ["t1"] and broker.queue.held_by("q", CONSUMER) == []


def test_claims_during_an_outage_do_not_each_ask_the_database(broker, executor, reads):
    for number in range(20):  # twenty claims in a row, each its own batch
        assert executor.execute(claimed_one(broker, f"t{number}", "x.add")) is False
    assert len(delayed_ids(broker)) == 20 and broker.inspect.list_dead("q") == []
    assert len(reads) == 1, "a failed read is not repeated for every claim that follows within a second"


def test_the_database_back_lets_the_next_claim_read_the_rows(broker, executor, reads, monkeypatch):
    assert executor.execute(claimed_one(broker, "t1", "x.add")) is False
    monkeypatch.undo()
    executor.task_types.refresh()  # the housekeeping refresh, a few seconds on
    executor.execute(claimed_one(broker, "t2", "x.add"))
    assert broker.records.get_result("t2")["status"] == "SUCCESSFUL"


def test_a_consumer_that_never_read_its_task_types_claims_nothing_until_it_can(broker, monkeypatch, caplog):
    # Claiming them would only defer them, again every few seconds, while consumers that can run them wait.
    options = ConsumerOptions(queues=["q"], concurrency=1, prefetch=0, lease_s=2.0, block_s=0.1, consumer_id="me")
    consumer = Consumer(options, broker=broker)
    consumer.membership.register()
    claimer = consumer.claimer("q")
    try:
        push(broker, task_bytes("t1", "x.add", payload=payload_of(*encode_arguments([1, 2], {}))))
        reads = break_the_database(monkeypatch)
        consumer.task_types.refresh()  # what start() and then the housekeeping loop try
        assert claimer.run_once() > 0 and claimer.run_once() > 0  # waits, without asking the database itself
        assert len(reads) == 1 and broker.client.llen(broker.keys.pending("q")) == 1
        assert "cannot read the task types, claiming nothing until then" in caplog.text
        assert sample("taskqueue_consumer_task_types_age_seconds") == math.inf  # what the alert watches
        assert broker.queue.held_by("q", "me") == [] and delayed_ids(broker) == []
        monkeypatch.undo()
        consumer.task_types.refresh()  # the housekeeping refresh, a few seconds on
        claimer.run_once()
        assert [decode_task(raw).id for raw in broker.queue.held_by("q", "me")] == ["t1"]
        assert sample("taskqueue_consumer_task_types_age_seconds") < 5
    finally:
        consumer.give_up.set()


@pytest.mark.skipif(connection.vendor != "sqlite", reason="only SQLite stores any text in a date column")
def test_a_row_whose_time_stamp_is_malformed_fails_no_refresh():
    TaskType.objects.create(name="x.add", handler="x.add", rate_limit=5)
    TaskType.objects.create(name="x.other", handler="x.add")
    with connection.cursor() as cursor:  # what a raw UPDATE leaves, past the ORM
        cursor.execute("UPDATE tasks_app_tasktype SET updated_at = '2026-13-45 99:99:99' WHERE name = 'x.other'")
    cache = TaskTypeCache()
    assert cache.refresh()
    assert cache.get("x.add").rate_limit == 5
    assert cache.get("x.other").handler == "x.add"
