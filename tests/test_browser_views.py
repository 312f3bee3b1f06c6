"""The task browser `/tasks/`, its bulk actions, the dashboard charts and the live pages, with the test client."""

import re
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

import tasks_app
from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.periodic.config import PeriodicConfig
from tasks_app.periodic.firing import fire_slot, run_id
from tasks_app.periodic.schedule import Schedule
from tasks_app.protocol import history, records
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.codec import Arguments, Task
from tasks_app.protocol.history import bucket_of
from tasks_app.protocol.periodic import SlotFiring
from tasks_app.protocol.records import ResultUpdate
from tasks_app.templatetags.tasks_display import age, when
from tasks_app.web.charts import chart_data
from tests.support.enqueued import file_ready
from tests.support.periodic import current_slot_ms

pytestmark = pytest.mark.django_db


def _enqueue(type_name="demo.echo", queue="b", count=1, **kwargs):
    """Enqueue tasks filed in the history as READY (as old producers' were): the tests of paging and filters."""
    ids = [task.id for task in producer.enqueue(type_name, queue=queue, count=count, **kwargs)]
    file_ready(get_broker(), ids, queue)
    return ids


def _set_status(broker, task_id, status, queue="b", **fields):
    broker.client.hdel(*broker.keys.waiting_mark(task_id))  # as its claim would
    extra = {"finished_at_ms": str(int(time.time() * 1000))} if status in records.FINISHED else {}
    broker.records.record_result(ResultUpdate(task_id, {"status": status, **extra, **fields}, 60, queue=queue))


def _listed(response):
    assert response.status_code == 200
    return re.findall(r'class="task-row" data-task="([^"]+)"', response.content.decode())


def test_the_browser_is_for_staff_only(client, broker):
    assert client.get("/tasks/").status_code == 302
    user = get_user_model().objects.create_user("plain", password="x")
    client.force_login(user)
    assert client.get("/tasks/").status_code == 302


def test_newest_first_and_each_row_links_to_its_task(staff, broker):
    ids = _enqueue(count=3)
    listed = _listed(staff.get("/tasks/"))
    assert listed == ids[::-1]
    assert f'href="/tasks/{ids[0]}/"' in staff.get("/tasks/").content.decode()


def test_periodic_runs_and_unique_tasks_are_listed_ready_before_any_consumer_runs(staff, broker):
    TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="b", unique_for_s=600)
    config = PeriodicConfig(name="tick", task_type="demo.echo", schedule=Schedule(interval_s=1))
    slot_ms = current_slot_ms(broker)
    assert fire_slot(config, SlotFiring(slot_ms, slot_ms - 1000, 60_000, "skip"), broker).pushed
    unique, duplicate = producer.enqueue("demo.echo", [1], queue="b", count=2)
    assert duplicate.duplicate
    expected = [unique.id, run_id("tick", slot_ms)]  # read from the queue: pending newest first
    assert _listed(staff.get("/tasks/?status=READY")) == expected
    assert _listed(staff.get("/tasks/?status=READY&queue=b")) == expected
    page = staff.get("/tasks/?status=READY").content.decode()
    assert "2 tasks waiting" in page and 'id="waiting-note"' in page


def test_status_filter(staff, broker):
    ok, bad, waiting = _enqueue(count=3)
    _set_status(broker, ok, "SUCCESSFUL")
    _set_status(broker, bad, "RUNNING")
    _set_status(broker, bad, "FAILED")
    assert _listed(staff.get("/tasks/?status=FAILED")) == [bad]
    assert _listed(staff.get("/tasks/?status=SUCCESSFUL")) == [ok]
    assert _listed(staff.get("/tasks/?status=READY")) == [waiting]
    assert _listed(staff.get("/tasks/?status=RUNNING")) == []
    assert "Unknown status" in staff.get("/tasks/?status=NOPE").content.decode()


def test_type_and_queue_filters(staff, broker):
    echo = _enqueue("demo.echo", queue="b")
    sleep = _enqueue("demo.sleep", queue="b")
    other = _enqueue("demo.echo", queue="c")
    assert _listed(staff.get("/tasks/?type=demo.sleep")) == sleep
    assert _listed(staff.get("/tasks/?queue=c")) == other
    assert _listed(staff.get("/tasks/?type=demo.echo&queue=b")) == echo
    _set_status(broker, echo[0], "FAILED")
    assert _listed(staff.get("/tasks/?status=FAILED&type=demo.echo")) == echo
    assert _listed(staff.get("/tasks/?status=FAILED&type=demo.sleep")) == []


