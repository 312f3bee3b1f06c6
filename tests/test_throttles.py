"""Throttles on real Redis: slot scripts, key tokens, pausing (command, API, dashboard, metrics) and the admin form."""

from __future__ import annotations

import logging
import time
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from prometheus_client import CollectorRegistry, generate_latest

from tasks_app import producer
from tasks_app.admin import TaskTypeForm
from tasks_app.collectors import QueueCollector
from tasks_app.protocol.codec import decode_task
from tasks_app.protocol.keys import MISSING_KEY_TOKEN, limit_key_token
from tasks_app.protocol.limits import SlotSet, Waiter
from tests.support.scrape import Scrape
from tests.support.tokens import issue_token
from tests.test_admin import form_data

pytestmark = pytest.mark.django_db

SLOTS = SlotSet("cap.type", None, 2)
LEASE_MS = 3_000  # at most the uptime the suite waits for (conftest): slot scripts wait a lease after a restart
IDLE_MS = 60_000


def waiter(n: int) -> Waiter:
    return Waiter("q", b"+000task-%d" % n)


# --- key tokens ------------------------------------------------------------------------------
def test_key_tokens_keep_short_names_and_hash_the_rest():
    assert limit_key_token({"tenant": "acme-1"}, "tenant") == "acme-1"
    assert limit_key_token({"tenant": 42}, "tenant") == limit_key_token({"tenant": "42"}, "tenant") == "42"
    assert limit_key_token({}, "tenant") == MISSING_KEY_TOKEN
    hashed = {limit_key_token({"tenant": value}, "tenant") for value in ["{x}", "café", "x" * 65, None, [1], True]}
    assert len(hashed) == 6 and all(token.startswith("#") and len(token) == 33 for token in hashed)
    assert limit_key_token({"tenant": "\udce9"}, "tenant").startswith("#")  # a lone surrogate never raises


# --- slot scripts ----------------------------------------------------------------------------
def test_slots_cap_holders_and_free_ones_go_to_the_oldest_waiter(broker):
    assert broker.limits.acquire_slot(SLOTS, "h1", waiter(1), LEASE_MS, IDLE_MS) == (True, [])
    assert broker.limits.acquire_slot(SLOTS, "h2", waiter(2), LEASE_MS, IDLE_MS) == (True, [])
    assert broker.limits.acquire_slot(SLOTS, "h3", waiter(3), LEASE_MS, IDLE_MS) == (False, [])
    assert broker.limits.wait_for_slot(SLOTS, waiter(4), 200, IDLE_MS, LEASE_MS) == []
    # enqueued earlier: first in line
    assert broker.limits.wait_for_slot(SLOTS, waiter(3), 100, IDLE_MS, LEASE_MS) == []
    # waiting already: keeps its place
    assert broker.limits.wait_for_slot(SLOTS, waiter(4), 50, IDLE_MS, LEASE_MS) == []

    assert broker.limits.release_slot(SLOTS, "h1", IDLE_MS, LEASE_MS) == [waiter(3)]  # one waiter per freed slot
    # The freed slot is kept for the woken task: a newcomer cannot take it, the woken task can.
    assert broker.limits.acquire_slot(SLOTS, "h5", waiter(5), LEASE_MS, IDLE_MS) == (False, [])
    assert broker.limits.acquire_slot(SLOTS, "h3", waiter(3), LEASE_MS, IDLE_MS) == (True, [])
    assert broker.limits.release_slot(SLOTS, "h2", IDLE_MS, LEASE_MS) == [waiter(4)]
    assert broker.client.zcard(broker.keys.running(*SLOTS[:2])) == 2
    assert 0 < broker.client.pttl(broker.keys.running(SLOTS.task_type)) <= IDLE_MS  # idle keys expire


