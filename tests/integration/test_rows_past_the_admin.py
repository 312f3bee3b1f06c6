"""Task type rows written past the admin (`QuerySet.update()`, as the README's examples do, or raw SQL), read
by a real consumer and the producer: a value outside the admin's bounds is read as the nearest bound."""

import json
import math
import time

import pytest
from django.core.management import call_command

from tasks_app import producer
from tasks_app.models import UNIQUE_FOR_MAX_S, TaskType
from tasks_app.task_types import TaskTypeConfig, recent_task_types
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs
from tests.support.throttle_handlers import most_at_once, spans

pytestmark = pytest.mark.django_db(transaction=True)


def written_past_the_admin(name: str, handler: str, **fields: object) -> None:
    TaskType.objects.create(name=name, handler=handler)
    TaskType.objects.filter(name=name).update(**fields)
    recent_task_types.forget(name)


def test_a_rate_limit_of_zero_is_read_as_one_per_period_not_as_unlimited(broker, consumer_in_thread):
    written_past_the_admin("zero.rate", "test.record", rate_limit=0, rate_period=3600)
    with consumer_in_thread(concurrency=4):
        tasks = producer.enqueue("zero.rate", count=3)
        wait_until(lambda: recorded_runs(broker), 10, message="the first task to run")
        wait_until(lambda: broker.inspect.queue_stats("default").delayed == 2, 10, message="the other two to wait")
        time.sleep(1)  # a limit read as none would have run them by now
    assert [run["task_id"] for run in recorded_runs(broker)] in ([task.id] for task in tasks)


def test_a_cap_of_zero_is_read_as_one_at_a_time_not_as_unlimited(broker, consumer_in_thread):
    written_past_the_admin("zero.cap", "test.span", max_running=0)
    with consumer_in_thread(concurrency=4):
        producer.enqueue("zero.cap", kwargs={"sleep_s": 0.3}, count=3)
        wait_until(lambda: len([e for e in spans(broker) if e["event"] == "end"]) == 3, 20, message="all three to end")
    assert most_at_once(spans(broker)) == 1


@pytest.mark.parametrize("window_s", [math.inf, 1e300])
def test_a_unique_window_past_the_admin_s_bound_is_read_as_the_bound(broker, staff, window_s):
    written_past_the_admin("unique.forever", "demo.echo", unique_for_s=window_s)
    response = staff.post("/api/tasks/", json.dumps({"type": "unique.forever", "args": [1]}), "application/json")
    assert response.status_code == 201, response.content
    [again] = producer.enqueue("unique.forever", [1])
    assert again.duplicate and again.id == response.json()["id"]
    [key] = broker.client.keys(broker.keys.unique("default", "*"))
    assert UNIQUE_FOR_MAX_S * 1000 - 60_000 < broker.client.pttl(key) <= UNIQUE_FOR_MAX_S * 1000
    call_command("enqueue", "unique.forever", "--args", "[2]")  # the command too: no traceback


@pytest.mark.parametrize(
    ("written", "read"),
    [
        ({"rate_limit": 0, "max_running": 0}, {"rate_limit": 1, "max_running": 1}),
        ({"rate_limit": None, "max_running": None}, {"rate_limit": None, "max_running": None}),
        ({"unique_for_s": math.nan}, {"unique_for_s": UNIQUE_FOR_MAX_S}),  # PostgreSQL stores NaN
        ({"unique_for_s": 60.0}, {"unique_for_s": 60.0}),
        ({"timeout": math.nan}, {"timeout_s": None}),  # an async run timed out at once, a thread run never
        ({"timeout": math.inf}, {"timeout_s": None}),
        ({"timeout": 0.0}, {"timeout_s": None}),
        ({"timeout": -5.0}, {"timeout_s": 0.001}),
        ({"timeout": 2.5}, {"timeout_s": 2.5}),
    ],
)
def test_the_settings_read_from_a_row_keep_within_the_admin_s_bounds(written, read):
    config = TaskTypeConfig.from_model(TaskType(name="t", handler="demo.echo", **written))
    assert {field: getattr(config, field) for field in read} == read
