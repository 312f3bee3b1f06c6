"""Pages, API and metrics beside a queue whose key a foreign writer made another type: it alone is unreadable."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tasks_app import producer
from tasks_app.collectors import QueueCollector
from tasks_app.consumer.loops import make_app
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task, encode_task
from tests.support.scrape import Scrape

pytestmark = pytest.mark.django_db

UNREACHABLE = "Redis is unreachable"


def _minute(broker: Broker) -> str:
    return broker.keys.minute("bad", int(time.time()) // 60)


# Every key of a queue that the dashboard, the queue API or the collector reads, each written as a type it is not.
QUEUE_KEYS: dict[str, Callable[[Broker], str]] = {
    "pending": lambda broker: broker.keys.pending("bad"),
    "prioritized": lambda broker: broker.keys.prioritized("bad"),
    "delayed": lambda broker: broker.keys.delayed("bad"),
    "dead": lambda broker: broker.keys.dead("bad"),
    "suspects": lambda broker: broker.keys.suspects("bad"),
    "consumers": lambda broker: broker.keys.consumers("bad"),
    "consumer_info": lambda broker: broker.keys.consumer_info("bad"),
    "reaped": lambda broker: broker.keys.reaped("bad"),
    "processing": lambda broker: broker.keys.processing("bad", "c1"),
    "paused": lambda broker: broker.keys.paused("bad"),
}


def spoil(broker: Broker, key: str) -> None:
    """Make `key` a type no reader of it expects: a list where a hash is read, else a hash."""
    broker.client.delete(key)
    if key.endswith(":consumer_info") or ":minute:" in key or key.startswith(broker.keys.result("")):
        broker.client.rpush(key, "foreign")
    else:
        broker.client.hset(key, "foreign", "1")


def spoil_as_string(broker: Broker, key: str) -> None:
    """Make `key` a string: no reader of a list, a hash or a sorted set takes it."""
    broker.client.delete(key)
    broker.client.set(key, "foreign")


@pytest.fixture
def two_queues(broker, echo_type) -> tuple[str, str]:
    """A task on the good queue `web` and one on `bad` (with a live consumer c1 there); their ids."""
    [good] = producer.enqueue("web.echo", [1])
    [bad] = producer.enqueue("web.echo", [2], queue="bad")
    broker.client.zadd(broker.keys.consumers("bad"), {"c1": time.time() * 1000 + 60_000})
    return good.id, bad.id


@pytest.mark.parametrize("name", list(QUEUE_KEYS))
def test_the_dashboard_shows_a_queue_with_a_foreign_key_as_unreadable_and_the_others_as_usual(
    staff, broker, two_queues, name
):
    key = QUEUE_KEYS[name](broker)
    spoil(broker, key)
    response = staff.get("/tasks/dashboard/")
    page = response.content.decode()
    assert response.status_code == 200 and UNREACHABLE not in page  # before: 503 for every queue
    assert '<tr class="queue-row" data-queue="web">\n        <td><strong>web</strong></td>\n        <td>1</td>' in page
    row = page[page.index('data-queue="bad"') :]
    assert 'class="queue-unreadable"' in row[: row.index("</tr>")] and "WRONGTYPE" in row and key in row


def test_the_dashboards_charts_show_a_queue_whose_minute_is_foreign_as_unreadable(staff, broker, two_queues):
    broker.client.hset(broker.keys.minute("web", int(time.time()) // 60), "ok", "3")
    spoil(broker, _minute(broker))
    response = staff.get("/tasks/dashboard/")
    page = response.content.decode()
    assert response.status_code == 200 and UNREACHABLE not in page  # before: 503
    assert '<div class="queue-charts" data-queue="web"><figure' in page
    chart = page[page.index('class="queue-charts queue-unreadable" data-queue="bad"') :]
    assert "WRONGTYPE" in chart[: chart.index("</div>")]
    series = staff.get("/tasks/dashboard/series.json")
    assert series.status_code == 200  # before: 503
    data = series.json()
    assert list(data["queues"]) == ["web"] and data["queues"]["web"]["ok"][-1] == 3
    assert "WRONGTYPE" in data["unreadable"]["bad"] and _minute(broker) in data["unreadable"]["bad"]


@pytest.mark.parametrize(
    ("index", "query"),
    [
        ("history", ""),
        ("history", "type=web.echo"),
        ("history", "range=1h"),
        ("history:READY", "status=READY"),
        ("history:ids", "q=pre-"),
    ],
)
def test_the_task_browser_lists_the_other_queues_beside_one_whose_index_is_foreign(
    staff, broker, echo_type, index, query
):
    producer.enqueue_many([producer.TaskRequest("web.echo", [1], task_id="pre-good")])
    producer.enqueue_many([producer.TaskRequest("web.echo", [2], queue="bad", task_id="pre-bad")])
    key = f"{broker.keys.history('bad')}{index.removeprefix('history')}"
    spoil(broker, key)
    response = staff.get(f"/tasks/?{query}")
    page = response.content.decode()
    assert response.status_code == 200 and UNREACHABLE not in page  # before: 503 for every queue
    assert 'data-task="pre-good"' in page
    note = page[page.index('class="errornote queue-unreadable"') :]
    assert "bad" in note[: note.index("</p>")] and "WRONGTYPE" in note and key in note
    listed = staff.get(f"/tasks/?{query}&format=json")
    assert listed.status_code == 200
    data = listed.json()
    assert "pre-good" in [row["id"] for row in data["tasks"]] and key in data["unreadable"]["bad"]


def test_the_task_browser_filtered_to_a_queue_with_a_foreign_index_says_so(staff, broker, two_queues):
    spoil(broker, broker.keys.history("bad"))
    response = staff.get("/tasks/?queue=bad")
    page = response.content.decode()
    assert response.status_code == 200 and UNREACHABLE not in page  # before: 503
    assert 'class="task-row"' not in page and "WRONGTYPE" in page
    assert staff.get("/tasks/?queue=web").status_code == 200


def test_the_page_of_a_task_whose_record_is_foreign_says_why_it_cannot_be_read(staff, broker, two_queues):
    good, _ = two_queues
    key = broker.keys.result(good)
    spoil(broker, key)
    response = staff.get(f"/tasks/{good}/")
    page = response.content.decode()
    assert response.status_code == 404 and UNREACHABLE not in page  # before: "Not Found", without the reason
    assert 'id="redis-refused"' in page and key in page and "WRONGTYPE" in page
    api = staff.get(f"/api/tasks/{good}/")
    assert api.status_code == 404 and key in api.json()["error"] and "WRONGTYPE" in api.json()["error"]


def test_the_page_of_a_task_whose_queues_pause_state_is_foreign_shows_the_task(staff, broker, two_queues):
    _, bad = two_queues
    spoil(broker, broker.keys.paused("bad"))
    response = staff.get(f"/tasks/{bad}/")
    page = response.content.decode()
    assert response.status_code == 200  # before: 503, Redis is unreachable
    assert 'id="task-queue-unreadable"' in page and "WRONGTYPE" in page


def test_a_queues_dead_letters_are_listed_whatever_its_other_keys_hold(staff, broker, two_queues):
    task = Task(id="gone", type="web.echo", payload=b"{}", queue="bad", attempt=3)
    broker.client.zadd(broker.keys.dead("bad"), {encode_task(task): time.time() * 1000})
    spoil(broker, broker.keys.pending("bad"))
    response = staff.get("/tasks/dashboard/bad/dead/")
    assert response.status_code == 200 and 'data-task-id="gone"' in response.content.decode()  # before: 503
    spoil(broker, broker.keys.dead("bad"))
    response = staff.get("/tasks/dashboard/bad/dead/")
    page = response.content.decode()
    assert response.status_code == 200 and UNREACHABLE not in page
    assert 'id="dead-unreadable"' in page and broker.keys.dead("bad") in page


def test_the_queue_api_answers_a_queue_with_a_foreign_key_as_unreadable(staff, broker, two_queues):
    spoil(broker, broker.keys.pending("bad"))
    response = staff.get("/api/queues/bad/")
    assert response.status_code == 200  # before: 503, Redis is unreachable
    state = response.json()
    assert state["queue"] == "bad" and "WRONGTYPE" in state["unreadable"] and "pending" not in state
    assert state["paused"] is False and state["paused_by"] is None
    assert staff.get("/api/queues/web/").json()["pending"] == 1
    paused = staff.post("/api/queues/bad/pause/")
    assert paused.status_code == 200 and paused.json()["changed"] is True and paused.json()["paused"] is True


def test_the_pages_beside_a_foreign_queue_set_list_the_queues_of_task_types_and_say_why(staff, broker, two_queues):
    good, _ = two_queues
    key = broker.keys.queues()
    spoil_as_string(broker, key)
    response = staff.get("/tasks/dashboard/")
    page = response.content.decode()
    assert response.status_code == 200 and UNREACHABLE not in page  # before: 500, Redis refused a read
    assert 'data-queue="web"' in page and 'data-queue="bad"' not in page  # web: the task type's queue
    note = page[page.index('id="queue-set-unreadable"') :]
    assert "WRONGTYPE" in note[: note.index("</p>")] and key in note[: note.index("</p>")]
    series = staff.get("/tasks/dashboard/series.json")
    assert series.status_code == 200 and list(series.json()["queues"]) == ["web"]  # before: 500
    assert key in series.json()["queue_set_unreadable"]
    browser = staff.get("/tasks/")
    assert browser.status_code == 200 and f'data-task="{good}"' in browser.content.decode()  # before: 500
    assert 'id="queue-set-unreadable"' in browser.content.decode()
    listed = staff.get("/tasks/?format=json")
    assert listed.status_code == 200 and good in [row["id"] for row in listed.json()["tasks"]]
    assert key in listed.json()["queue_set_unreadable"]


def test_enqueues_and_pauses_beside_a_foreign_queue_set_are_done_and_answered_so(staff, broker, echo_type):
    key = broker.keys.queues()
    spoil_as_string(broker, key)
    created = staff.post("/api/tasks/", data='{"type": "web.echo", "args": [1]}', content_type="application/json")
    assert created.status_code == 201  # before: 503, yet the task was pushed (without its record)
    assert broker.client.llen(broker.keys.pending("web")) == 1 and broker.get_result(created.json()["id"])
    TaskType.objects.create(name="web.once", handler="demo.echo", queue="once", unique_for_s=60)
    for request in (
        producer.TaskRequest("web.echo", [2], queue="later", delay_s=60),
        producer.TaskRequest("web.once", [3]),
    ):
        [task] = producer.enqueue_many([request])  # before: EnqueueError or QueueUnavailable
        assert broker.get_result(task.id)["status"] == "READY"
    assert broker.client.zcard(broker.keys.delayed("later")) == 1 and broker.client.llen(broker.keys.pending("once"))
    paused = staff.post("/api/queues/web/pause/")
    assert paused.status_code == 200 and paused.json()["changed"] is True  # before: 500, yet paused
    assert broker.client.get(key) == b"foreign"


@pytest.mark.parametrize("name", [name for name in QUEUE_KEYS if name != "paused"])  # paused: only EXISTS
def test_the_collector_exports_every_other_queue_and_the_unreadable_one_with_its_reason(broker, two_queues, name):
    key = QUEUE_KEYS[name](broker)
    spoil(broker, key)
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: broker))
    status, body = _get(make_app(None, registry), "/metrics")  # a consumer's /metrics
    scrape = Scrape(body.decode())
    assert status.startswith("200")
    assert scrape.value("taskqueue_queue_stats_up") == 1  # before: 0, and no queue's depth at all
    assert scrape.value("taskqueue_queue_tasks", queue="web", state="pending") == 1
    assert not scrape.has("taskqueue_queue_tasks", queue="bad")
    [sample] = [s for s in scrape.samples if s.name == "taskqueue_queue_unreadable"]
    assert sample.labels["queue"] == "bad" and sample.value == 1
    assert "WRONGTYPE" in sample.labels["reason"] and key in sample.labels["reason"]


def _get(app, path: str) -> tuple[str, bytes]:
    status: list[str] = []
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET"}, lambda s, headers: status.append(s)))
    return status[0], body


def test_a_consumers_log_says_once_that_a_queue_is_unreadable_and_when_it_is_read_again(broker, two_queues, caplog):
    collector = QueueCollector(lambda: broker)
    spoil(broker, broker.keys.pending("bad"))
    for _ in range(3):
        list(collector.collect())
    broker.client.delete(broker.keys.pending("bad"))
    list(collector.collect())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("queue stats: queue bad")]
    assert len(lines) == 2 and "WRONGTYPE" in lines[0] and "read again" in lines[1], lines


def test_the_collector_beside_a_foreign_queue_set_exports_its_consumers_queues_and_says_why_once(
    broker, echo_type, caplog
):
    producer.enqueue("web.echo", [1], queue="mine")
    producer.enqueue("web.echo", [2], queue="elsewhere")
    key = broker.keys.queues()  # lists queues for the dashboard only
    spoil_as_string(broker, key)
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: broker, ["mine"]))  # a consumer of queue "mine"
    for _ in range(2):
        scrape = Scrape(generate_latest(registry).decode())
        assert scrape.value("taskqueue_queue_stats_up") == 1  # before: 0, and no queue's depth at all
        assert scrape.value("taskqueue_queue_tasks", queue="mine", state="pending") == 1
        assert not scrape.has("taskqueue_queue_tasks", queue="elsewhere")
        [sample] = [s for s in scrape.samples if s.name == "taskqueue_queue_set_unreadable"]
        assert sample.value == 1 and "WRONGTYPE" in sample.labels["reason"] and key in sample.labels["reason"]
    said = [r.getMessage() for r in caplog.records if "queue set" in r.getMessage()]
    assert len(said) == 1 and key in said[0] and "WRONGTYPE" in said[0], said
    broker.client.delete(key)
    broker.client.sadd(key, "elsewhere")
    mended = Scrape(generate_latest(registry).decode())
    assert mended.value("taskqueue_queue_tasks", queue="elsewhere", state="pending") == 1
    assert not mended.has("taskqueue_queue_set_unreadable")
    assert any(m.startswith("queue stats: the queue set is read again") for m in caplog.messages)
