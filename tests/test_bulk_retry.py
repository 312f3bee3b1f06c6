"""The task browser's *Retry* against real Redis: a repeated request enqueues no second copy; a new decision does."""

import re
import time

import pytest
from django.contrib.admin.models import ADDITION, LogEntry

from tasks_app import producer
from tasks_app.protocol.records import ResultUpdate
from tasks_app.web import browser
from tests.support.enqueued import waiting_record, waiting_records

pytestmark = pytest.mark.django_db


@pytest.fixture
def failed(broker) -> str:
    """A failed task of queue b (still pending: nothing runs it), whose copies the tests count."""
    task_id = producer.enqueue("demo.echo", args=["x"], queue="b")[0].id
    fields = {
        **waiting_record(broker, task_id, "b"),
        "status": "FAILED",
        "finished_at_ms": str(int(time.time() * 1000)),
    }
    broker.records.record_result(ResultUpdate(task_id, fields, 60, queue="b"))  # as its run wrote it
    broker.client.hdel(*broker.keys.waiting_mark(task_id))  # as its claim did
    return task_id


def _form_shown(staff, task_id: str) -> dict:
    """The Retry form as the browser page posts it for this task: its id and the retried_as the page shows."""
    page = staff.get("/tasks/?status=FAILED").content.decode()
    shown = re.search(rf'<input type="hidden" name="retried_as:{task_id}" value="([^"]*)">', page)
    assert shown, "the page posts no retried_as for the task"
    return {"action": "retry", "task": [task_id], f"retried_as:{task_id}": shown.group(1)}


def _told(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def _copies(broker, original: str) -> list[str]:
    """The ids of the tasks waiting in queue b that retry `original`."""
    return [task_id for task_id, fields in waiting_records(broker, "b").items() if fields.get("retry_of") == original]


def test_the_same_retry_posted_twice_enqueues_one_copy_and_the_second_answer_says_so(staff, broker, failed):
    form = {"action": "retry", "task": [failed], f"retried_as:{failed}": ""}
    assert _told(staff.post("/tasks/?status=FAILED", form, follow=True)) == ["Enqueued 1 retry task(s)."]
    [copy] = _copies(broker, failed)
    assert _told(staff.post("/tasks/?status=FAILED", form, follow=True)) == [
        f"Enqueued 0 retry task(s). 1 already retried as {copy} (a repeated request), not enqueued again."
    ]
    assert _copies(broker, failed) == [copy] and broker.inspect.queue_stats("b").pending == 2
    assert broker.records.get_result(failed)["retried_as"] == copy
    assert list(LogEntry.objects.values_list("object_id", "action_flag")) == [(failed, ADDITION)]


def test_a_retry_from_the_page_showing_the_first_one_is_a_new_decision(staff, broker, failed):
    first_form = _form_shown(staff, failed)
    assert first_form[f"retried_as:{failed}"] == ""
    assert _told(staff.post("/tasks/?status=FAILED", first_form, follow=True)) == ["Enqueued 1 retry task(s)."]
    [first] = _copies(broker, failed)
    second_form = _form_shown(staff, failed)
    assert second_form[f"retried_as:{failed}"] == first
    assert _told(staff.post("/tasks/?status=FAILED", second_form, follow=True)) == ["Enqueued 1 retry task(s)."]
    [second] = set(_copies(broker, failed)) - {first}
    assert broker.records.get_result(failed)["retried_as"] == second
    # Each page repeats its own decision, answered with the copy it made: a stale page makes none.
    for form, made in ((first_form, first), (second_form, second)):
        assert f"1 already retried as {made} (a repeated request)" in _told(staff.post("/tasks/", form, follow=True))[0]
    assert sorted(_copies(broker, failed)) == sorted([first, second]) and LogEntry.objects.count() == 2
    assert broker.records.get_result(failed)["retried_as"] == second


def test_a_repeat_is_known_by_the_copys_record_past_the_enqueued_ids_window(staff, broker, failed):
    form = {"action": "retry", "task": [failed], f"retried_as:{failed}": ""}
    assert _told(staff.post("/tasks/", form, follow=True)) == ["Enqueued 1 retry task(s)."]
    [copy] = _copies(broker, failed)
    broker.client.zrem(broker.keys.enqueued("b"), copy)  # as 24 h later
    assert "1 already retried as" in _told(staff.post("/tasks/", form, follow=True))[0]
    assert _copies(broker, failed) == [copy]


def test_a_repeat_is_known_by_the_enqueued_ids_once_the_copys_record_is_deleted(staff, broker, failed):
    form = {"action": "retry", "task": [failed], f"retried_as:{failed}": ""}
    assert _told(staff.post("/tasks/", form, follow=True)) == ["Enqueued 1 retry task(s)."]
    [copy] = _copies(broker, failed)
    broker.client.delete(broker.keys.result(copy))
    assert f"1 already retried as {copy}" in _told(staff.post("/tasks/", form, follow=True))[0]
    assert broker.inspect.queue_stats("b").pending == 2


def test_the_copys_id_is_a_uuid_derived_from_the_task_and_the_retry_the_page_showed():
    made = {browser.retry_task_id(task, shown) for task in ("a", "b", "caf\udce9") for shown in ("", "a", "b")}
    assert len(made) == 9
    assert browser.retry_task_id("a", "b") == browser.retry_task_id("a", "b") != browser.retry_task_id("a\0b", "")
    for task_id in made:
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", task_id)