def test_time_range_filters(staff, broker):
    old = _enqueue()[0]
    broker.client.zadd(broker.keys.history("b"), {old: (time.time() - 7200) * 1000}, xx=True)
    broker.client.zadd(broker.keys.history_status("b", "READY"), {old: (time.time() - 7200) * 1000}, xx=True)
    new = _enqueue()[0]
    assert _listed(staff.get("/tasks/?range=1h")) == [new]
    assert _listed(staff.get("/tasks/?range=24h")) == [new, old]
    until = (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S")
    assert _listed(staff.get(f"/tasks/?until={until}")) == [old]
    since = (datetime.now(UTC) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S")
    assert _listed(staff.get(f"/tasks/?since={since}")) == [new]


@pytest.mark.parametrize(
    "query",
    [
        "since=2026-13-45T10:00",
        "until=2026-02-30T10:00",
        "since=0001-01-01T00:00%2B14:00",
        "until=9999-12-31T23:59-14:00",
    ],
)
def test_a_time_off_the_calendar_is_refused_with_a_message(staff, broker, query):
    task_id = _enqueue()[0]
    response = staff.get(f"/tasks/?{query}")
    assert _listed(response) == [task_id]
    assert "must be a date and time like" in response.content.decode()


def test_search_by_id_and_by_prefix(staff, broker):
    first, second = _enqueue(count=2)
    assert _listed(staff.get(f"/tasks/?q={first}")) == [first]
    assert _listed(staff.get(f"/tasks/?q={second[:6]}")) == [second]
    assert _listed(staff.get("/tasks/?q=zzzz")) == []


def test_pagination_follows_the_older_cursor(staff, broker):
    ids = _enqueue(count=30)[::-1]
    first = staff.get("/tasks/?size=25")
    assert _listed(first) == ids[:25]
    assert "30 tasks in the history" in first.content.decode()
    older = re.search(r'href="\?([^"]*before=[^"]+)" id="page-older"', first.content.decode())[1]
    second = staff.get("/tasks/?" + older.replace("&amp;", "&"))
    assert _listed(second) == ids[25:]
    assert 'id="page-older"' not in second.content.decode()


def _same_enqueue_time(broker, ids, queue):
    """File tasks at one score, as a foreign producer's tasks of one millisecond are."""
    for key in (broker.keys.history(queue), broker.keys.history_status(queue, "READY")):
        broker.client.zadd(key, dict.fromkeys(ids, 1_700_000_000_000), xx=True)


def _all_pages(client, query):
    """The rows of every page, following the "Older" links."""
    rows, url = [], f"/tasks/?{query}"
    while url:
        response = client.get(url)
        rows += _listed(response)
        page = response.content.decode()
        older = re.search(r'href="\?([^"]*before=[^"]+)" id="page-older"', page)
        url = "/tasks/?" + older[1].replace("&amp;", "&") if older else None
    return rows


def test_pages_go_on_through_tasks_of_one_enqueue_time_in_several_queues(staff, broker):
    ids = _enqueue(queue="b", count=20) + _enqueue(queue="c", count=20)
    _same_enqueue_time(broker, ids[:20], "b")
    _same_enqueue_time(broker, ids[20:], "c")
    rows = _all_pages(staff, "size=25")
    assert sorted(rows) == sorted(ids) and len(rows) == 40
    waiting = _all_pages(staff, "size=25&status=READY")  # read from the queues, in their order
    assert sorted(waiting) == sorted(rows) and len(waiting) == 40


def test_a_type_filter_goes_on_through_tasks_of_one_enqueue_time(staff, broker, monkeypatch):
    monkeypatch.setattr("tasks_app.web.browser.CHUNK", 4)  # the run spans several windows
    TaskType.objects.create(name="demo.fail", handler="demo.fail", queue="b")
    wanted = _enqueue(count=10)
    others = _enqueue("demo.fail", count=10)
    _same_enqueue_time(broker, wanted + others, "b")
    assert sorted(_all_pages(staff, "size=25&type=demo.echo")) == sorted(wanted)


def test_the_json_format(staff, broker):
    task_id = _enqueue(args=[1])[0]
    data = staff.get("/tasks/?format=json").json()
    assert [row["id"] for row in data["tasks"]] == [task_id]
    assert data["tasks"][0]["type"] == "demo.echo" and data["total"] == 1
    assert "args" not in data["tasks"][0]  # a row leaves out what may be megabytes: the task's own JSON has it


def test_bulk_retry_enqueues_linked_copies_and_logs_them(staff, broker):
    original = _enqueue(args=["x"], kwargs={"k": 1})[0]
    _set_status(broker, original, "FAILED")
    response = staff.post("/tasks/?status=FAILED", {"action": "retry", "task": [original]})
    assert response.status_code == 302 and response["Location"] == "/tasks/?status=FAILED"
    retry_id = next(i for i in _listed(staff.get("/tasks/?status=READY")) if i != original)
    retry = records.ResultRecord.from_fields(broker.records.get_result(retry_id))
    assert (retry.type, retry.args, retry.kwargs, retry.queue, retry.retry_of) == (
        "demo.echo",
        ["x"],
        {"k": 1},
        "b",
        original,
    )
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.action_flag) == (original, ADDITION) and retry_id in entry.change_message
    page = staff.get(f"/tasks/{retry_id}/").content.decode()
    assert "Retry of" in page and f'href="/tasks/{original}/"' in page
    assert f'href="/tasks/{retry_id}/"' in staff.get(f"/tasks/{original}/").content.decode()


def test_bulk_retry_of_a_unique_task_whose_key_is_held_links_nothing_and_says_so(staff, broker):
    TaskType.objects.create(name="u.echo", handler="demo.echo", queue="b", unique_for_s=3600)
    original = _enqueue("u.echo", args=[1])[0]  # it holds its own key for the hour
    _set_status(broker, original, "FAILED")
    response = staff.post("/tasks/?status=FAILED", {"action": "retry", "task": [original]}, follow=True)
    shown = [str(message) for message in response.context["messages"]]
    assert shown == [
        "Enqueued 0 retry task(s). 1 not retried: a task of the same unique type and key is enqueued already."
    ]
    assert "retried_as" not in broker.records.get_result(original), "linked to itself as its own retry"
    assert not LogEntry.objects.exists() and broker.inspect.queue_stats("b").pending == 1


def test_bulk_delete_removes_finished_records_only(staff, broker):
    done, waiting = _enqueue(count=2)
    _set_status(broker, done, "SUCCESSFUL")
    staff.post("/tasks/", {"action": "delete", "task": [done, waiting]})
    assert broker.records.get_result(done) is None and broker.records.get_result(waiting) is not None
    assert _listed(staff.get("/tasks/")) == [waiting]
    assert list(LogEntry.objects.values_list("object_id", "action_flag")) == [(done, DELETION)]


def test_bulk_delete_counts_every_record_it_deleted(staff, broker):
    finished = _enqueue(count=4)
    for task_id in finished:
        _set_status(broker, task_id, "FAILED")
    response = staff.post("/tasks/", {"action": "delete", "task": finished[:3]}, follow=True)
    assert [str(message) for message in response.context["messages"]] == ["Deleted 3 record(s)."]
    assert [broker.records.get_result(task_id) is None for task_id in finished] == [True, True, True, False]


def test_bulk_actions_need_their_permission_and_csrf(broker):
    task_id = _enqueue()[0]
    user = get_user_model().objects.create_user("staffer", password="x", is_staff=True)
    client = Client()
    client.force_login(user)
    assert 'name="action"' not in client.get("/tasks/").content.decode()
    assert client.post("/tasks/", {"action": "retry", "task": [task_id]}).status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="enqueue_task"))
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user)
    assert strict.post("/tasks/", {"action": "retry", "task": [task_id]}).status_code == 403
    assert client.post("/tasks/", {"action": "retry", "task": [task_id]}).status_code == 302
    assert client.post("/tasks/", {"action": "delete", "task": [task_id]}).status_code == 403
    assert LogEntry.objects.count() == 1


