"""Metric names, labels and the queue collector (real Redis), and the health endpoints."""

from __future__ import annotations

import json
import time
from unittest.mock import ANY

import pytest
from django.test import override_settings
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from tasks_app import metrics, producer
from tasks_app.collectors import QueueCollector
from tasks_app.consumer.loops import Liveness, make_app
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.scripts import connect
from tests.support.ports import free_port
from tests.support.processes import wait_until
from tests.support.scrape import Scrape, http_get

# "schedule": periodic task names, a set bounded by the rows of PeriodicTask like types are by TaskType; "status": a
# workflow's end (SUCCESSFUL, FAILED, CANCELLED).
ALLOWED_LABELS = {"type", "queue", "reason", "decision", "loop", "schedule", "status"}


def declared() -> list[MetricWrapperBase]:
    return [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]


def test_names_follow_prometheus_conventions_and_labels_stay_bounded():
    for metric in declared():
        name = metric._name
        assert name.startswith(f"{metrics.PREFIX}_"), name
        assert not name.endswith("_total"), f"{name}: the client adds _total to counters"
        if metric._type == "histogram":
            assert name.endswith("_seconds"), name
        assert set(metric._labelnames) <= ALLOWED_LABELS, name


def scrape_collector(collector: QueueCollector) -> Scrape:
    return Scrape(generate_latest(registry_of(collector)).decode())


@pytest.mark.django_db
def test_collector_reads_depths_and_live_consumers_at_scrape_time(broker):
    collector = QueueCollector(lambda: broker, ["idle"])
    producer.enqueue("demo.echo", count=3)
    producer.enqueue("demo.echo", delay_s=600)
    broker.leases.heartbeat(["default"], "c1", 60_000, {"host": "h"})
    first = scrape_collector(collector)
    assert first.value("taskqueue_queue_tasks", queue="default", state="pending") == 3
    assert first.value("taskqueue_queue_tasks", queue="default", state="delayed") == 1
    assert first.value("taskqueue_queue_tasks", queue="default", state="dead") == 0
    assert first.value("taskqueue_consumers_live", queue="default") == 1
    assert first.has("taskqueue_queue_tasks", queue="idle", state="pending")
    assert first.value("taskqueue_queue_stats_up") == 1

    producer.enqueue("demo.echo", count=2)  # read again on the next scrape, no polling
    assert scrape_collector(collector).value("taskqueue_queue_tasks", queue="default", state="pending") == 5


@pytest.mark.django_db
def test_collector_exports_only_valid_queue_names_whatever_the_queue_set_holds(broker):
    producer.enqueue("demo.echo")
    broker.client.sadd(broker.keys.queues(), b"caf\xe9", b"a/b", b"x" * 10_000, b"<q>\n")
    text = generate_latest(registry_of(QueueCollector(lambda: broker))).decode()
    result = Scrape(text)
    assert result.value("taskqueue_queue_stats_up") == 1  # before: the undecodable name failed every scrape
    assert result.value("taskqueue_queue_tasks", queue="default", state="pending") == 1
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    queues = {sample.labels["queue"] for sample in samples if "queue" in sample.labels}
    assert queues == {"default"}


