"""Staff pages: enqueue form, task page, queue dashboard, dead letters, API token admin."""

from __future__ import annotations

import re
import time
from urllib.parse import urlencode

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app import producer
from tasks_app.models import ApiToken, TaskType
from tasks_app.protocol.records import ResultRecord, ResultUpdate
from tests.support.enqueued import enqueued_keys, file_ready, waiting_record

pytestmark = pytest.mark.django_db

ENQUEUE_URL = "/tasks/enqueue/"
DASHBOARD_URL = "/tasks/dashboard/"


def form_errors(html: str, field: str) -> str:
    """Return the text of the error list rendered next to `field`."""
    match = re.search(rf'field-{field}">\s*<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>', html, re.S)
    return match.group(1) if match else ""


def post_enqueue(client: Client, *, url_encoded: bool = False, **fields: object) -> object:
    """Post the enqueue form: as multipart (the test client's default), or URL-encoded as a browser sends it."""
    data = {"type": "web.echo", "args": "[]", "kwargs": "{}", "queue": "", "priority": "0", "delay": "0", **fields}
    if url_encoded:
        return client.post(ENQUEUE_URL, urlencode(data), content_type="application/x-www-form-urlencoded")
    return client.post(ENQUEUE_URL, data)


def errors_shown(response) -> list[str]:
    """The error lists of a form page shown again (what a failed submission said), for assertion messages."""
    return re.findall(r'<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>', response.content.decode(), re.S)


# --- permissions ---------------------------------------------------------------------------
@pytest.mark.parametrize("url", [ENQUEUE_URL, DASHBOARD_URL, "/tasks/some-id/", "/tasks/dashboard/default/dead/"])
def test_staff_pages_send_anonymous_and_non_staff_users_to_the_login(client, broker, url):
    assert client.get(url)["Location"].startswith("/admin/login/")
    client.force_login(get_user_model().objects.create_user("plain", password=None))
    assert client.get(url)["Location"].startswith("/admin/login/")


def test_anonymous_post_to_the_form_enqueues_nothing(client, broker, echo_type):
    response = post_enqueue(client, args="[1]")
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    assert enqueued_keys(broker) == []


def test_the_admin_index_links_to_the_dashboard_and_the_form(staff):
    html = staff.get("/admin/").content.decode()
    assert f'href="{DASHBOARD_URL}"' in html and f'href="{ENQUEUE_URL}"' in html


# --- enqueue form --------------------------------------------------------------------------
def test_form_offers_only_enabled_types_with_registered_handlers(staff, broker, echo_type):
    TaskType.objects.create(name="web.off", handler="demo.echo", enabled=False)
    TaskType.objects.create(name="web.orphan", handler="no.such.handler")
    html = staff.get(ENQUEUE_URL).content.decode()
    assert '<option value="web.echo">' in html
    assert "web.off" not in html and "web.orphan" not in html


def test_form_says_when_there_is_no_type_to_enqueue(staff, broker):
    assert "No task type can be enqueued yet" in staff.get(ENQUEUE_URL).content.decode()


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"args": "[1, 2"}, "args", "Invalid JSON: Expecting"),
        ({"args": '{"a": 1}'}, "args", "Args must be a JSON array, got dict"),
        ({"kwargs": "[1]"}, "kwargs", "Kwargs must be a JSON object, got list"),
        ({"kwargs": "{'a': 1}"}, "kwargs", "Invalid JSON: Expecting property name"),
        ({"queue": "bad queue!"}, "queue", "Use 1-100 characters"),
        ({"priority": "101"}, "priority", "less than or equal to 100"),
        ({"delay": "-1"}, "delay", "greater than or equal to 0"),
        ({"type": "web.off"}, "type", "Select a valid choice"),
        ({"args": "[" * 100_000 + "]" * 100_000}, "args", "JSON is nested too deeply (at most 64 levels)"),
        ({"kwargs": '{"a":' * 65 + "1" + "}" * 65}, "kwargs", "JSON is nested too deeply (at most 64 levels)"),
        ({"delay": str(365 * 86400 + 1)}, "delay", "less than or equal to 31536000"),
        ({"unique_key": "order-7"}, "unique_key", "task type &#x27;web.echo&#x27; is not unique"),
        ({"unique_key": "k" * 1001}, "unique_key", "at most 1000 characters"),
    ],
)
def test_form_shows_the_exact_error_next_to_the_field_and_enqueues_nothing(
    staff, broker, echo_type, fields, field, message
):
    TaskType.objects.create(name="web.off", handler="demo.echo", enabled=False)
    response = post_enqueue(staff, **fields)
    assert response.status_code == 200
    assert message in form_errors(response.content.decode(), field)
    assert enqueued_keys(broker) == []