def test_a_holder_that_stops_renewing_lapses_and_a_renewed_one_does_not(broker):
    broker.limits.acquire_slot(SLOTS, "dead", waiter(1), 300, IDLE_MS)
    broker.limits.acquire_slot(SLOTS, "live", waiter(2), 300, IDLE_MS)
    broker.limits.wait_for_slot(SLOTS, waiter(3), 1, IDLE_MS, 300)
    for _ in range(3):
        time.sleep(0.15)
        assert broker.limits.renew_slots({(SLOTS.task_type, None): ["live"]}, 300, IDLE_MS) == 1
    # The dead holder's slot went to the waiter as soon as a script saw it lapsed.
    assert broker.limits.wait_for_slot(SLOTS, waiter(4), 2, IDLE_MS, 300) == [waiter(3)]
    assert broker.limits.renew_slots({(SLOTS.task_type, None): ["dead"]}, 300, IDLE_MS) == 0  # never brought back


def test_key_values_have_slot_sets_of_their_own(broker):
    for tenant in ("a", "b"):
        slots = SlotSet("cap.type", tenant, 1)
        assert broker.limits.acquire_slot(slots, f"{tenant}1", waiter(1), LEASE_MS, IDLE_MS)[0]
        assert not broker.limits.acquire_slot(slots, f"{tenant}2", waiter(2), LEASE_MS, IDLE_MS)[0]
    assert broker.keys.running("cap.type", "a") == f"{broker.keys.prefix}:running:{{cap.type|a}}"


def test_slot_scripts_refuse_a_key_of_the_wrong_type_before_writing(broker):
    broker.client.set(broker.keys.running_waiting(SLOTS.task_type), "not a hash")
    with pytest.raises(Exception, match="WRONGTYPE"):
        broker.limits.acquire_slot(SLOTS, "h1", waiter(1), LEASE_MS, IDLE_MS)
    assert broker.client.zcard(broker.keys.running(*SLOTS[:2])) == 0


def test_waking_moves_a_waiting_task_from_delayed_to_pending(broker):
    task = producer.enqueue("demo.echo", delay_s=600)[0]
    raw = broker.client.zrange(broker.keys.delayed("default"), 0, 0)[0]
    woken = Waiter("default", raw)
    assert broker.limits.wake(woken)
    assert broker.inspect.queue_stats("default").delayed == 0
    assert decode_task(broker.client.lrange(broker.keys.pending("default"), 0, -1)[-1]).id == task.id
    assert not broker.limits.wake(woken)  # no longer delayed: nothing to do


# --- pausing ---------------------------------------------------------------------------------
def test_a_paused_queue_claims_nothing_and_accepts_enqueues(broker):
    broker.leases.heartbeat(["default"], "c1", 60_000, {})
    assert broker.control.pause("default", by="ops")
    assert not broker.control.pause("default")
    producer.enqueue("demo.echo", count=2)
    assert broker.queue.claim_with_suspect("default", "c1", 10).paused
    stats = broker.inspect.queue_stats("default")
    assert (stats.paused, stats.pending, stats.as_dict()["paused"]) == (True, 2, True)
    assert broker.control.pause_states(["default", "other"])["default"]["by"] == "ops"
    assert broker.control.resume("default") and not broker.control.resume("default")
    assert len(broker.queue.claim("default", "c1", 10)) == 2


def _pause_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "tasks_app.control"]


def test_queue_command_pauses_and_resumes(broker, caplog):
    out = StringIO()
    caplog.set_level(logging.WARNING, logger="tasks_app.control")
    call_command("queue", "pause", "default", stdout=out)
    call_command("queue", "pause", "default", stdout=out)
    assert _pause_warnings(caplog) == ["queue default paused by manage.py queue"]  # a change only
    assert broker.control.is_paused("default")
    call_command("queuestats", stdout=out)
    call_command("queue", "resume", "default", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["queue default paused", "queue default was already paused"]
    assert lines[3].split()[-1] == "paused" and lines[-1] == "queue default resumed"
    assert not broker.control.is_paused("default")
    call_command("queue", "pause", "default", "--by", "night shift", stdout=out)
    assert _pause_warnings(caplog)[1:] == [
        "queue default resumed by manage.py queue",
        "queue default paused by night shift",
    ]
    with pytest.raises(CommandError, match="queue"):
        call_command("queue", "pause", "bad name")


def test_collector_exports_whether_each_queue_is_paused(broker):
    broker.control.pause("held")
    producer.enqueue("demo.echo")
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: broker))
    scrape = Scrape(generate_latest(registry).decode())
    assert scrape.value("taskqueue_queue_paused", queue="held") == 1
    assert scrape.value("taskqueue_queue_paused", queue="default") == 0


