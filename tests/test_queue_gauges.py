"""What a scaler reads per queue: waiting, in flight, the oldest waiting task's age and the workers (real Redis)."""

from __future__ import annotations

import json
import time
from io import StringIO

import pytest
import redis
from django.core.management import call_command
from django.test import Client
from prometheus_client import CollectorRegistry, generate_latest

from tasks_app import producer
from tasks_app.collectors import SCALER_GAUGES, QueueCollector
from tasks_app.models import TaskType
from tasks_app.protocol.keys import WAKE_TOKEN
from tests.support.ports import free_port
from tests.support.processes import wait_until
from tests.support.scrape import Scrape, http_get

QUEUE = "gauges"


def scaler_values(scrape: Scrape, queue: str = QUEUE) -> dict[str, float]:
    """The scaler's gauges of `queue` in a scrape, by QueueStats field."""
    return {field: scrape.value(f"taskqueue_{name}", queue=queue) for field, (name, _) in SCALER_GAUGES.items()}


def collected(broker) -> Scrape:
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: broker))
    return Scrape(generate_latest(registry).decode())


def claim(broker, consumer_id: str, count: int) -> None:
    """Move `count` tasks from the head of pending to `consumer_id`'s processing list, as a claim does."""
    for _ in range(count):
        assert broker.client.lmove(broker.keys.pending(QUEUE), broker.keys.processing(QUEUE, consumer_id), "RIGHT")


@pytest.mark.django_db
def test_the_gauges_count_each_part_and_only_live_consumers(broker):
    producer.enqueue("demo.echo", queue=QUEUE, count=30)
    producer.enqueue("demo.echo", queue=QUEUE, priority=5, count=4)
    delayed = producer.enqueue("demo.echo", queue=QUEUE, delay_s=600, count=3)
    now_ms = broker.inspect.server_time_ms()
    members = broker.client.zrange(broker.keys.delayed(QUEUE), 0, -1)
    assert len(members) == len(delayed)
    broker.limits.bring_forward(QUEUE, dict.fromkeys(members[:2], now_ms - 90_000))  # due 90 s ago, not promoted
    broker.leases.heartbeat([QUEUE], "live", 60_000, {"concurrency": 6})
    broker.leases.heartbeat([QUEUE], "lapsed", 1, {"concurrency": 10})
    claim(broker, "live", 5)
    claim(broker, "lapsed", 3)
    wait_until(lambda: broker.inspect.server_time_ms() > now_ms + 5, 5, message="the lapsed lease to end")

    stats = broker.inspect.queue_stats(QUEUE)
    elapsed_s = (broker.inspect.server_time_ms() - now_ms) / 1000
    assert (stats.pending, stats.processing, stats.delayed) == (30 - 8 + 4, 8, 3)
    assert (stats.waiting, stats.in_flight, stats.workers) == (30 - 8 + 4 + 2, 5, 6)
    assert 90 <= stats.oldest_waiting_age_s <= 90 + elapsed_s + 1
    assert scaler_values(collected(broker)) == pytest.approx(
        {"waiting": 28, "in_flight": 5, "workers": 6, "oldest_waiting_age_s": stats.oldest_waiting_age_s}, abs=2
    )
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    [listed] = [q for q in json.loads(out.getvalue())["queues"] if q["queue"] == QUEUE]
    assert (listed["waiting"], listed["in_flight"], listed["workers"]) == (28, 5, 6)
    assert listed["oldest_waiting_age_s"] >= 90


