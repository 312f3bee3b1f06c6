"""Staff pages over big Redis state: what one request reads and answers stays bounded."""

import json
import re

import pytest
import redis.connection
from django.urls import reverse

from tasks_app import producer
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.codec import Task, encode_task
from tasks_app.protocol.records import ResultUpdate
from tests.support.enqueued import file_ready

pytestmark = pytest.mark.django_db

MB = 1024 * 1024


def test_a_task_page_of_huge_values_is_cut_with_a_note(staff, broker):
    huge = "x" * (5 * MB)
    errors = [{"exception_class_path": "builtins.ValueError", "traceback": f"{i}"} for i in range(10_000)]
    errors[-1]["traceback"] = "Traceback (most recent call last):\n" + "y" * MB + "\nValueError: last"
    broker.client.hset(
        broker.keys.result("big"),
        mapping={
            "id": "big",
            "type": "demo.echo",
            "queue": "q",
            "status": "FAILED",
            "args": json.dumps([huge]),
            "kwargs": json.dumps({"k": huge}),
            "return_value": json.dumps(huge),
            "errors": json.dumps(errors),
        },
    )
    response = staff.get(reverse("tasks_app:task", args=["big"]))
    assert response.status_code == 200
    html = response.content.decode()
    assert len(html) < 400_000
    assert html.count("Shown cut:") == 4  # args, kwargs, return value, traceback
    assert "10000 failed attempts in all" in html
    assert "ValueError: last" in html  # a traceback's end, where the exception is, is kept


@pytest.fixture
def replies_read(monkeypatch) -> dict[str, int]:
    """How many bytes of replies this process reads from Redis (the count can be reset between requests)."""
    count = {"bytes": 0}
    read = redis.connection.AbstractConnection.read_response

    def counted(self, *args, **kwargs):
        reply = read(self, *args, **kwargs)
        count["bytes"] += _size(reply)
        return reply

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", counted)
    return count


def _size(reply) -> int:
    if isinstance(reply, dict):
        return sum(_size(key) + _size(value) for key, value in reply.items()) + 1
    if isinstance(reply, list | tuple):
        return sum(map(_size, reply)) + 1
    return len(reply) if isinstance(reply, bytes | str) else 8


def _fill_dead(broker, queue: str, count: int, traceback: str) -> None:
    pipe = broker.client.pipeline(transaction=False)
    for i in range(count):
        task = Task(id=f"d{i:06d}", type="demo.echo", queue=queue, last_error="boom", last_traceback=traceback)
        pipe.zadd(broker.keys.dead(queue), {encode_task(task): 1_700_000_000_000 + i})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def test_acting_on_dead_letters_reads_only_the_selected_ones_not_the_whole_set(staff, broker, replies_read):
    _fill_dead(broker, "big", 20_000, "tb " * 300)
    url = reverse("tasks_app:dead-letters", args=["big"])
    last_page = staff.get(url + "?page=400").content.decode()
    oldest = re.findall(r'name="requeue_one" value="([^"]+)"', last_page)[-1]
    replies_read["bytes"] = 0
    staff.post(url, {"action": "delete", "ref": [oldest, "1700000000005:" + "0" * 40]})
    assert replies_read["bytes"] < 100_000  # the set holds some 18 MB
    assert broker.inspect.dead_count("big") == 19_999
    assert [dead.task_id for dead in get_broker().inspect.list_dead_tasks("big", 19_990, 10)][-3:] == [
        "d000003",
        "d000002",
        "d000001",
    ]


def test_lists_of_tasks_read_no_arguments_or_return_values(staff, broker, replies_read):
    arg = "x" * (MB - 100)  # within TASKS_MAX_PAYLOAD_BYTES
    tasks = [producer.enqueue("demo.echo", args=[arg], kwargs={"k": 1}, queue="q")[0] for _ in range(20)]
    file_ready(broker, [task.id for task in tasks], "q")  # READY records with their arguments, as old producers wrote
    broker.client.hset(broker.keys.result(tasks[0].id), "return_value", json.dumps(arg))
    _fill_dead(broker, "q", 20, "tb")
    for dead in get_broker().inspect.list_dead_tasks("q"):  # dead letters of tasks whose records are kept
        broker.client.hset(broker.keys.result(dead.task_id), mapping={"status": "FAILED", "args": json.dumps([arg])})
    for url in [
        "/tasks/",
        "/tasks/?format=json",
        "/tasks/?q=" + tasks[0].id[:4],
        reverse("tasks_app:dead-letters", args=["q"]),
    ]:
        replies_read["bytes"] = 0
        response = staff.get(url)
        assert response.status_code == 200
        assert replies_read["bytes"] < 200_000 and len(response.content) < 200_000, url
    rows = staff.get("/tasks/?format=json").json()["tasks"]
    assert len(rows) == 20 and not {"args", "kwargs", "return_value"} & set(rows[0])
    assert staff.get(f"/api/tasks/{tasks[0].id}/").json()["args"] == [arg]  # the task's own JSON has them
    assert "task-link" in staff.get(reverse("tasks_app:dead-letters", args=["q"])).content.decode()


def test_a_status_filter_pages_through_ties_while_shown_tasks_move_on(staff, broker):
    """A foreign producer's tasks of one millisecond, RUNNING; some of those page 1 showed finish."""
    ids = [f"t{i:04d}" for i in range(300)]
    pipe = broker.client.pipeline(transaction=False)
    pipe.sadd(broker.keys.queues(), "q")
    for task_id in ids:
        for key in (broker.keys.history("q"), broker.keys.history_status("q", "RUNNING")):
            pipe.zadd(key, {task_id: 1_800_000_000_000})
        pipe.hset(broker.keys.result(task_id), mapping={"type": "demo.echo", "queue": "q", "status": "RUNNING"})
    pipe.execute()
    page = staff.get("/tasks/?status=RUNNING&format=json").json()
    listed = [row["id"] for row in page["tasks"]]
    for task_id in listed[:30]:
        broker.records.record_result(ResultUpdate(task_id, {"status": "SUCCESSFUL"}, 60, queue="q"))
    while page["older"] is not None:
        cursor = f"before={page['older']}&seen={page['older_seen']}&after={page.get('older_after', '')}"
        page = staff.get(f"/tasks/?status=RUNNING&format=json&{cursor}").json()
        listed += [row["id"] for row in page["tasks"]]
    assert sorted(listed) == ids  # each once: none that stayed RUNNING skipped
