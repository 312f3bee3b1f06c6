"""Task control without a consumer: the API, the CLI, the task page, django.tasks results, the start gate."""

from __future__ import annotations

import json
import math
import os
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.tasks import TaskResultStatus

import tasks_app
from tasks_app import control, producer
from tasks_app.context import MAX_PROGRESS_MESSAGE_CHARS, progress_value
from tasks_app.models import TaskType
from tasks_app.protocol import records
from tasks_app.protocol.codec import Task, decode_task, encode_task
from tasks_app.protocol.history import CancelMark
from tasks_app.protocol.records import ResultUpdate
from tests.support import django_tasks as tasks

pytestmark = pytest.mark.django_db


def cancel_url(task_id: str) -> str:
    return f"/api/tasks/{task_id}/cancel/"


def start_run(broker: Any, task_id: str, fence: int) -> int:
    """What a consumer's first write of a run does (with the task's queue and type); returns record_result's reply."""
    fields = {"status": records.RUNNING, "queue": "web", "type": "web.echo"}
    return broker.records.record_result(ResultUpdate(task_id, fields, 60, fence=fence))


def test_the_api_answers_a_duplicate_with_200_and_the_first_id(staff, broker, echo_type):
    TaskType.objects.filter(pk=echo_type.pk).update(unique_for_s=60)
    body = {"type": "web.echo", "args": [1], "unique_key": "order-7"}
    first = staff.post("/api/tasks/", body, content_type="application/json")
    again = staff.post("/api/tasks/", {**body, "args": [2]}, content_type="application/json")
    assert (first.status_code, first.json()["duplicate"]) == (201, False)
    assert (again.status_code, again.json()["duplicate"], again.json()["id"]) == (200, True, first.json()["id"])
    broker.records.record_result(ResultUpdate(first.json()["id"], {"status": records.SUCCESSFUL}, 60))
    later = staff.post("/api/tasks/", {**body, "priority": 5}, content_type="application/json").json()
    assert (later["status"], later["priority"], later["enqueued_at"]) == ("SUCCESSFUL", 0, first.json()["enqueued_at"])
    with pytest.raises(producer.EnqueueError, match="not unique"):
        producer.enqueue("demo.echo", unique_key="k")


def test_the_api_answers_a_duplicate_with_the_queue_its_holders_record_names(staff, broker, echo_type):
    TaskType.objects.filter(pk=echo_type.pk).update(unique_for_s=60)
    body = {"type": "web.echo", "args": [1], "unique_key": "order-7"}
    first = staff.post("/api/tasks/", body, content_type="application/json").json()
    broker.client.hset(broker.keys.result(first["id"]), "queue", "elsewhere")  # what its record says now
    again = staff.post("/api/tasks/", body, content_type="application/json").json()
    assert (again["duplicate"], again["id"], again["queue"]) == (True, first["id"], "elsewhere")  # before: "web"
    assert again["type"] == "web.echo"


@pytest.mark.parametrize("via", ["api", "form"])
def test_a_duplicate_of_a_task_whose_id_no_url_can_name_is_answered_not_a_500(staff, broker, echo_type, via):
    # Ids with "/" are refused now; a key taken before that (or by a foreign writer) may still name one.
    TaskType.objects.filter(pk=echo_type.pk).update(unique_for_s=3600)
    [first] = producer.enqueue("web.echo", [7], unique_key="order-7")
    [key] = broker.client.keys(f"{broker.keys.prefix}:*unique*")
    broker.client.set(key, "report/7", keepttl=True)
    if via == "api":
        body = {"type": "web.echo", "args": [7], "unique_key": "order-7"}
        response = staff.post("/api/tasks/", body, content_type="application/json")
        assert response.status_code == 200 and response.json()["duplicate"] is True
        assert response.json()["id"] == "report/7" and response.json()["url"] is None
        assert "Location" not in response
    else:
        form = {"type": "web.echo", "args": "[7]", "kwargs": "", "queue": "", "priority": "0", "delay": "0"}
        response = staff.post("/tasks/enqueue/", {**form, "unique_key": "order-7"})
        assert response.status_code == 302 and response["Location"] == "/tasks/enqueue/"
    assert broker.inspect.queue_stats("web").pending == 1 and first.id != "report/7"