@pytest.mark.django_db
def test_the_oldest_age_reads_the_heads_of_pending_prioritized_and_recovered_tasks(broker):
    assert broker.inspect.queue_stats(QUEUE).oldest_waiting_age_s == 0  # nothing waits
    producer.enqueue("demo.echo", queue=QUEUE)
    time.sleep(1.0)
    producer.enqueue("demo.echo", queue=QUEUE, count=10)
    producer.enqueue("demo.echo", queue=QUEUE, priority=9, count=2)
    broker.client.rpush(broker.keys.pending(QUEUE), WAKE_TOKEN)  # a wake token at the head is no task
    assert 1.0 <= broker.inspect.queue_stats(QUEUE).oldest_waiting_age_s < 30
    # The head of pending claimed and given up by a dead consumer: recovered, it waits in suspects.
    claim(broker, "gone", 2)  # the wake token, then the oldest task
    broker.client.lmove(broker.keys.processing(QUEUE, "gone"), broker.keys.suspects(QUEUE), "RIGHT", "LEFT")
    broker.client.delete(broker.keys.processing(QUEUE, "gone"))  # the wake token
    assert 1.0 <= broker.inspect.queue_stats(QUEUE).oldest_waiting_age_s < 30
    broker.client.delete(broker.keys.suspects(QUEUE))
    assert broker.inspect.queue_stats(QUEUE).oldest_waiting_age_s < 1.0
    # A foreign envelope that names no enqueue time, or bytes that are no task, are not timed.
    broker.client.delete(broker.keys.pending(QUEUE), broker.keys.prioritized(QUEUE))
    broker.client.lpush(broker.keys.pending(QUEUE), b"not a task", WAKE_TOKEN)
    assert broker.inspect.queue_stats(QUEUE).oldest_waiting_age_s == 0


@pytest.mark.django_db
def test_the_web_app_exports_the_gauges_for_a_queue_without_consumers(broker):
    producer.enqueue("demo.echo", queue=QUEUE, count=3)
    scrape = Scrape(Client(HTTP_HOST="localhost").get("/metrics").content.decode())
    assert scrape.value("taskqueue_queue_waiting_tasks", queue=QUEUE) == 3
    assert scrape.value("taskqueue_queue_workers", queue=QUEUE) == 0
    assert scrape.has("django_http_requests_before_middlewares_total")  # django-prometheus' own still there


@pytest.mark.django_db(transaction=True)
def test_the_gauges_follow_real_consumers_under_load(broker, consumer_process):
    TaskType.objects.create(name="gauge.hold", handler="test.record", queue=QUEUE)
    producer.enqueue("gauge.hold", kwargs={"hold_until": "release"}, count=200)
    port = free_port()
    common = ("--queue", QUEUE, "--lease", "2", "--prefetch", "0")
    first = consumer_process(*common, "--concurrency", "4", "--metrics-port", str(port))
    second = consumer_process(*common, "--concurrency", "3")

    def exported() -> dict[str, float]:
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        return scaler_values(Scrape(body.decode())) if status == 200 else {}

    def settled(expected: dict[str, float]) -> bool:
        values = exported()
        return all(values.get(field) == value for field, value in expected.items())

    busy = {"waiting": 200 - 7, "in_flight": 7, "workers": 7}
    wait_until(lambda: settled(busy), 60, message=lambda: f"{busy}, scraped {exported()}")
    assert exported()["oldest_waiting_age_s"] > 0
    broker.client.set(f"{broker.keys.prefix}:release", 1)
    drained = {"waiting": 0, "in_flight": 0, "oldest_waiting_age_s": 0, "workers": 7}
    wait_until(lambda: settled(drained), 120, message=lambda: f"{drained}, scraped {exported()}")
    assert second.terminate(timeout_s=60) == 0, second.log()
    wait_until(lambda: settled({"workers": 4}), 30, message=lambda: f"4 workers, scraped {exported()}")
    assert first.terminate(timeout_s=60) == 0, first.log()
    assert broker.inspect.queue_stats(QUEUE).workers == 0


@pytest.mark.django_db
def test_reading_the_gauges_costs_the_same_few_commands_however_many_tasks_wait(broker, monkeypatch):
    sent: list[list[str]] = []
    execute = redis.client.Pipeline.execute

    def counted(pipe, *args, **kwargs):
        sent.append([str(command[0][0]) for command in pipe.command_stack])
        return execute(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)

    def commands_of_a_read() -> list[list[str]]:
        sent.clear()
        broker.inspect.queue_stats(QUEUE)
        return list(sent)

    producer.enqueue("demo.echo", queue=QUEUE, count=2)
    few = commands_of_a_read()
    producer.enqueue("demo.echo", queue=QUEUE, count=1000)
    producer.enqueue("demo.echo", queue=QUEUE, priority=3, count=1000)
    due = {f"+000{n}".encode(): 0 for n in range(5000)}  # members no consumer would take: only counted here
    broker.client.zadd(broker.keys.delayed(QUEUE), due)
    assert commands_of_a_read() == few
    assert sum(len(pipeline) for pipeline in few) <= 20, few  # one LLEN more per consumer
    assert broker.inspect.queue_stats(QUEUE).waiting == 2 + 1000 + 1000 + 5000