def test_user_data_is_escaped(staff, broker):
    task_id = _enqueue(args=["<script>alert(1)</script>"])[0]
    error = records.error_record("x.Boom", "Traceback\nValueError: <img src=x onerror=alert(1)>")
    broker.records.record_result(ResultUpdate(task_id, {"status": "FAILED"}, 60, append_error=error, queue="b"))
    page = staff.get("/tasks/").content.decode()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<script>alert" not in staff.get(f"/tasks/{task_id}/").content.decode()


def test_the_cap_of_the_index_drops_the_oldest_from_the_browser(staff, broker):
    broker.records.history_max = 3
    ids = [_enqueue()[0] for _ in range(5)]
    assert _listed(staff.get("/tasks/")) == ids[:1:-1]


def test_the_dashboard_draws_charts_from_the_counters(staff, broker, consumer_in_thread):
    ids = _enqueue(count=3)
    with consumer_in_thread(queues=["b"], concurrency=2):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _listed(staff.get("/tasks/?status=SUCCESSFUL")) != ids[::-1]:
            time.sleep(0.1)
    page = staff.get("/tasks/dashboard/").content.decode()
    assert page.count("<svg") >= 4 and "<polyline" in page and "b: tasks per minute" in page
    assert 'href="/tasks/"' in page and "live.js" in page
    series = staff.get("/tasks/dashboard/series.json").json()
    assert sum(series["queues"]["b"]["ok"]) == 3 and len(series["minutes"]) == 60
    assert sum(series["types"]["demo.echo"]["ok"]) == 3
    assert series["types"]["demo.echo"]["hour_p50_ms"] is not None