@pytest.mark.parametrize("key_gone", ["freed by its end", "window over"])
def test_a_unique_task_enqueued_again_under_its_own_id_is_not_pushed_twice(broker, echo_type, key_gone):
    # A caller whose reply was lost retries the same request: its id was enqueued, so nothing is pushed.
    TaskType.objects.filter(pk=echo_type.pk).update(unique_for_s=3600)
    request = producer.TaskRequest("web.echo", [1], task_id="order-42")
    [first] = producer.enqueue_many([request])
    assert not first.duplicate
    broker.client.delete(*broker.client.keys(f"{broker.keys.prefix}:*unique*"))  # as its end or its window does
    [again] = producer.enqueue_many([request])
    assert again.duplicate and again.id == "order-42"
    assert broker.inspect.queue_stats("web").pending == 1, "pushed twice under one id"
    [other] = producer.enqueue_many([producer.TaskRequest("web.echo", [1], task_id="order-43")])
    assert not other.duplicate and broker.inspect.queue_stats("web").pending == 2


@pytest.mark.parametrize(("unique_until", "freed"), [("finished", True), ("window", False)])
def test_cancelling_a_waiting_unique_task_frees_its_key_if_its_end_does(broker, echo_type, unique_until, freed):
    TaskType.objects.filter(pk=echo_type.pk).update(unique_for_s=3600, unique_until=unique_until)
    [scheduled] = producer.enqueue("web.echo", [1], delay_s=600)  # no consumer claims it for ten minutes
    assert tasks_app.cancel(scheduled.id).outcome == control.CANCELLED
    [again] = producer.enqueue("web.echo", [1])
    assert (again.duplicate, again.id == scheduled.id) == (not freed, not freed)


def test_the_api_cancels_queued_and_running_tasks_and_refuses_unknown_and_finished(staff, broker, echo_type):
    queued, running = (task.id for task in producer.enqueue("web.echo", count=2))
    assert start_run(broker, running, 1) == 1
    response = staff.post(cancel_url(queued))
    assert (response.status_code, response.json()["outcome"], response.json()["status"]) == (
        200,
        "cancelled",
        "CANCELLED",
    )
    response = staff.post(cancel_url(running))
    assert (response.status_code, response.json()["cancel_requested"]) == (202, True)
    assert staff.post(cancel_url(queued)).status_code == 409
    assert "no task" in staff.post(cancel_url("nope")).json()["error"]
    assert staff.get(cancel_url(queued)).status_code == 405
    record = staff.get(f"/api/tasks/{running}/").json()
    assert record["status"] == "RUNNING" and record["cancelled_by"] == "user:boss" and record["cancel_requested_at"]


def test_cancelling_needs_the_cancel_permission(client, broker, echo_type):
    user = get_user_model().objects.create_user("clerk", is_staff=True)
    client.force_login(user)
    task_id = producer.enqueue("web.echo")[0].id
    assert client.post(cancel_url(task_id)).status_code == 403
    assert client.post(f"/tasks/{task_id}/cancel/").status_code == 403
    assert broker.records.get_result(task_id)["status"] == "READY"


def test_the_start_gate_refuses_cancelled_tasks_and_later_runs_of_cancel_requested_ones(broker, echo_type):
    cancelled, requested = (task.id for task in producer.enqueue("web.echo", count=2))
    tasks_app.cancel(cancelled)
    assert start_run(broker, cancelled, 5) == records.START_REFUSED
    assert start_run(broker, requested, 5) == 1
    assert tasks_app.cancel(requested).outcome == tasks_app.control.REQUESTED
    assert broker.control.cancel_marks("web", [requested, cancelled]) == [CancelMark.REQUESTED, CancelMark.NONE]
    assert start_run(broker, requested, 5) == 1  # the same run goes on writing
    assert broker.records.get_result(requested)["status"] == "RUNNING"
    assert start_run(broker, requested, 6) == records.START_REFUSED  # a retry never starts
    assert broker.records.get_result(requested)["status"] == "CANCELLED"
    other_write = ResultUpdate(cancelled, {"dead_reason": "requeued"}, 60, fence=9)
    assert broker.records.record_result(other_write) == 1  # only a run's start is refused


