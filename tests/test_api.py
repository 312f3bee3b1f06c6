"""The JSON API: token and session auth, validation errors, the result record."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import OperationalError, connection
from django.test import Client
from django.utils import timezone

from tasks_app import producer
from tasks_app.models import ApiToken, TaskType
from tasks_app.protocol.records import ResultRecord
from tests.support.enqueued import enqueued_keys, waiting_record
from tests.support.tokens import issue_token

pytestmark = pytest.mark.django_db

TASKS_URL = "/api/tasks/"


@pytest.fixture
def staff_user():
    """A staff user allowed to enqueue."""
    user = get_user_model().objects.create_user("svc", password=None, is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label="tasks_app", codename="enqueue_task"))
    return user


@pytest.fixture
def token(staff_user) -> str:
    """A valid token of a staff user."""
    return issue_token(staff_user, "ci")[1]


@pytest.fixture
def echo_type() -> TaskType:
    return TaskType.objects.create(name="api.echo", handler="demo.echo", queue="api")


def post(client: Client, body: object, token: str | None = None, raw: bytes | None = None, **headers: str):
    if token is not None:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    data = raw if raw is not None else json.dumps(body)
    return client.post(TASKS_URL, data, content_type="application/json", **headers)


def test_token_enqueues_and_the_record_is_readable(client, broker, token, echo_type):
    response = post(client, {"type": "api.echo", "args": [1], "kwargs": {"a": "b"}, "priority": 3}, token)
    assert response.status_code == 201
    body = response.json()
    assert response["Location"] == f"http://testserver/api/tasks/{body['id']}/" == body["url"]
    assert (body["type"], body["queue"], body["priority"], body["status"]) == ("api.echo", "api", 3, "READY")
    record = client.get(response["Location"], HTTP_AUTHORIZATION=f"Bearer {token}")
    assert record.status_code == 200
    data = record.json()  # a waiting task: what its mark holds (the rest once it starts)
    assert (data["id"], data["status"], data["type"], data["queue"], data["attempts"]) == (
        body["id"],
        "READY",
        "api.echo",
        "api",
        0,
    )
    assert ResultRecord.from_fields(waiting_record(broker, body["id"], "api")).kwargs == {"a": "b"}
    assert ApiToken.objects.get().last_used_at is not None


def test_queue_and_delay_are_honoured(client, broker, token, echo_type):
    response = post(client, {"type": "api.echo", "queue": "elsewhere", "delay": 60}, token)
    assert response.status_code == 201 and response.json()["run_after"]
    assert broker.inspect.queue_stats("elsewhere").delayed == 1


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "authentication required"),
        ("Bearer not-a-token", "invalid API token"),
        ("Basic dXNlcjpwdw==", "malformed Authorization header"),
        ("Bearer ", "malformed Authorization header"),
    ],
)
def test_missing_invalid_or_malformed_credentials_are_401(client, broker, echo_type, header, message):
    headers = {"HTTP_AUTHORIZATION": header} if header else {}
    for response in (post(client, {"type": "api.echo"}, **headers), client.get("/api/tasks/some-id/", **headers)):
        assert response.status_code == 401
        assert message in response.json()["error"]
        assert response["WWW-Authenticate"].startswith("Bearer")
    assert enqueued_keys(broker) == []


def test_revoked_token_is_401(client, broker, token, echo_type):
    ApiToken.objects.update(revoked_at=timezone.now())
    response = post(client, {"type": "api.echo"}, token)
    assert (response.status_code, response.json()["error"]) == (401, "API token revoked")
    assert enqueued_keys(broker) == []


def test_token_of_an_inactive_user_is_401(client, broker, token, staff_user, echo_type):
    staff_user.is_active = False
    staff_user.save()
    assert post(client, {"type": "api.echo"}, token).status_code == 401


def test_token_of_a_non_staff_user_is_403(client, broker, echo_type):
    user = get_user_model().objects.create_user("plain", password=None)
    response = post(client, {"type": "api.echo"}, issue_token(user, "x")[1])
    assert response.status_code == 403 and "staff" in response.json()["error"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "request body is not valid JSON"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b"", "request body must be a JSON object"),
        (b'{"args": []}', "field 'type' is required"),
        (b'{"type": 5}', "field 'type' is required"),
        (b'{"type": "api.echo", "colour": "red"}', "unknown field(s): colour"),
        (b'{"type": "nope.nothing"}', "unknown task type 'nope.nothing'"),
        (b'{"type": "api.off"}', "task type 'api.off' is disabled"),
        (b'{"type": "api.orphan"}', "which is not registered"),
        (b'{"type": "api.echo", "args": {"a": 1}}', "args must be a JSON array"),
        (b'{"type": "api.echo", "kwargs": [1]}', "kwargs must be a JSON object"),
        (b'{"type": "api.echo", "kwargs": []}', "kwargs must be a JSON object"),
        (b'{"type": "api.echo", "kwargs": false}', "kwargs must be a JSON object"),
        (b'{"type": "api.echo", "kwargs": ""}', "kwargs must be a JSON object"),
        (b'{"type": "api.echo", "queue": false}', "invalid queue"),
        (b'{"type": "api.echo", "queue": 0}', "invalid queue"),
        (b'{"type": "api.echo", "queue": "no spaces"}', "invalid queue"),
        (b'{"type": "api.echo", "queue": ""}', "invalid queue"),
        (b'{"type": "api.echo", "priority": 1000}', "priority must be an integer from -100 to 100"),
        (b'{"type": "api.echo", "priority": "1"}', "priority must be an integer"),
        (b'{"type": "api.echo", "delay": -1}', "delay must be a non-negative number"),
        (b'{"type": "api.echo", "delay": 1e14}', "delay must be at most 31536000 seconds"),
        (b'{"type": "api.echo", "delay": 31536001}', "delay must be at most 31536000 seconds"),
        (
            b'{"type": "api.echo", "args": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "request body is nested too deeply: arguments may nest at most 64 levels",
        ),
        (b'{"type": "api.echo", "kwargs": ' + b'{"a":' * 65 + b"1" + b"}" * 65 + b"}", "nested too deeply"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_bad_requests_are_400_with_a_json_error(client, broker, token, echo_type, raw, message):
    TaskType.objects.create(name="api.off", handler="demo.echo", enabled=False)
    TaskType.objects.create(name="api.orphan", handler="gone.handler")
    response = post(client, None, token, raw=raw)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert message in response.json()["error"]
    assert broker.inspect.known_queues() == []
    assert list(broker.client.scan_iter(match=f"{broker.keys.prefix}:*")) == []  # no READY record either


def test_a_record_with_a_run_after_beyond_the_calendar_still_reads(client, broker, token, echo_type):
    [task] = producer.enqueue("api.echo", [1], delay_s=60)
    broker.client.hset(broker.keys.result(task.id), "run_after_ms", str(10**17))
    response = client.get(f"/api/tasks/{task.id}/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200
    assert response.json()["run_after"].startswith("9999-12-30")


def test_arguments_over_the_payload_limit_are_refused(client, broker, token, echo_type, settings):
    settings.TASKS_MAX_PAYLOAD_BYTES = 1000
    response = post(client, {"type": "api.echo", "args": ["x" * 2000]}, token)
    assert response.status_code == 400
    assert "over the limit of 1000" in response.json()["error"]
    assert enqueued_keys(broker) == []


def test_a_body_far_over_the_limit_is_413(client, broker, token, echo_type, settings):
    settings.TASKS_MAX_PAYLOAD_BYTES = 1000
    response = post(client, {"type": "api.echo", "args": ["x" * 100_000]}, token)
    assert response.status_code == 413
    assert "TASKS_MAX_PAYLOAD_BYTES=1000" in response.json()["error"]
    assert enqueued_keys(broker) == []


def test_unknown_task_is_404_json(client, broker, token):
    response = client.get("/api/tasks/does-not-exist/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 404 and "does-not-exist" in response.json()["error"]


def test_wrong_methods_are_405(client, broker, token):
    assert client.get(TASKS_URL, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 405
    response = client.delete("/api/tasks/x/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 405 and response["Allow"] == "GET"


def test_staff_session_needs_the_csrf_token(broker, staff_user, echo_type):
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff_user)
    refused = post(client, {"type": "api.echo"})
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]
    assert enqueued_keys(broker) == []
    client.get("/tasks/enqueue/")  # sets the CSRF cookie, as any staff page does
    csrf = client.cookies["csrftoken"].value
    accepted = post(client, {"type": "api.echo"}, HTTP_X_CSRFTOKEN=csrf)
    assert accepted.status_code == 201
    assert client.get(accepted["Location"]).json()["status"] == "READY"


def test_a_staff_sessions_form_post_to_the_api_is_a_400_json_error(broker, staff_user, echo_type):
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff_user)
    client.get("/tasks/enqueue/")
    csrf = client.cookies["csrftoken"].value
    response = client.post("/api/tasks/", {"type": "api.echo", "csrfmiddlewaretoken": csrf})  # multipart
    assert response.status_code == 400 and "JSON object" in response.json()["error"]
    assert enqueued_keys(broker) == []


@pytest.mark.parametrize(
    ("body", "status"),
    [(json.dumps({"type": "api.echo"}) + " " * 3_000_000, 413), ("&".join(["a=1"] * 2000), 400)],
)
def test_a_staff_sessions_body_djangos_form_parser_refuses_is_a_json_error(broker, staff_user, echo_type, body, status):
    # Its CSRF check reads a form-typed body as a form (curl -d sends JSON so): past Django's limits, that
    # failed with Django's bare HTML 400 page.
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff_user)
    client.get("/tasks/enqueue/")
    headers = {"HTTP_X_CSRFTOKEN": client.cookies["csrftoken"].value}
    response = client.post(TASKS_URL, body, content_type="application/x-www-form-urlencoded", **headers)
    assert response.status_code == status and "send it as application/json" in response.json()["error"]
    assert enqueued_keys(broker) == []


def test_token_requests_need_no_csrf_token(broker, token, echo_type):
    assert post(Client(enforce_csrf_checks=True), {"type": "api.echo"}, token).status_code == 201


def test_non_staff_session_is_403(client, broker, echo_type):
    client.force_login(get_user_model().objects.create_user("plain", password=None))
    assert post(client, {"type": "api.echo"}).status_code == 403
    assert enqueued_keys(broker) == []


def test_redis_away_is_503_with_a_json_error(client, broker, token, echo_type, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = post(client, {"type": "api.echo"}, token)
    assert response.status_code == 503
    assert "cannot enqueue" in response.json()["error"]


def _database_down(execute, sql, params, many, context):
    raise OperationalError("connection refused")


@pytest.mark.parametrize("method", ["post", "get"])
def test_the_database_away_is_503_with_a_json_error(client, broker, token, echo_type, method):
    with connection.execute_wrapper(_database_down):
        if method == "post":
            response = post(client, {"type": "api.echo"}, token)
        else:
            response = client.get(f"{TASKS_URL}some-id/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 503 and response["Retry-After"] == "5"
    assert "database is unavailable" in response.json()["error"]
    assert enqueued_keys(broker) == []


def test_a_payload_limit_above_djangos_upload_limit_is_the_one_that_holds(client, broker, token, echo_type, settings):
    settings.TASKS_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024
    response = post(client, {"type": "api.echo", "args": ["x" * (3 * 1024 * 1024)]}, token)
    assert response.status_code == 201, response.content[:200]
    assert (
        len(ResultRecord.from_fields(waiting_record(broker, response.json()["id"], "api")).args[0]) == 3 * 1024 * 1024
    )
    too_big = post(client, {"type": "api.echo", "args": ["x" * (5 * 1024 * 1024)]}, token)
    assert too_big.status_code == 400 and "over the limit" in too_big.json()["error"]
    far_too_big = post(client, {"type": "api.echo", "args": ["x" * (17 * 1024 * 1024)]}, token)
    assert far_too_big.status_code == 413


@pytest.mark.parametrize("args", [["é" * 300_000], [0] * 400_000], ids=["escaped", "spaced"])
def test_arguments_under_the_payload_limit_are_taken_however_a_client_encodes_them(
    client, broker, token, echo_type, settings, args
):
    # json.dumps writes "é" as \u00e9 (6 bytes for 2) and ", " between items: 3 and 1.5 times the payload.
    settings.TASKS_MAX_PAYLOAD_BYTES = 1024 * 1024
    response = post(client, {"type": "api.echo", "args": args}, token)
    assert response.status_code == 201, response.content[:200]
    assert ResultRecord.from_fields(waiting_record(broker, response.json()["id"], "api")).args == args


def test_a_foreign_payloads_nan_reads_as_null_in_strict_json(client, broker, token, echo_type):
    fields = {"type": "api.echo", "args": "[NaN, 1.5]", "kwargs": '{"x": -Infinity}', "return_value": "Infinity"}
    broker.client.hset(broker.keys.result("t-nan"), mapping={**fields, "progress": '{"current": NaN}'})
    response = client.get("/api/tasks/t-nan/", HTTP_AUTHORIZATION=f"Bearer {token}")
    data = json.loads(response.content, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert (data["args"], data["kwargs"], data["return_value"]) == ([None, 1.5], {"x": None}, None)
    assert data["progress"] == {"current": None}
