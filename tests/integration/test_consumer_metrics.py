"""A real consumer's `/metrics` during and after a mixed batch, and after reaping a killed consumer."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tests.support.ports import free_port
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs
from tests.support.scrape import Scrape, http_get, scrape

pytestmark = pytest.mark.django_db(transaction=True)

OK, FLAKY, DEAD, SLOW, LIMITED = "m.ok", "m.flaky", "m.dead", "m.slow", "m.limited"
BOUNDED_LABELS = {"type", "queue", "state", "reason", "decision", "loop"}


@pytest.fixture
def task_types() -> None:
    """Five types on one handler, differing in what they do and how they are limited."""
    for name, options in {
        OK: {},
        FLAKY: {"max_attempts": 3, "retry_backoff": 0.05},
        DEAD: {"max_attempts": 2, "retry_backoff": 0.05},
        SLOW: {},
        LIMITED: {"rate_limit": 1, "rate_period": 60},
    }.items():
        TaskType.objects.create(name=name, handler="test.record", **options)


def is_final(broker, task_id: str) -> bool:
    record = broker.records.get_result(task_id) or {}
    return record.get("status") in {"SUCCESSFUL", "FAILED"}


def start_a_victim_and_kill_it_mid_run(broker, consumer_process) -> list:
    """A victim takes two slow tasks and is killed while running them; return those tasks."""
    victim = consumer_process("--lease", "1", "--concurrency", "2", "--prefetch", "0", "--consumer-id", "victim")
    slow = producer.enqueue(SLOW, kwargs={"sleep_s": 2}, count=2)
    wait_until(
        lambda: sum(run["consumer"] == "victim" for run in recorded_runs(broker)) == 2,
        30,
        message="the victim to start both slow tasks",
    )
    victim.kill()
    return slow


def scrape_when(url: str, condition) -> Scrape | None:
    """A scrape of `url` for which `condition(scrape)` holds, else None."""
    current = scrape(url)
    return current if current and condition(current) else None


def check_while_recovered_tasks_run(url: str) -> None:
    """During: the victim's slow tasks, recovered, run on the survivor."""
    during = wait_until(
        lambda: scrape_when(
            url,
            lambda s: (
                s.value("taskqueue_consumer_busy_workers") >= 1
                and s.value("taskqueue_tasks_started_total", type=SLOW) >= 1
                and s.value("taskqueue_queue_tasks", queue="default", state="processing") >= 1
            ),
        ),
        30,
        message="a scrape while the recovered slow tasks run",
    )
    assert during.value("taskqueue_consumer_in_flight_tasks") >= 1
    assert during.value("taskqueue_tasks_recovered_total", queue="default") == 2
    assert during.value("taskqueue_consumers_live", queue="default") == 1
    assert during.value("taskqueue_queue_stats_up") == 1


def check_counters_by_type(after: Scrape) -> None:
    """What happened, type by type (the survivor never saw the victim's first runs)."""

    def counters(task_type: str, names=("started", "succeeded", "failed", "retried", "dead_lettered")) -> list:
        return [after.value(f"taskqueue_tasks_{name}_total", type=task_type, queue="default") for name in names]

    assert counters(OK) == [5, 5, 0, 0, 0]
    assert counters(FLAKY) == [4, 2, 2, 2, 0]
    assert counters(DEAD) == [2, 0, 2, 1, 1]
    assert counters(SLOW, ("started", "succeeded", "failed")) == [2, 2, 0]
    assert after.value("taskqueue_tasks_recovered_total", queue="default") == 2
    assert after.value("taskqueue_task_duration_seconds_count", type=OK) == 5
    assert after.value("taskqueue_task_duration_seconds_count", type=FLAKY) == 4
    assert after.value("taskqueue_task_wait_seconds_count", type=OK) == 5
    assert after.value("taskqueue_task_wait_seconds_count", type=FLAKY) == 2  # first attempts only