def test_claim_receipts_make_a_later_cancel_a_request_to_the_consumer_that_holds_the_task(broker, echo_type):
    cancelled, held, deferred, retried = (task.id for task in producer.enqueue("web.echo", count=4))
    tasks_app.cancel(cancelled)
    claims = [(cancelled, 5), (held, 6), (deferred, 7), (retried, 8)]
    assert broker.queue.claim_receipts(claims, 60, [("web", "web.echo")] * 4) == [2, 3, 3, 3]
    # Claimed, not started: the cancel asks the consumer, whose start then goes through.
    assert tasks_app.cancel(held).outcome == tasks_app.control.REQUESTED
    assert broker.records.get_result(held)["status"] == "READY" and broker.control.cancel_marks("web", [held]) == [True]
    assert start_run(broker, held, 6) == 1 and broker.records.get_result(held)["status"] == "RUNNING"
    # Deferred: the consumer withdrew its receipt, so the cancel cancels it outright.
    broker.records.record_result(ResultUpdate(deferred, {records.CLAIMED_FENCE: ""}, 60, fence=7))
    assert tasks_app.cancel(deferred).outcome == tasks_app.control.CANCELLED
    assert broker.queue.claim_receipts([(deferred, 9)], 60) == [2]
    # Cancel requested while claimed, then the task went back to wait: its next claim is refused.
    assert tasks_app.cancel(retried).outcome == tasks_app.control.REQUESTED
    assert broker.queue.claim_receipts([(retried, 10), (retried, 1)], 60) == [2, 0]
    assert broker.records.get_result(retried)["status"] == "CANCELLED"


def test_a_dropped_task_is_filed_cancelled_and_a_foreign_key_gets_no_receipt(broker, echo_type):
    task = producer.enqueue("web.echo")[0]
    assert broker.queue.claim_receipts([(task.id, 5)], 60, [("web", "web.echo")]) == [3]
    tasks_app.cancel(task.id)
    assert broker.queue.claim_receipts([(task.id, 6)], 60) == [2]  # the record reads CANCELLED, its index not yet
    broker.records.record_result(records.dropped_cancelled(task, 60, 6))  # what the consumer writes as it drops it
    index = broker.client.zrange(broker.keys.history_status("web", records.CANCELLED), 0, -1)
    assert index == [task.id.encode()] and not broker.client.zscore(broker.keys.history_status("web", "READY"), task.id)
    broker.client.set(broker.keys.result("foreign"), "not a hash")
    assert broker.queue.claim_receipts([("foreign", 1), ("no-record", 2)], 60) == [-1, 3]  # 3: the record is new
    assert broker.client.hgetall(broker.keys.result("no-record")) == {b"claimed_fence": b"2", b"fence": b"2"}


def test_manage_py_cancel_reports_each_task_and_fails_on_unknown_or_finished(broker, echo_type):
    first, second = (task.id for task in producer.enqueue("web.echo", count=2))
    out = StringIO()
    call_command("cancel", first, stdout=out)
    assert out.getvalue() == f"{first} cancelled (it will not run)\n"
    out = StringIO()
    with pytest.raises(CommandError, match=rf"task {first} already finished \(CANCELLED\); no task missing"):
        call_command("cancel", first, second, "missing", stdout=out)
    assert out.getvalue() == f"{second} cancelled (it will not run)\n"


def test_an_id_given_twice_is_cancelled_once_and_reported_alike(broker, echo_type):
    task_id = producer.enqueue("web.echo")[0].id
    out = StringIO()
    call_command("cancel", task_id, task_id, stdout=out)  # no "already finished" for the second
    assert out.getvalue() == f"{task_id} cancelled (it will not run)\n" * 2
    assert [reply.outcome for reply in tasks_app.cancel_many([task_id, task_id])] == ["finished", "finished"]


def test_an_id_that_is_not_unicode_is_unknown_and_cancels_the_others_still(broker, echo_type):
    task_id = producer.enqueue("web.echo")[0].id
    replies = tasks_app.cancel_many(["\udcff", task_id])  # non-UTF-8 bytes given on a command line
    assert [reply.outcome for reply in replies] == ["unknown", "cancelled"]
    with pytest.raises(tasks_app.TaskNotFound):
        tasks_app.cancel("bad-\udcff")
    with pytest.raises(CommandError, match="no task"):
        call_command("cancel", "\udcff", stdout=StringIO())


