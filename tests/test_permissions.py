"""Permissions: enqueue_task for the form and the API (tokens act as their user), manage_dead_letters for
requeue and delete, and API tokens that only a superuser mints for someone else."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.test import Client

from tasks_app.models import ApiToken
from tasks_app.protocol.broker import get_broker
from tests.support.tokens import issue_token
from tests.test_dead_letter_views import dead_url, make_dead
from tests.test_views import errors_shown, post_enqueue

pytestmark = pytest.mark.django_db

ENQUEUE_URL = "/tasks/enqueue/"


def staff_user(username: str, *codenames: str):
    """A staff user (not a superuser) holding exactly the tasks_app permissions named."""
    user = get_user_model().objects.create_user(username, password=None, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="tasks_app", codename__in=codenames))
    return get_user_model().objects.get(pk=user.pk)  # fresh: no cached permissions


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def keys_written(broker) -> list[bytes]:
    """Every key of this test's prefix: pending lists, delayed sets, READY records, the queue set."""
    return sorted(broker.client.scan_iter(match=f"{broker.keys.prefix}:*", count=1000))


def test_the_permissions_are_declared_by_a_migration():
    codenames = set(Permission.objects.filter(content_type__app_label="tasks_app").values_list("codename", flat=True))
    assert {"enqueue_task", "manage_dead_letters"} <= codenames


def test_staff_without_enqueue_task_gets_403_from_the_form_and_enqueues_nothing(broker, echo_type):
    client = logged_in(staff_user("viewer"))
    assert f'href="{ENQUEUE_URL}"' not in client.get("/tasks/dashboard/").content.decode()
    assert client.get(ENQUEUE_URL).status_code == 403
    assert post_enqueue(client, args="[1]").status_code == 403
    assert post_enqueue(client, args="[1]", delay="60").status_code == 403
    assert broker.client.llen(broker.keys.pending("web")) == 0
    assert keys_written(broker) == []  # no pending, delayed or READY record anywhere


def test_enqueue_task_lets_a_staff_user_use_the_form(broker, echo_type):
    client = logged_in(staff_user("producer", "enqueue_task"))
    response = post_enqueue(client, args="[1]")
    assert response.status_code == 302, errors_shown(response)
    assert broker.client.llen(broker.keys.pending("web")) == 1


def test_the_permission_may_come_from_a_group(broker, echo_type):
    user = staff_user("grouped")
    group = Group.objects.create(name="producers")
    group.permissions.add(Permission.objects.get(codename="enqueue_task"))
    user.groups.add(group)
    response = post_enqueue(logged_in(user), args="[1]")
    assert response.status_code == 302, errors_shown(response)


def api_post(client: Client, token: str | None = None) -> object:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.post(
        "/api/tasks/", json.dumps({"type": "web.echo", "args": [1]}), content_type="application/json", **headers
    )


def test_a_token_acts_with_its_users_permissions(broker, echo_type):
    _, token = issue_token(staff_user("svc"), "ci")
    response = api_post(Client(), token)
    assert response.status_code == 403
    assert "tasks_app.enqueue_task" in response.json()["error"]
    assert keys_written(broker) == []

    _, allowed = issue_token(staff_user("svc2", "enqueue_task"), "ci")
    assert api_post(Client(), allowed).status_code == 201
    assert broker.client.llen(broker.keys.pending("web")) == 1


def test_a_session_without_enqueue_task_gets_403_from_the_api(broker, echo_type):
    client = Client(enforce_csrf_checks=False)
    client.force_login(staff_user("viewer"))
    assert api_post(client).status_code == 403
    assert keys_written(broker) == []


def test_staff_without_manage_dead_letters_can_look_but_not_requeue_or_delete(broker, echo_type):
    make_dead(broker)
    [dead] = get_broker().inspect.list_dead_tasks("web")
    before = broker.client.zrange(broker.keys.dead("web"), 0, -1, withscores=True)
    client = logged_in(staff_user("viewer"))

    page = client.get(dead_url())
    assert page.status_code == 200
    html = page.content.decode()
    assert dead.task_id in html and "requeue-one" not in html and 'value="delete"' not in html

    for data in (
        {"requeue_one": dead.ref},
        {"action": "requeue", "ref": [dead.ref]},
        {"action": "delete", "ref": [dead.ref]},
    ):
        assert client.post(dead_url(), data).status_code == 403
    assert broker.client.zrange(broker.keys.dead("web"), 0, -1, withscores=True) == before
    assert broker.client.llen(broker.keys.pending("web")) == 0


def test_manage_dead_letters_allows_requeue_and_delete(broker, echo_type):
    make_dead(broker)
    make_dead(broker)
    first, second = get_broker().inspect.list_dead_tasks("web")
    client = logged_in(staff_user("operator", "manage_dead_letters"))
    assert "requeue-one" in client.get(dead_url()).content.decode()
    assert client.post(dead_url(), {"requeue_one": first.ref}).status_code == 302
    assert client.post(dead_url(), {"action": "delete", "ref": [second.ref]}).status_code == 302
    stats = broker.inspect.queue_stats("web")
    assert (stats.dead, stats.pending) == (0, 1)


def token_admin_user(username: str):
    return staff_user(username, "add_apitoken", "view_apitoken", "change_apitoken")


def test_a_non_superuser_sees_and_mints_tokens_only_for_themselves():
    alice, bob = token_admin_user("alice"), token_admin_user("bob")
    bobs, _ = issue_token(bob, "bob-ci")
    client = logged_in(alice)

    listing = client.get("/admin/tasks_app/apitoken/").content.decode()
    assert "bob-ci" not in listing
    assert client.get(f"/admin/tasks_app/apitoken/{bobs.pk}/change/").status_code in {302, 404}

    add_page = client.get("/admin/tasks_app/apitoken/add/").content.decode()
    assert 'name="user"' not in add_page
    response = client.post("/admin/tasks_app/apitoken/add/", {"user": bob.pk, "name": "sneaky"})
    assert response.status_code == 200
    assert ApiToken.objects.get(name="sneaky").user == alice
    assert list(ApiToken.objects.filter(user=bob).values_list("name", flat=True)) == ["bob-ci"]


def test_a_superuser_mints_tokens_for_anyone():
    boss = get_user_model().objects.create_superuser("boss", "boss@example.com", None)
    bob = token_admin_user("bob")
    client = logged_in(boss)
    assert client.post("/admin/tasks_app/apitoken/add/", {"user": bob.pk, "name": "for-bob"}).status_code == 200
    assert ApiToken.objects.get(name="for-bob").user == bob
    assert "for-bob" in client.get("/admin/tasks_app/apitoken/").content.decode()