def test_form_reports_an_oversize_payload_next_to_args(staff, broker, echo_type, settings):
    settings.TASKS_MAX_PAYLOAD_BYTES = 100
    response = post_enqueue(staff, args='["' + "x" * 200 + '"]')
    assert "over the limit of 100" in form_errors(response.content.decode(), "args")
    assert enqueued_keys(broker) == []


def test_the_form_takes_what_the_payload_limit_takes_not_djangos_upload_limit(staff, broker, echo_type, settings):
    settings.TASKS_MAX_PAYLOAD_BYTES = 40_000
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    accepted = post_enqueue(staff, url_encoded=True, args='["' + "é" * 15_000 + '"]')  # 30,000 bytes, 90,000 sent
    assert accepted.status_code == 302, errors_shown(accepted)
    task_id = accepted["Location"].rstrip("/").rsplit("/", 1)[-1]
    assert ResultRecord.from_fields(waiting_record(broker, task_id, "web")).args == ["é" * 15_000]

    over = post_enqueue(staff, url_encoded=True, args='["' + "x" * 50_000 + '"]')
    assert over.status_code == 200
    assert "over the limit of 40000" in form_errors(over.content.decode(), "args")
    far_over = post_enqueue(staff, url_encoded=True, args='["' + "x" * 400_000 + '"]')
    assert far_over.status_code == 413
    assert "up to 40000 bytes of JSON (TASKS_MAX_PAYLOAD_BYTES)" in far_over.content.decode()
    assert broker.inspect.queue_stats("web").pending == 1