def test_manage_py_cancel_works_for_a_user_without_a_name(broker, echo_type, monkeypatch):
    def no_name() -> str:  # a container run under an arbitrary uid: no passwd entry, no USER
        raise OSError("No username set in the environment")

    monkeypatch.setattr("getpass.getuser", no_name)
    task_id = producer.enqueue("web.echo")[0].id
    call_command("cancel", task_id, stdout=StringIO())
    assert broker.client.hget(broker.keys.result(task_id), "cancelled_by") == f"cli:uid:{os.getuid()}".encode()


def test_the_task_page_cancels_with_its_button_and_shows_progress(staff, broker, echo_type):
    task_id = producer.enqueue("web.echo")[0].id
    page = staff.get(f"/tasks/{task_id}/").content.decode()
    assert 'id="task-cancel"' in page and "csrfmiddlewaretoken" in page
    response = staff.post(f"/tasks/{task_id}/cancel/", follow=True)
    page = response.content.decode()
    assert "cancelled: it will not run" in page and 'id="task-cancel"' not in page and "by user:boss" in page
    other = producer.enqueue("web.echo")[0].id
    progress = json.dumps(progress_value(3, 4, "three <b>of</b> four"))
    broker.records.record_result(ResultUpdate(other, {"status": "RUNNING", "progress": progress}, 60))
    page = staff.get(f"/tasks/{other}/").content.decode()
    assert '<progress max="100" value="75.0">' in page and "three &lt;b&gt;of&lt;/b&gt; four" in page


def test_django_tasks_reads_a_cancelled_task_as_failed_with_task_cancelled(settings, broker):
    backend = {"BACKEND": "tasks_app.backends.RedisBackend", "QUEUES": [], "OPTIONS": {"ENQUEUE_ON_COMMIT": False}}
    settings.TASKS = {"default": backend}
    result = tasks.add.enqueue(1, 2)
    tasks_app.cancel(result.id, cancelled_by="ops")
    read = tasks.add.get_result(result.id)
    assert read.status == TaskResultStatus.FAILED
    assert [error.exception_class_path for error in read.errors] == ["tasks_app.exceptions.TaskCancelled"]
    assert "by ops" in read.errors[0].traceback


def test_django_tasks_returns_the_first_result_for_a_duplicate_and_duplicates_are_counted(settings, broker):
    from tasks_app import metrics

    backend = {"BACKEND": "tasks_app.backends.RedisBackend", "QUEUES": [], "OPTIONS": {"ENQUEUE_ON_COMMIT": False}}
    settings.TASKS = {"default": backend}
    first = tasks.add.enqueue(1, 2)
    TaskType.objects.filter(name=tasks.add.module_path).update(unique_for_s=60)
    producer.recent_task_types.forget()
    refused = metrics.DUPLICATES_REFUSED.labels(tasks.add.module_path)
    before = refused._value.get()
    unique = tasks.add.enqueue(1, 2)
    again = tasks.add.enqueue(1, 2)
    assert unique.id != first.id and again.id == unique.id
    assert tasks.add.get_result(again.id).status == TaskResultStatus.READY
    assert refused._value.get() == before + 1


@pytest.mark.parametrize(
    ("current", "total", "message", "problem"),
    [
        (True, None, "", TypeError),
        (math.nan, None, "", TypeError),
        ("1", None, "", TypeError),
        (1, -1, "", ValueError),
        pytest.param(10**400, None, "", TypeError, id="current-beyond-every-float"),
        pytest.param(1, 10**400, "", TypeError, id="total-beyond-every-float"),
    ],
)
def test_invalid_progress_is_refused(current, total, message, problem):
    with pytest.raises(problem):
        progress_value(current, total, message)


def test_a_long_progress_message_is_cut():
    assert len(progress_value(1, None, "x" * 5000)["message"]) == MAX_PROGRESS_MESSAGE_CHARS


def test_manage_py_cancel_force_stops_running_tasks_and_cancels_queued_ones_as_usual(broker, echo_type):
    queued, running = (task.id for task in producer.enqueue("web.echo", count=2))
    assert start_run(broker, running, 1) == 1
    out = StringIO()
    call_command("cancel", "--force", queued, running, stdout=out)
    assert out.getvalue() == f"{queued} cancelled (it will not run)\n{running} running: stopped by force\n"
    assert broker.control.cancel_marks("web", [running, queued]) == [CancelMark.FORCED, CancelMark.NONE]


