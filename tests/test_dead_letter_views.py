"""Staff pages of dead letters: the list, requeue and delete, their audit log, and whatever bytes Redis holds."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.test import Client

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.keys import UNDECODABLE_TYPE
from tasks_app.protocol.records import ResultRecord, ResultUpdate

pytestmark = pytest.mark.django_db


# --- dead letters --------------------------------------------------------------------------
def make_dead(broker, type_name: str = "web.echo", error: str = "builtins.RuntimeError: <boom>") -> Task:
    """Enqueue a task, claim it and dead-letter it after three attempts, as a consumer would."""
    [enqueued] = producer.enqueue(type_name, [1])
    broker.leases.heartbeat(["web"], "c-dead", 5000, {"lease_ms": 5000})
    [raw] = broker.queue.claim("web", "c-dead", 1)
    task = decode_task(raw)
    broker.client.hdel(*broker.keys.waiting_mark(task.id))  # as the claim's receipt would
    task.attempt, task.last_error, task.last_traceback = 3, error, "Traceback (most recent call last): ..."
    task.dead_reason = "failed 3 of 3 attempts"
    broker.queue.dead_letter(
        "web",
        "c-dead",
        raw,
        encode_task(task),
        ResultUpdate(
            task.id, {"status": "FAILED", "attempts": "3", "finished_at_ms": "1", "dead_reason": task.dead_reason}, 60
        ),
    )
    assert task.id == enqueued.id
    return task


def make_undecodable(broker) -> None:
    """Dead-letter bytes that are not a task, wrapped as the executor does."""
    broker.client.lpush(broker.keys.pending("web"), b"garbage")
    broker.leases.heartbeat(["web"], "c-dead", 5000, {"lease_ms": 5000})
    [raw] = broker.queue.claim("web", "c-dead", 1)
    wrapper = Task(id="wrap-1", type=UNDECODABLE_TYPE, queue="web", payload=raw, last_error="UndecodableTask: x")
    broker.queue.dead_letter("web", "c-dead", raw, encode_task(wrapper))


def dead_url(queue: str = "web") -> str:
    return f"/tasks/dashboard/{queue}/dead/"


def test_dead_letter_list_shows_type_error_attempts_and_time_escaped(staff, broker, echo_type):
    task = make_dead(broker)
    make_undecodable(broker)
    html = staff.get(dead_url()).content.decode()
    assert "2 dead-lettered tasks" in html
    assert task.id in html and "builtins.RuntimeError: &lt;boom&gt;" in html and "<boom>" not in html
    assert re.search(r"<td>3</td>\s*<td>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</td>", html)
    assert html.count('class="button requeue-one"') == 1  # the undecodable one can only be deleted
    assert "not a task: delete only" in html


def test_dead_letters_of_an_invalid_queue_name_are_404(staff, broker):
    assert staff.get("/tasks/dashboard/bad%20name/dead/").status_code == 404


def test_requeue_one_resets_the_task_writes_a_ready_record_and_logs(staff, broker, echo_type):
    task = make_dead(broker)
    [dead] = get_broker().inspect.list_dead_tasks("web")
    response = staff.post(dead_url(), {"requeue_one": dead.ref})
    assert response.status_code == 302
    stats = broker.inspect.queue_stats("web")
    assert (stats.dead, stats.pending) == (0, 1)
    fresh = decode_task(broker.client.lrange(broker.keys.pending("web"), 0, -1)[0])
    assert (fresh.id, fresh.attempt, fresh.last_error, fresh.last_traceback, fresh.dead_reason) == (
        task.id,
        0,
        "",
        "",
        "",
    )
    record = ResultRecord.from_fields(broker.records.get_result(task.id))
    assert (record.status, record.attempts, record.dead_reason, record.finished_at) == ("READY", 0, "", None)
    entry = LogEntry.objects.get()
    assert (entry.action_flag, entry.object_id, entry.user.username) == (CHANGE, task.id, "boss")
    assert "Requeued 1 task(s)." in staff.get(response["Location"]).content.decode()


def test_requeue_selected_and_delete_selected(staff, broker, echo_type):
    tasks = [make_dead(broker) for _ in range(3)]
    make_undecodable(broker)
    refs = {d.task_id: d.ref for d in get_broker().inspect.list_dead_tasks("web")}
    staff.post(dead_url(), {"action": "requeue", "ref": [refs[tasks[0].id], refs[tasks[1].id], refs["wrap-1"]]})
    stats = broker.inspect.queue_stats("web")
    assert (stats.dead, stats.pending) == (2, 2)  # the undecodable one stays
    staff.post(dead_url(), {"action": "delete", "ref": [refs[tasks[2].id], refs["wrap-1"]]})
    assert broker.inspect.queue_stats("web").dead == 0
    flags = sorted(LogEntry.objects.values_list("action_flag", "object_id"))
    assert flags == sorted(
        [(CHANGE, tasks[0].id), (CHANGE, tasks[1].id), (DELETION, tasks[2].id), (DELETION, "wrap-1")]
    )


def test_dead_letter_actions_need_a_selection_and_a_known_action(staff, broker, echo_type):
    make_dead(broker)
    page = staff.post(dead_url(), {"action": "requeue"}, follow=True).content.decode()
    assert "Select at least one task." in page
    [dead] = get_broker().inspect.list_dead_tasks("web")
    page = staff.post(dead_url(), {"action": "explode", "ref": [dead.ref]}, follow=True).content.decode()
    assert "Unknown action." in page
    assert broker.inspect.queue_stats("web").dead == 1 and not LogEntry.objects.exists()


def test_dead_letter_actions_require_csrf_and_staff(client, broker, echo_type):
    make_dead(broker)
    [dead] = get_broker().inspect.list_dead_tasks("web")
    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(get_user_model().objects.create_superuser("boss", "b@example.com", None))
    assert csrf_client.post(dead_url(), {"requeue_one": dead.ref}).status_code == 403
    client.force_login(get_user_model().objects.create_user("plain", password=None))
    assert client.post(dead_url(), {"requeue_one": dead.ref}).status_code == 302
    assert broker.inspect.queue_stats("web").dead == 1


def dead_member(broker, queue: str, member: bytes, died_ms: int = 1_700_000_000_000) -> None:
    """Write a dead-set member straight into Redis, as a foreign producer or an old version might."""
    broker.client.zadd(broker.keys.dead(queue), {member: died_ms})
    broker.client.sadd(broker.keys.queues(), queue)


def foreign_task(task_id: str, **fields: str) -> bytes:
    return encode_task(Task(id=task_id, type=fields.pop("type", "web.echo"), queue="web", **fields))


def test_the_dead_letter_page_renders_hostile_ids_and_their_tasks_can_be_handled(staff, broker, echo_type):
    ids = ["a/b", "line\nbreak", "<script>alert(1)</script>", "x" * 100_000, ""]
    for task_id in ids:
        dead_member(broker, "web", foreign_task(task_id, last_error="<img src=x onerror=alert(1)>"))
    dead_member(broker, "web", b"\xff\xfe not protobuf \x00")
    dead_member(broker, "web", foreign_task("t-type", type="<b>bold</b>\n"))
    dead_member(broker, "web", foreign_task("t-nanoseconds"), died_ms=1_700_000_000_000_000_000)
    broker.records.record_result(ResultUpdate("line\nbreak", {"status": "FAILED"}, 60, queue="web"))  # a page to link

    response = staff.get(dead_url())
    assert response.status_code == 200
    html = response.content.decode()
    assert "8 dead-lettered tasks" in html
    assert "&lt;script&gt;" in html and "<script>alert" not in html and "<img src=x" not in html
    assert "line\\nbreak" in html and "&lt;b&gt;bold&lt;/b&gt;\\n" in html
    assert 'href="/tasks/a/b/"' not in html and "x" * 201 not in html
    assert 'href="/tasks/line%0Abreak/"' in html  # an id that makes a URL is still linked

    refs = {dead.task_id: dead.ref for dead in get_broker().inspect.list_dead_tasks("web")}
    assert staff.post(dead_url(), {"requeue_one": refs["a/b"]}).status_code == 302
    assert staff.post(dead_url(), {"action": "delete", "ref": [refs["x" * 100_000]]}).status_code == 302
    assert broker.inspect.queue_stats("web").dead == 6
    assert decode_task(broker.client.lindex(broker.keys.pending("web"), 0)).id == "a/b"


@pytest.mark.parametrize("envelope_queue", ["", "elsewhere"])
def test_a_requeued_envelope_naming_no_or_another_queue_is_filed_under_the_queue_it_goes_back_to(
    staff, broker, echo_type, envelope_queue
):
    """As a reaper leaves a foreign producer's task it recovered too often: its envelope as pushed."""
    task = Task(id="t-foreign", type="web.echo", queue=envelope_queue, payload=b'{"args": [1]}', attempt=4)
    dead_member(broker, "web", encode_task(task))
    [dead] = get_broker().inspect.list_dead_tasks("web")
    assert staff.post(dead_url(), {"requeue_one": dead.ref}).status_code == 302
    assert decode_task(broker.client.lindex(broker.keys.pending("web"), 0)).queue == "web"
    assert ResultRecord.from_fields(broker.records.get_result("t-foreign")).queue == "web"
    listed = staff.get("/tasks/?status=READY&queue=web").content.decode()
    assert 'data-task="t-foreign"' in listed