def test_a_multipart_form_over_djangos_upload_limit_is_a_form_error(staff, broker, echo_type, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    response = post_enqueue(staff, args='["' + "x" * 20_000 + '"]')
    assert response.status_code == 413
    assert "over DATA_UPLOAD_MAX_MEMORY_SIZE (send it URL-encoded)" in response.content.decode()
    assert enqueued_keys(broker) == []


def test_form_reports_a_type_disabled_after_the_form_was_shown(staff, broker, echo_type):
    form_html = staff.get(ENQUEUE_URL).content.decode()
    assert "web.echo" in form_html
    TaskType.objects.filter(name="web.echo").update(enabled=False)
    response = post_enqueue(staff)
    assert "Select a valid choice" in form_errors(response.content.decode(), "type")


def test_valid_form_enqueues_and_redirects_to_the_task_page(staff, broker, echo_type):
    response = post_enqueue(staff, args='[1, "two"]', kwargs='{"k": true}', queue="other", priority="5", delay="0")
    assert response.status_code == 302, errors_shown(response)
    task_id = response["Location"].rstrip("/").rsplit("/", 1)[-1]
    assert response["Location"] == reverse("tasks_app:task", args=[task_id])
    record = ResultRecord.from_fields(
        {**broker.records.get_result(task_id), **waiting_record(broker, task_id, "other")}
    )
    assert (record.type, record.queue, record.priority, record.args, record.kwargs, record.status) == (
        "web.echo",
        "other",
        5,
        [1, "two"],
        {"k": True},
        "READY",
    )
    assert broker.inspect.queue_stats("other").pending == 1


def test_the_same_unique_key_twice_gives_the_first_task_and_enqueues_nothing_more(staff, broker, echo_type):
    TaskType.objects.filter(pk=echo_type.pk).update(unique_for_s=60)
    first = post_enqueue(staff, args="[1]", unique_key="order-7")
    again = post_enqueue(staff, args="[2]", unique_key="order-7")
    other = post_enqueue(staff, args="[2]", unique_key="order-8")
    assert first["Location"] == again["Location"] != other["Location"]
    assert broker.inspect.queue_stats("web").pending == 2
    page = staff.get(again["Location"]).content.decode()
    assert "was enqueued already, within its unique window: nothing added" in page


def test_a_delay_puts_the_task_in_delayed(staff, broker, echo_type):
    post_enqueue(staff, delay="30")
    stats = broker.inspect.queue_stats("web")
    assert (stats.pending, stats.delayed) == (0, 1)


def test_form_post_without_csrf_token_is_refused(broker, echo_type):
    client = Client(enforce_csrf_checks=True)
    client.force_login(get_user_model().objects.create_superuser("boss", "b@example.com", None))
    assert post_enqueue(client).status_code == 403
    html = client.get(ENQUEUE_URL).content.decode()
    assert 'name="csrfmiddlewaretoken"' in html
    assert enqueued_keys(broker) == []


# --- task page -----------------------------------------------------------------------------
def test_task_page_of_an_unknown_task_is_404(staff, broker):
    assert staff.get("/tasks/no-such-task/").status_code == 404


def test_a_waiting_task_page_shows_its_mark_and_says_the_rest_shows_once_it_starts(staff, broker, echo_type):
    [task] = producer.enqueue("web.echo", [1])
    html = staff.get(f"/tasks/{task.id}/").content.decode()
    assert 'id="task-waiting"' in html and "web.echo" in html and "READY" in html


def test_unfinished_task_page_refreshes_itself_and_escapes_arguments(staff, broker, echo_type):
    [task] = producer.enqueue("web.echo", ["<script>alert(1)</script>"])
    file_ready(broker, [task.id], "web")  # a READY record with the arguments, as an old producer wrote
    html = staff.get(f"/tasks/{task.id}/").content.decode()
    assert "tasks_app/live.js" in html and "data-live-done" not in html and "READY" in html
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_finished_task_page_shows_the_return_value_and_stops_refreshing(staff, broker, echo_type):
    [task] = producer.enqueue("web.echo", [1])
    broker.records.record_result(
        ResultUpdate(
            task.id,
            {
                "status": "SUCCESSFUL",
                "attempts": "1",
                "finished_at_ms": "1700000000000",
                "return_value": '{"args": [1], "kwargs": {}}',
            },
            60,
        )
    )
    html = staff.get(f"/tasks/{task.id}/").content.decode()
    assert "SUCCESSFUL" in html and 'http-equiv="refresh"' not in html
    assert re.search(r'id="task-return">\{\s*&quot;args&quot;: \[\s*1\s*\]', html)


def test_failed_task_page_shows_the_error_and_traceback(staff, broker, echo_type):
    [task] = producer.enqueue("web.echo")
    broker.records.record_result(
        ResultUpdate(
            task.id,
            {"status": "FAILED", "attempts": "3", "dead_reason": "gave up"},
            60,
            append_error={
                "exception_class_path": "builtins.RuntimeError",
                "traceback": "Traceback ...\nRuntimeError: <boom>",
            },
        )
    )
    html = staff.get(f"/tasks/{task.id}/").content.decode()
    assert "Last error: builtins.RuntimeError" in html and "RuntimeError: &lt;boom&gt;" in html
    assert "gave up" in html and 'http-equiv="refresh"' not in html


# --- dashboard -----------------------------------------------------------------------------
def test_dashboard_shows_counts_consumers_and_throughput(staff, broker, echo_type):
    tasks = producer.enqueue("web.echo", count=3)
    producer.enqueue("web.echo", delay_s=60)
    broker.leases.heartbeat(["web"], "c-1", 2000, {"host": "box-1", "pid": 42, "lease_ms": 2000, "concurrency": 4})
    claimed = broker.queue.claim("web", "c-1", 2)
    assert broker.queue.ack("web", "c-1", claimed[:1]) == [True]
    html = staff.get(DASHBOARD_URL).content.decode()
    row = re.search(r'<tr class="queue-row" data-queue="web">(.*?)</tr>', html, re.S).group(1)
    numbers = [int(n) for n in re.findall(r"<td>(?:<a [^>]*>)?(\d+)", row)]
    assert numbers == [1, 1, 1, 0, 1, 1]  # pending, processing, delayed, dead, consumers, completed
    assert "c-1" in html and "box-1" in html and " ago" in html
    assert len(tasks) == 3


def test_dashboard_with_no_queues_says_so(staff, broker):
    assert "No queue has seen a task" in staff.get(DASHBOARD_URL).content.decode()


# --- API token admin -----------------------------------------------------------------------
def test_admin_creates_a_token_shown_once_and_stores_only_its_hash(staff):
    user_id = get_user_model().objects.get(username="boss").pk
    response = staff.post("/admin/tasks_app/apitoken/add/", {"user": user_id, "name": "billing"})
    html = response.content.decode()
    secret = re.search(r'id="api-token"[^>]*value="([^"]+)"|value="([^"]+)" id="api-token"', html)
    secret = next(group for group in secret.groups() if group)
    row = ApiToken.objects.get()
    assert row.key_hash == ApiToken.hash_of(secret) and secret not in row.key_hash and row.key_prefix == secret[:8]
    assert secret not in staff.get(f"/admin/tasks_app/apitoken/{row.pk}/change/").content.decode()


def test_admin_revokes_tokens(staff):
    from tests.support.tokens import issue_token

    row, _ = issue_token(get_user_model().objects.get(username="boss"), "ci")
    staff.post("/admin/tasks_app/apitoken/", {"action": "revoke", "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert row.revoked_at is not None


def test_a_revoked_token_stays_revoked_when_its_change_form_is_saved_without_the_date(broker, client):
    from tests.support.tokens import issue_token

    owner = get_user_model().objects.create_user("owner", password="x", is_staff=True)
    owner.user_permissions.set(Permission.objects.filter(codename__in=["view_apitoken", "change_apitoken"]))
    client.force_login(owner)
    row, secret = issue_token(owner, "leaked")
    ApiToken.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    client.post(
        f"/admin/tasks_app/apitoken/{row.pk}/change/", {"name": "leaked", "revoked_at_0": "", "revoked_at_1": ""}
    )
    row.refresh_from_db()
    assert row.revoked_at is not None
    assert client.get("/api/queues/b/", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 401


def test_the_form_says_so_when_redis_is_away(staff, broker, echo_type, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = post_enqueue(staff, type="web.echo", args="[1]", kwargs="{}")
    assert response.status_code == 200
    assert "cannot enqueue: Redis did not take the tasks" in response.content.decode()


# --- whatever bytes Redis holds ------------------------------------------------------------
HOSTILE_NAMES = [b"a/b", b"line\nbreak", b"<script>alert(1)</script>", b"caf\xe9", b"q" * 100_000, b"", b"\xff\xfe"]


def test_the_dashboard_shows_hostile_queue_names_escaped_and_unlinked(staff, broker, echo_type):
    producer.enqueue("web.echo", [1])
    broker.client.sadd(broker.keys.queues(), *HOSTILE_NAMES)
    broker.client.lpush(broker.keys.pending("a/b"), b"not a task")

    response = staff.get(DASHBOARD_URL)
    assert response.status_code == 200
    html = response.content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>alert" not in html
    assert "line\\nbreak" in html and "caf\\xe9" in html
    assert "q" * 199 + "…" in html and "q" * 201 not in html
    assert html.count("(not a valid queue name") == len(HOSTILE_NAMES)
    links = re.findall(r'href="(/tasks/dashboard/[^"]*)/dead/"', html)
    assert links == ["/tasks/dashboard/web"]
    row = re.search(r'data-queue="a/b">(.*?)</tr>', html, re.S).group(1)
    assert [int(n) for n in re.findall(r"<td>(\d+)</td>", row)][:1] == [1]  # its counts are still read


GARBAGE_RECORD = {
    "type": b"\xff\xfe",
    "queue": "a/b\n<i>",
    "status": "<script>x</script>",
    "priority": "high",
    "attempts": "many",
    "max_attempts": "1e3",
    "enqueued_at_ms": "yesterday",
    "run_after_ms": str(10**17),
    "started_at_ms": "nan",
    "last_attempted_at_ms": "-1e30",
    "finished_at_ms": "inf",
    "args": "[" * 5000,
    "kwargs": "[1, 2]",
    "return_value": '"\\ud800 <b>"',
    "worker_ids": '["w\\udc80", 5]',
    "errors": '[1, {"exception_class_path": "\\udfff<x>", "traceback": "line\\n<script>"}]',
    "dead_reason": b"\x00\xff",
}


@pytest.mark.parametrize("task_id", ["t-garbage", "line\nbreak", "<script>", "y" * 5000])
def test_a_record_with_garbage_fields_renders_on_the_task_page_and_in_the_api(staff, broker, task_id):
    broker.client.hset(broker.keys.result(task_id), mapping={**GARBAGE_RECORD, "id": "other/id"})
    url = reverse("tasks_app:task", args=[task_id])
    response = staff.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html
    assert "\\ud800 &lt;b&gt;" in html and "\\udfff&lt;x&gt;" in html
    assert "9999-12-30" in html or "Dec. 30, 9999" in html

    data = staff.get(reverse("tasks_app:api-task", args=[task_id])).json()
    assert (data["priority"], data["attempts"], data["args"], data["kwargs"]) == (0, 0, [], {})
    assert data["run_after"].startswith("9999-12-30") and data["enqueued_at"] is None
    assert data["worker_ids"] == ["w\\udc80", "5"] and data["return_value"] == "\\ud800 <b>"
    assert data["type"] == "\\xff\\xfe" and data["errors"][0]["traceback"] == "line\n<script>"


def test_a_foreign_key_of_another_type_at_a_record_reads_as_no_record_in_every_page(staff, broker):
    listed = producer.enqueue("demo.echo", queue="b")[0].id
    file_ready(broker, [listed], "b")
    broker.client.set(broker.keys.result("not-a-hash"), "a foreign producer's result string")
    now_ms = time.time() * 1000
    broker.client.zadd(broker.keys.history("b"), {"not-a-hash": now_ms})
    broker.client.zadd(broker.keys.history_ids("b"), {"not-a-hash": 0})
    assert staff.get(reverse("tasks_app:task", args=["not-a-hash"])).status_code == 404
    assert staff.get(reverse("tasks_app:api-task", args=["not-a-hash"])).status_code == 404
    assert re.findall(r'data-task="([^"]+)"', staff.get("/tasks/").content.decode()) == [listed]
    for query in ("?q=not-a-hash", "?q=not-"):
        assert 'data-task="' not in staff.get("/tasks/" + query).content.decode()
    assert [row["id"] for row in staff.get("/tasks/?format=json").json()["tasks"]] == [listed]
    bulk = staff.post("/tasks/", {"action": "cancel", "task": ["not-a-hash", listed]}, follow=True)
    assert "Cancelled 1 task(s)" in bulk.content.decode()