def test_the_api_force_field_forces_the_cancel_of_a_running_task(staff, broker, echo_type):
    plain, forced, by_form, by_curl = (task.id for task in producer.enqueue("web.echo", count=4))
    for task_id in (plain, forced, by_form, by_curl):
        assert start_run(broker, task_id, 1) == 1
    response = staff.post(cancel_url(plain), {"force": False}, content_type="application/json")
    assert (response.status_code, response.json()["forced"]) == (202, False)
    response = staff.post(cancel_url(forced), {"force": True}, content_type="application/json")
    assert (response.status_code, response.json()["cancel_requested"], response.json()["forced"]) == (202, True, True)
    assert staff.post(cancel_url(by_form), {"force": "true"}).json()["forced"] is True
    curl_body = '{"force": true}'  # what `curl -d` sends, as a form
    assert staff.post(cancel_url(by_curl), curl_body, "application/x-www-form-urlencoded").json()["forced"] is True
    marks = broker.control.cancel_marks("web", [plain, forced, by_form, by_curl])
    assert marks == [CancelMark.REQUESTED, CancelMark.FORCED, CancelMark.FORCED, CancelMark.FORCED]


@pytest.mark.parametrize("body", ['{"force": "yes"}', '{"force": true, "why": 1}', "[true]", '{"force": tru'])
def test_the_api_refuses_a_bad_cancel_body_and_cancels_nothing(staff, broker, echo_type, body):
    task_id = producer.enqueue("web.echo")[0].id
    response = staff.post(cancel_url(task_id), body, content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]
    assert broker.records.get_result(task_id)["status"] == "READY"


def test_the_task_page_offers_a_forced_stop_while_the_task_runs(staff, broker, echo_type):
    queued, running = (task.id for task in producer.enqueue("web.echo", count=2))
    assert 'id="task-cancel-force"' not in staff.get(f"/tasks/{queued}/").content.decode()
    assert start_run(broker, running, 1) == 1
    assert 'id="task-cancel-force"' in staff.get(f"/tasks/{running}/").content.decode()
    page = staff.post(f"/tasks/{running}/cancel/", {"force": "1"}, follow=True).content.decode()
    assert "it is being stopped by force" in page
    assert broker.control.cancel_marks("web", [running]) == [CancelMark.FORCED]


def test_a_requeue_from_the_dead_letters_forgets_the_cancel_requests_of_the_earlier_run(staff, broker, echo_type):
    from tasks_app.protocol.broker import get_broker
    from tests.test_dead_letter_views import make_dead

    task = make_dead(broker)  # as if its last run had been cancelled with force (and timed out)
    for key in (broker.keys.cancel_requests("web"), broker.keys.cancel_forced("web")):
        broker.client.zadd(key, {task.id: 1})
    assert broker.control.cancel_marks("web", [task.id]) == [CancelMark.FORCED]
    assert [
        dead.task.id
        for dead in broker.inspect.requeue_dead_tasks("web", get_broker().inspect.list_dead_tasks("web")).moved
        if dead.task
    ] == [task.id]
    assert broker.control.cancel_marks("web", [task.id]) == [CancelMark.NONE]


def mark_waiting(broker: Any, task_id: str, queue: str = "web", task_type: str = "web.echo") -> tuple[str, bytes]:
    """Write a waiting task's mark as an enqueue does (docs/PROTOCOL.md, "Waiting marks"); return its place."""
    bucket, mark = broker.keys.waiting_mark(task_id)
    broker.client.hset(bucket, mark, f"{queue} {task_type}")
    return bucket, mark