def check_rate_limited_tasks_were_deferred(broker, after: Scrape, limited: list) -> None:
    """One rate-limited task ran; the deferred ones used no attempt and still read READY."""
    limited_started = sum(run["type"] == LIMITED for run in recorded_runs(broker))
    assert limited_started == 1, f"{limited_started} of {len(limited)} rate-limited tasks started"
    assert after.value("taskqueue_tasks_started_total", type=LIMITED, queue="default") == 1
    assert after.value("taskqueue_tasks_deferred_total", type=LIMITED, reason="rate_limited") >= 2
    waiting = [broker.records.get_result(task.id) for task in limited]
    assert sorted(record["status"] for record in waiting) == ["READY", "READY", "SUCCESSFUL"], waiting
    assert sorted(record["attempts"] for record in waiting) == ["0", "0", "1"], waiting


def check_gauges_and_label_cardinality(after: Scrape, expected_delayed: int, task_ids: set[str]) -> None:
    """Gauges read from Redis at scrape time, the consumer's own gauges, and labels that stay bounded."""
    depth = {
        state: after.value("taskqueue_queue_tasks", queue="default", state=state)
        for state in ("pending", "processing", "delayed", "dead")
    }
    assert depth == {"pending": 0, "processing": 0, "delayed": expected_delayed, "dead": 1}
    assert after.value("taskqueue_consumers_live", queue="default") == 1
    assert after.value("taskqueue_consumer_busy_workers") == 0
    assert after.value("taskqueue_lease_renewals_total") >= 1
    assert after.value("taskqueue_leases_lost_total") == 0
    assert after.value("taskqueue_redis_errors_total") == 0
    assert after.value("taskqueue_queue_stats_errors_total") == 0
    # Labels are types, queues and small enums, never task ids.
    for sample in after.samples:
        if sample.name.startswith("taskqueue_"):
            assert set(sample.labels) - {"le"} <= BOUNDED_LABELS, sample
            assert not set(sample.labels.values()) & task_ids, sample


def test_metrics_match_what_the_consumers_did(broker, consumer_process, task_types):
    slow = start_a_victim_and_kill_it_mid_run(broker, consumer_process)
    # The survivor reaps the victim once its lease expires and runs everything else.
    port = free_port()
    survivor = consumer_process(
        "--lease", "1", "--concurrency", "4", "--consumer-id", "survivor", "--metrics-port", str(port)
    )
    url = f"http://127.0.0.1:{port}/metrics"
    ok = producer.enqueue(OK, count=5)
    flaky = producer.enqueue(FLAKY, kwargs={"fail_until_attempt": 1}, count=2)
    dead = producer.enqueue(DEAD, kwargs={"fail_until_attempt": 99})
    limited = producer.enqueue(LIMITED, count=3)
    check_while_recovered_tasks_run(url)

    unlimited = [*slow, *ok, *flaky, *dead]
    wait_until(lambda: all(is_final(broker, t.id) for t in unlimited), 30, message="every unlimited task to finish")
    # The gate admits one LIMITED task per minute: one runs, the other two wait in delayed.
    wait_until(lambda: any(is_final(broker, t.id) for t in limited), 30, message="the admitted limited task to end")
    expected_delayed = len(limited) - 1
    after = wait_until(
        lambda: scrape_when(
            url,
            lambda s: (
                s.value("taskqueue_consumer_in_flight_tasks") == 0
                and s.value("taskqueue_queue_tasks", queue="default", state="delayed") == expected_delayed
                and s.value("taskqueue_queue_tasks", queue="default", state="processing") == 0
            ),
        ),
        30,
        message="the survivor to settle",
    )
    check_counters_by_type(after)
    check_rate_limited_tasks_were_deferred(broker, after, limited)
    check_gauges_and_label_cardinality(after, expected_delayed, {t.id for t in [*unlimited, *limited]})

    # Liveness on the same port.
    status, body = http_get(f"http://127.0.0.1:{port}/healthz")
    assert status == 200 and b'"ok"' in body
    assert survivor.terminate() == 0, survivor.log()
