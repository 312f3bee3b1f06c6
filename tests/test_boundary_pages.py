"""Pages over what outside producers and handlers may write: records with odd ids, names and scores, odd queries."""

from __future__ import annotations

import json
import re
import time

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.history import DURATION_BUCKETS_MS
from tasks_app.templatetags.tasks_display import url_or_empty
from tasks_app.web.charts import percentile_ms
from tests.support.enqueued import file_ready

pytestmark = pytest.mark.django_db


def test_a_percentile_in_a_bucket_past_the_table_is_at_least_its_last_bound():
    assert percentile_ms({len(DURATION_BUCKETS_MS) + 5: 3}, 0.5) == DURATION_BUCKETS_MS[-1]
    assert percentile_ms({0: 0, 1: -2}, 0.5) is None


def test_the_browsers_json_stays_strict_json_over_an_infinite_score(staff, broker):
    TaskType.objects.create(name="web.echo", handler="demo.echo", queue="web")
    [task] = producer.enqueue("web.echo", [1])
    broker.client.zadd(broker.keys.history("web"), {task.id: float("inf")})
    response = staff.get("/tasks/?format=json")
    assert response.status_code == 200
    data = json.loads(response.content, parse_constant=lambda name: pytest.fail(f"{name} in strict JSON"))
    assert [row["id"] for row in data["tasks"]] == [task.id] and data["tasks"][0]["cursor"] is None


@pytest.mark.parametrize("query", ["size=%C2%B2", "seen=%C2%B2", "seen=" + "1" * 4301, "size=" + "9" * 30])
def test_the_browser_reads_counts_in_its_query_that_are_not_plain_digits_as_not_given(staff, broker, query):
    assert staff.get(f"/tasks/?{query}").status_code == 200


def test_a_progress_report_past_a_floats_range_shows_no_bar(staff, broker):
    TaskType.objects.create(name="web.echo", handler="demo.echo", queue="web")
    [task] = producer.enqueue("web.echo", [1])
    broker.client.hset(broker.keys.result(task.id), "progress", json.dumps({"current": 10**400, "total": 1}))
    assert staff.get(f"/tasks/{task.id}/").status_code == 200


@pytest.mark.parametrize("task_id", ["dashboard", "enqueue"])
def test_a_task_whose_id_names_another_page_is_listed_unlinked(staff, broker, task_id):
    TaskType.objects.create(name="web.echo", handler="demo.echo", queue="web")
    producer.enqueue_many([producer.TaskRequest("web.echo", [1], task_id=task_id)])
    assert url_or_empty("tasks_app:task", task_id) == ""
    page = staff.get("/tasks/?status=READY").content.decode()  # waiting: read from its queue
    assert f">{task_id}</" in page and f'href="/tasks/{task_id}/">{task_id}</a>' not in page


def test_an_action_on_a_task_whose_id_holds_a_nul_is_logged_with_it_escaped(staff, broker):
    # A foreign producer's envelope: PostgreSQL's text refuses NUL, so the log entry must not hold one.
    broker.client.hset(broker.keys.result("a\x00b"), mapping={"status": "FAILED", "type": "web.echo", "queue": "web"})
    broker.client.zadd(broker.keys.history("web"), {"a\x00b": time.time() * 1000})
    response = staff.post("/tasks/", {"action": "delete", "task": ["a\x00b"]})
    assert response.status_code == 302 and broker.records.get_result("a\x00b") is None
    [entry] = LogEntry.objects.all()
    assert "\x00" not in entry.object_id + entry.object_repr + entry.change_message


@pytest.mark.parametrize("score", [float("inf"), 1e300, float("-inf")])
def test_the_browser_pages_through_tasks_scored_past_any_time(staff, broker, score):
    TaskType.objects.create(name="web.echo", handler="demo.echo", queue="web")
    ids = [task.id for task in producer.enqueue("web.echo", [1], count=30)]
    broker.client.zadd(broker.keys.history("web"), dict.fromkeys(ids, score))
    first = staff.get("/tasks/?size=25").content.decode()
    older = re.search(r'href="\?([^"]*)" id="page-older"', first)
    assert older, "an Older link"
    second = staff.get("/tasks/?" + older.group(1).replace("&amp;", "&")).content.decode()
    listed = re.findall(r'data-task="([^"]+)"', first) + re.findall(r'data-task="([^"]+)"', second)
    assert sorted(listed) == sorted(ids)  # before: Older showed the first page again, and again


def test_a_record_whose_id_field_names_another_task_is_shown_and_acted_on_under_its_own_key(staff, broker):
    # Before: the `id` field won over the key, so cancelling this row (or deleting it) hit the other task.
    TaskType.objects.create(name="web.echo", handler="demo.echo", queue="web")
    [other] = producer.enqueue("web.echo", [1])
    file_ready(broker, [other.id], "web")  # listed in the history, as an old producer's task
    fields = {"id": other.id, "type": "web.echo", "queue": "web", "status": "READY"}
    broker.client.hset(broker.keys.result("foreign"), mapping=fields)
    broker.client.zadd(broker.keys.history("web"), {"foreign": time.time() * 1000 + 1000})
    assert staff.get("/api/tasks/foreign/").json()["id"] == "foreign"
    assert 'action="/tasks/foreign/cancel/"' in staff.get("/tasks/foreign/").content.decode()
    listed = re.findall(r'name="task" value="([^"]+)"', staff.get("/tasks/").content.decode())
    assert listed == ["foreign", other.id]
    staff.post("/tasks/", {"action": "cancel", "task": ["foreign"]})
    assert (broker.records.get_result("foreign")["status"], broker.records.get_result(other.id)["status"]) == (
        "CANCELLED",
        "READY",
    )


def test_a_records_schedule_name_that_no_row_can_have_is_shown_unlinked_without_a_query(staff, broker):
    # A NUL in a query is an error on PostgreSQL (its text holds none): before, this page answered 500 there.
    fields = {"type": "web.echo", "queue": "web", "periodic": "nightly\x00"}
    broker.client.hset(broker.keys.result("t1"), mapping=fields)
    with CaptureQueriesContext(connection) as queries:
        page = staff.get("/tasks/t1/")
    assert page.status_code == 200 and "nightly\\x00" in page.content.decode()
    assert not [query for query in queries.captured_queries if "tasks_app_periodictask" in query["sql"]]