def test_a_waiting_mark_reads_ready_with_its_queue_and_type_until_the_receipt_replaces_it(broker, echo_type):
    bucket, mark = mark_waiting(broker, "w-1")
    assert {k: v for k, v in broker.records.get_result("w-1").items() if k in ("status", "queue", "type", "id")} == {
        "status": "READY",
        "queue": "web",
        "type": "web.echo",
        "id": "w-1",
    }
    assert broker.records.get_results(["w-1", "none"], ["status", "queue"])[0]["queue"] == "web"
    assert broker.queue.claim_receipts([("w-1", 5)], 60, [("web", "web.echo")]) == [3]
    assert broker.client.hget(bucket, mark) is None
    record = broker.records.get_result("w-1")
    assert (record["status"], record["queue"], record["type"], record["fence"]) == ("READY", "web", "web.echo", "5")
    assert tasks_app.cancel("w-1").outcome == tasks_app.control.REQUESTED  # its consumer is told
    assert broker.control.cancel_marks("web", ["w-1"]) == [CancelMark.REQUESTED]


def test_a_cancel_of_a_waiting_mark_makes_a_cancelled_record_its_claim_then_refuses(broker, echo_type):
    bucket, mark = mark_waiting(broker, "w-2")
    reply = tasks_app.cancel("w-2", cancelled_by="ops")
    assert (reply.outcome, reply.queue, reply.status) == (tasks_app.control.CANCELLED, "web", "CANCELLED")
    assert broker.client.hget(bucket, mark) is None
    record = broker.records.get_result("w-2")
    assert (record["status"], record["type"], record["cancelled_by"], record["cancelled_waiting"]) == (
        "CANCELLED",
        "web.echo",
        "ops",
        "1",
    )
    assert broker.client.ttl(broker.keys.result("w-2")) > 0
    assert broker.queue.claim_receipts([("w-2", 5)], 60, [("web", "web.echo")]) == [records.START_REFUSED]
    assert start_run(broker, "w-2", 5) == records.START_REFUSED
    assert tasks_app.cancel_many(["w-3"])[0].outcome == tasks_app.control.UNKNOWN  # no record, no mark


def test_a_claim_between_reading_the_mark_and_the_cancel_leaves_a_request(broker, echo_type):
    # The receipt creates the record before the mark goes: the cancel finds a claimed record.
    mark_waiting(broker, "w-4")
    assert broker.queue.claim_receipts([("w-4", 7)], 60, [("web", "web.echo")]) == [3]
    assert tasks_app.cancel("w-4").outcome == tasks_app.control.REQUESTED
    assert start_run(broker, "w-4", 7) == 1


def test_a_blocking_claim_writes_its_receipt_and_drops_the_mark_in_its_own_round_trip(broker, echo_type):
    waiting, cancelled = producer.enqueue("web.echo", count=2)
    tasks_app.cancel(cancelled.id)
    bucket, mark = broker.keys.waiting_mark(waiting.id)
    assert broker.client.hget(bucket, mark) is not None
    first = broker.queue.claim_blocking("web", "c1", 1, 60)
    assert (decode_task(first.raw).id, first.receipt) == (waiting.id, 3)
    assert broker.client.hget(bucket, mark) is None
    record = broker.records.get_result(waiting.id)
    assert (record["status"], record["queue"], record["type"], record["fence"]) == (
        "READY",
        "web",
        "web.echo",
        str(first.fence),
    )
    second = broker.queue.claim_blocking("web", "c1", 1, 60)
    assert (decode_task(second.raw).id, second.receipt) == (cancelled.id, records.START_REFUSED)
    assert second.fence > first.fence
    assert broker.queue.held_and_staged("web", "c1") == ([second.raw, first.raw], [])
    assert broker.queue.claim_blocking("web", "c1", 0.01, 60) == (None, 0, None, False)
    # Claimed from a paused queue too (the consumer returns it unstarted), saying so.
    assert first.queue_open and second.queue_open
    broker.control.pause("web")
    producer.enqueue("web.echo")
    assert not broker.queue.claim_blocking("web", "c1", 1, 60).queue_open


def test_a_blocking_claim_leaves_the_receipt_of_an_id_it_cannot_read_to_claim_receipts(broker):
    raw = encode_task(Task(id="tâche", type="web.echo", queue="web"))
    broker.client.lpush(broker.keys.pending("web"), raw)
    claim = broker.queue.claim_blocking("web", "c1", 1, 60)
    assert (claim.raw, claim.receipt) == (raw, None) and claim.fence > 0
    assert not broker.client.exists(broker.keys.result("tâche"))
    assert broker.queue.held_by("web", "c1") == [raw]