@pytest.fixture
def unique_type() -> TaskType:
    """A unique task type on the web queue whose key its end frees."""
    return TaskType.objects.create(
        name="web.unique", handler="demo.echo", queue="web", unique_for_s=600, unique_until="finished"
    )


def test_a_unique_types_dead_letter_stays_dead_while_another_task_holds_its_key(staff, broker, unique_type):
    task = make_dead(broker, "web.unique")
    assert broker.control.release_unique("web", task.unique_digest, task.id)  # as its dead letter does (until finished)
    [holder] = producer.enqueue("web.unique", [1])
    assert not holder.duplicate
    [dead] = get_broker().inspect.list_dead_tasks("web")
    page = staff.post(dead_url(), {"requeue_one": dead.ref}, follow=True).content.decode()
    assert "Requeued 0 task(s)." in page
    held = f"Task {task.id} not requeued: a task with the same uniqueness key is enqueued already ({holder.id})."
    assert held in page
    stats = broker.inspect.queue_stats("web")
    assert (stats.dead, stats.pending) == (1, 1)  # the holder alone waits
    assert broker.records.get_result(task.id)["status"] == "FAILED" and not LogEntry.objects.exists()


def test_a_requeued_dead_letter_of_a_unique_type_holds_its_key_against_new_enqueues(staff, broker, unique_type):
    task = make_dead(broker, "web.unique")
    assert broker.control.release_unique("web", task.unique_digest, task.id)
    [dead] = get_broker().inspect.list_dead_tasks("web")
    page = staff.post(dead_url(), {"requeue_one": dead.ref}, follow=True).content.decode()
    assert "Requeued 1 task(s)." in page and "not requeued" not in page
    [again] = producer.enqueue("web.unique", [1])
    assert (again.id, again.duplicate) == (task.id, True)
    assert broker.inspect.queue_stats("web").pending == 1
    # A cancel before it starts frees the key it took, as for an enqueued task of the type.
    assert broker.records.get_result(task.id)["unique_digest"] == task.unique_digest