def registry_of(collector: QueueCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_collector_counts_an_unreachable_redis_instead_of_raising():
    dead = Broker(connect("redis://127.0.0.1:1/0"), "unreachable")
    errors_before = metrics.QUEUE_STATS_ERRORS._value.get()
    result = scrape_collector(QueueCollector(lambda: dead, timeout_s=1.0))
    assert result.value("taskqueue_queue_stats_up") == 0
    assert not result.has("taskqueue_queue_tasks")
    assert metrics.QUEUE_STATS_ERRORS._value.get() == errors_before + 1


def call(app, path: str) -> tuple[str, bytes]:
    status: list[str] = []
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET"}, lambda s, headers: status.append(s)))
    return status[0], body


def test_consumer_healthz_follows_liveness(tmp_path):
    health_file = tmp_path / "alive"
    liveness = Liveness(str(health_file), stale_after_s=60)
    app = make_app(liveness, CollectorRegistry())
    assert call(app, "/healthz")[0].startswith("503")
    liveness.beat()
    assert health_file.exists() and time.time() - health_file.stat().st_mtime < 60
    status, body = call(app, "/healthz")
    assert status.startswith("200") and b'"ok"' in body


def test_a_health_file_that_cannot_be_written_is_said_once_and_fails_nothing_else(tmp_path, caplog):
    # Before: the OSError escaped: a traceback as a bug of the health loop and, in a consumer waiting
    # for its id to be free (a supervisor restarted at once), the end of its start-up.
    health_file = tmp_path / "no-such-dir" / "alive"
    liveness = Liveness(str(health_file), stale_after_s=60)
    liveness.beat()
    liveness.beat()
    assert liveness.healthy()
    [line] = [r.getMessage() for r in caplog.records if "health file" in r.getMessage()]
    assert line.startswith(f"cannot touch the health file {health_file}: [Errno 2]")
    health_file.parent.mkdir()
    liveness.beat()
    assert health_file.exists() and "touched again" in caplog.records[-1].getMessage()


def test_consumer_readyz_waits_for_the_task_types_too():
    types_age_s = [float("inf")]
    liveness = Liveness(None, stale_after_s=60, task_types_age_s=lambda: types_age_s[0])
    app = make_app(liveness, CollectorRegistry())
    liveness.beat()
    assert call(app, "/healthz")[0].startswith("200")
    status, body = call(app, "/readyz")
    assert status.startswith("503")
    assert json.loads(body) == {
        "status": "ok",
        "last_ok_age_s": ANY,
        "ready": False,
        "task_types_age_s": None,
        "misconfigured": [],
    }
    types_age_s[0] = 2.5
    status, body = call(app, "/readyz")
    assert status.startswith("200") and json.loads(body)["task_types_age_s"] == 2.5


@pytest.mark.django_db
def test_web_healthz_checks_database_and_redis(admin_client, key_prefix):
    response = admin_client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}

    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        response = admin_client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["checks"]["redis"].startswith("error")


@pytest.mark.django_db
def test_web_healthz_shows_anonymous_callers_the_status_only(client, key_prefix, caplog):
    assert client.get("/healthz").json() == {"status": "ok"}
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable"}
    assert b"127.0.0.1" not in response.content and b"error" not in response.content
    assert any("health check: redis error" in record.getMessage() for record in caplog.records)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("argv", "other_loopback_answers"), [((), False), (("--metrics-host", "0.0.0.0"), True)])
def test_consumer_metrics_bind_this_host_only_unless_told(consumer_process, argv, other_loopback_answers):
    port = free_port()
    consumer_process("--lease", "2", "--metrics-port", str(port), *argv)
    wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0], 30, message="the metrics port to answer")
    # 127.0.0.2 reaches this host too, but only a socket bound to every address accepts it.
    assert bool(http_get(f"http://127.0.0.2:{port}/healthz")[0]) is other_loopback_answers


def test_run_metrics_are_the_labelled_children_and_count_in_the_registry():
    from prometheus_client import REGISTRY

    run = metrics.of_run("cached.type", "cached-queue")
    assert metrics.of_run("cached.type", "cached-queue") is run
    assert run.started is metrics.TASKS_STARTED.labels("cached.type", "cached-queue")
    labels = {"type": "cached.type", "queue": "cached-queue"}
    before = REGISTRY.get_sample_value("taskqueue_tasks_succeeded_total", labels) or 0
    run.succeeded.inc()
    assert REGISTRY.get_sample_value("taskqueue_tasks_succeeded_total", labels) == before + 1


@pytest.mark.django_db(transaction=True)
def test_consumer_metrics_bind_an_ipv6_address_and_every_address_on_the_ipv6_wildcard(consumer_process):
    # Before: the server was IPv4 only, so --metrics-host :: (or ::1) could not even start.
    port = free_port()
    consumer = consumer_process("--lease", "2", "--metrics-port", str(port), "--metrics-host", "::")
    wait_until(lambda: http_get(f"http://[::1]:{port}/healthz")[0], 30, message="the metrics port to answer")
    assert http_get(f"http://127.0.0.1:{port}/healthz")[0], "IPv4 too"
    assert consumer.terminate(timeout_s=30) == 0, consumer.log()


@pytest.mark.django_db
def test_web_healthz_logs_an_outage_once_and_its_end(client, key_prefix, caplog):
    client.get("/healthz")  # healthy: whatever an earlier test left open has ended
    caplog.clear()
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        for _ in range(5):  # a load balancer probing every few seconds
            assert client.get("/healthz").status_code == 503
    assert client.get("/healthz").status_code == 200
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("health check:")]
    assert len([line for line in lines if line.startswith("health check: redis error")]) == 1
    assert [line for line in lines if "ok again" in line] == [lines[-1]]
    assert lines[-1].startswith("health check: redis ok again")