def test_a_types_minute_durations_count_its_runs_in_every_queue(broker):
    minute = int(time.time()) // 60
    fast, slow = bucket_of(3), bucket_of(4000)
    broker.client.hset(broker.keys.minute("a", minute), mapping={"ok|demo.echo": 9, f"d|demo.echo|{fast}": 9})
    broker.client.hset(broker.keys.minute("b", minute), mapping={"ok|demo.echo": 1, f"d|demo.echo|{slow}": 1})
    series = chart_data(broker, ["a", "b"], now_s=minute * 60)["types"]["demo.echo"]
    assert series["hour_total"] == 10
    assert series["p50_ms"][-1] == series["hour_p50_ms"] < 5  # nine runs of ten were fast
    assert series["p95_ms"][-1] == series["hour_p95_ms"] > 2500


def test_the_admin_index_links_the_browser(staff):
    assert 'href="/tasks/"' in staff.get("/admin/").content.decode()


def test_times_show_seconds_age_and_microseconds_on_hover():
    moment = (datetime.now(UTC) - timedelta(seconds=30)).replace(microsecond=123456)
    html = str(when(moment))
    assert moment.strftime("%H:%M:%S") in html and moment.strftime('title="%Y-%m-%d %H:%M:%S.123456 UTC"') in html
    assert "s ago" in html
    assert "2025-12-01 12:00:05" in str(when(datetime(2025, 12, 1, 12, 0, 5, tzinfo=UTC)))  # not today: with the date
    assert age(moment, moment + timedelta(seconds=12)) == "12 s ago"
    assert age(moment, moment + timedelta(minutes=3, seconds=4)) == "3 min ago"
    assert age(moment, moment - timedelta(hours=2)) == "in 2 h"


def test_records_keep_microseconds_and_read_milliseconds_too(broker):
    task_id = _enqueue()[0]
    broker.records.record_result(ResultUpdate(task_id, {"started_at_ms": "1764590405123.456"}, 60))
    record = records.ResultRecord.from_fields(broker.records.get_result(task_id))
    assert record.started_at == datetime(2025, 12, 1, 12, 0, 5, 123456, tzinfo=UTC)
    broker.records.record_result(ResultUpdate(task_id, {"started_at_ms": "1764590405123"}, 60))
    assert records.ResultRecord.from_fields(broker.records.get_result(task_id)).started_at.microsecond == 123000
    first = records.started(Task(id="a", attempt=1), Arguments([], {}), "w", 1764590405123.001, 1, 60, 1)
    second = records.started(Task(id="b", attempt=1), Arguments([], {}), "w", 1764590405123.002, 1, 60, 1)
    assert first.fields["started_at_ms"] < second.fields["started_at_ms"]