@pytest.fixture
def operator():
    """A staff user allowed to pause queues."""
    user = get_user_model().objects.create_user("ops", password=None, is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label="tasks_app", codename="pause_queue"))
    return user


def test_api_pauses_and_resumes_with_the_permission_only(client, broker, operator):
    token = issue_token(operator, "ci")[1]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    paused = client.post("/api/queues/default/pause/", **auth)
    assert paused.status_code == 200
    assert paused.json()["paused"] and paused.json()["changed"] and paused.json()["paused_by"] == "ops"
    assert client.get("/api/queues/default/", **auth).json()["paused"]
    assert client.post("/api/queues/default/resume/", **auth).json()["paused"] is False
    assert client.post("/api/queues/bad%20name/pause/", **auth).status_code == 400
    plain = get_user_model().objects.create_user("plain", password=None, is_staff=True)
    refused = client.post("/api/queues/default/pause/", HTTP_AUTHORIZATION=f"Bearer {issue_token(plain, 'x')[1]}")
    assert refused.status_code == 403 and not broker.control.is_paused("default")


def test_dashboard_shows_paused_queues_and_pauses_with_a_button(staff, broker, caplog):
    caplog.set_level(logging.WARNING, logger="tasks_app.control")
    producer.enqueue("demo.echo")
    page = staff.get("/tasks/dashboard/").content.decode()
    assert 'value="pause"' in page and "Running" in page
    assert staff.post("/tasks/dashboard/default/pause/", {"action": "pause"}).status_code == 302
    assert broker.control.pause_states(["default"])["default"]["by"] == "boss"
    page = staff.get("/tasks/dashboard/").content.decode()
    assert "Paused" in page and 'value="resume"' in page
    staff.post("/tasks/dashboard/default/pause/", {"action": "resume"})
    assert not broker.control.is_paused("default")
    assert _pause_warnings(caplog) == ["queue default paused by boss", "queue default resumed by boss"]


def test_dashboard_pause_needs_the_permission_and_a_post(client, broker):
    user = get_user_model().objects.create_user("viewer", password=None, is_staff=True)
    client.force_login(user)
    assert client.post("/tasks/dashboard/default/pause/", {"action": "pause"}).status_code == 403
    assert client.get("/tasks/dashboard/default/pause/").status_code == 405
    assert not broker.control.is_paused("default")


# --- the admin form --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rate_limit_key": "tenant_id"}, "rate_limit_key"),
        ({"max_running_key": "tenant_id"}, "max_running_key"),
        ({"max_running": "0"}, "max_running"),
        ({"max_running": "2", "max_running_key": "not a name"}, "max_running_key"),
    ],
)
def test_throttle_combinations_that_do_not_fit_are_refused(overrides, field):
    form = TaskTypeForm(data=form_data(**overrides))
    assert not form.is_valid() and field in form.errors


def test_keyed_throttles_with_their_limits_are_accepted():
    form = TaskTypeForm(
        data=form_data(
            rate_limit="3", rate_limit_key="tenant", max_running="2", max_running_key="tenant", unique_until="window"
        )
    )
    assert form.is_valid(), form.errors
    row = form.save()
    assert (row.rate_limit_key, row.max_running, row.max_running_key) == ("tenant", 2, "tenant")