def test_bulk_cancel_by_force_lists_running_tasks_for_their_consumers_to_stop(staff, broker):
    waiting, running = _enqueue(count=2)
    _set_status(broker, running, "RUNNING")
    response = staff.post("/tasks/", {"action": "cancel_force", "task": [waiting, running]}, follow=True)
    assert "1 running one(s) stopped by force" in response.content.decode()
    assert records.ResultRecord.from_fields(broker.records.get_result(waiting)).status == "CANCELLED"
    assert broker.client.zscore(broker.keys.cancel_forced("b"), running) is not None
    assert sorted(LogEntry.objects.values_list("change_message", flat=True)) == [
        "Cancel by force: cancelled",
        "Cancel by force: requested",
    ]


def test_bulk_cancel_files_the_tasks_under_cancelled_and_logs_them(staff, broker):
    waiting, done = _enqueue(count=2)
    _set_status(broker, done, "SUCCESSFUL")
    staff.post("/tasks/", {"action": "cancel", "task": [waiting, done]})
    assert records.ResultRecord.from_fields(broker.records.get_result(waiting)).status == "CANCELLED"
    assert _listed(staff.get("/tasks/?status=CANCELLED")) == [waiting]
    assert _listed(staff.get("/tasks/?status=READY")) == []
    assert list(LogEntry.objects.values_list("object_id", flat=True)) == [waiting]


def test_the_browser_names_the_types_whose_ended_tasks_it_cannot_list(staff, broker):
    TaskType.objects.create(name="kept.never", handler="demo.echo", keep_results="never")
    TaskType.objects.create(name="kept.failures", handler="demo.echo", keep_results="failures")
    TaskType.objects.create(name="kept.always", handler="demo.echo")
    note = re.search(r'id="results-not-kept">(.*?)</p>', staff.get("/tasks/").content.decode(), re.S)
    assert note is not None
    assert "kept.failures (only failures kept), kept.never (no outcome kept)" in note.group(1)
    assert "kept.always" not in note.group(1)


def test_a_write_with_no_time_to_live_takes_its_task_out_of_the_history_on_a_cluster_too(staff, broker):
    # On Redis Cluster the index is moved by history_move, apart from the record's write.
    [task_id] = _enqueue()
    keys = history.index_keys(broker.keys, "b")
    broker.records.redis.run("history_move", list(keys), history.status_move_args(task_id, "SUCCESSFUL", "", 0, (0, 0)))
    assert all(broker.client.zscore(key, task_id) is None for key in keys)


def test_the_ready_view_lists_waiting_tasks_from_the_queues_themselves(staff, broker):
    [plain] = producer.enqueue("demo.echo", queue="w")
    [urgent] = producer.enqueue("demo.sleep", [0], queue="w", priority=5)
    [later] = producer.enqueue("demo.echo", queue="w", delay_s=60)
    page = staff.get("/tasks/?status=READY&queue=w&format=json").json()
    assert [(row["id"], row["type"], row["status"]) for row in page["tasks"]] == [
        (plain.id, "demo.echo", "READY"),
        (urgent.id, "demo.sleep", "READY"),
        (later.id, "demo.echo", "READY"),
    ]
    assert page["total"] == 3 and page["tasks"][1]["priority"] == 5 and page["tasks"][2]["run_after"]
    assert _listed(staff.get("/tasks/?status=READY&type=demo.sleep")) == [urgent.id]
    assert not broker.client.exists(broker.keys.history("w"))  # none of them is in the history yet
    tasks_app.cancel(plain.id)  # still in its queue until a consumer drops it: not READY any more
    assert _listed(staff.get("/tasks/?status=READY&queue=w")) == [urgent.id, later.id]


def test_the_ready_view_lists_prioritized_tasks_in_the_order_they_are_claimed(staff, broker):
    [low] = producer.enqueue("demo.echo", queue="w", priority=2)
    [high] = producer.enqueue("demo.echo", queue="w", priority=9)
    [low_later] = producer.enqueue("demo.echo", queue="w", priority=2)
    assert _listed(staff.get("/tasks/?status=READY&queue=w")) == [high.id, low.id, low_later.id]
