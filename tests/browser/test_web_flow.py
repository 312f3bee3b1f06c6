"""A staff user in headless Chromium: add a type, enqueue from the form, watch it run, rescue a dead task."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.records import ResultRecord
from tests.support.enqueued import enqueued_keys, waiting_record
from tests.support.processes import wait_until

# One worker runs the browser tests one after another: two Chromiums at once only slow each other.
pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser"), pytest.mark.django_db(transaction=True)]

PASSWORD = "correct-horse-battery"


def log_in(page, base_url: str) -> None:
    """Log in through the admin's login form as a fresh superuser."""
    get_user_model().objects.create_superuser("admin", "admin@example.com", PASSWORD)
    page.goto(f"{base_url}/admin/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#task-queue-links")


def test_add_a_type_enqueue_from_the_form_and_watch_it_succeed(page, snap, live_server, broker, consumer_in_thread):
    from playwright.sync_api import expect

    log_in(page, live_server.url)
    page.click("text=Task types")
    page.click(".object-tools a.addlink")
    page.fill("#id_name", "browser.echo")
    page.select_option("#id_handler", "demo.echo")
    page.fill("#id_queue", "browser")
    page.click("input[name=_save]")
    expect(page.locator("ul.messagelist")).to_contain_text("browser.echo")
    assert TaskType.objects.get(name="browser.echo").handler == "demo.echo"

    page.goto(f"{live_server.url}/admin/")
    page.click("#task-queue-links >> text=Enqueue a task")
    page.select_option("#id_type", "browser.echo")
    page.fill("#id_args", '[1, "two"')
    page.fill("#id_kwargs", '{"greeting": "<b>hi</b>"}')
    page.click("input[type=submit]")
    expect(page.locator(".field-args ul.errorlist")).to_contain_text("Invalid JSON")
    snap("form-error")
    assert enqueued_keys(broker) == []

    page.fill("#id_args", '[1, "two"]')
    with consumer_in_thread(queues=["browser"], concurrency=2):
        page.click("input[type=submit]")
        page.wait_for_url(re.compile(r"/tasks/[0-9a-f-]{36}/$"))
        expect(page.locator("#task-status")).to_have_text("SUCCESSFUL")
    expect(page.locator("#task-return")).to_contain_text('"greeting": "<b>hi</b>"')  # shown as text, escaped
    snap("task-successful")
    task_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    record = ResultRecord.from_fields(broker.records.get_result(task_id))
    assert (record.status, record.attempts, record.return_value) == (
        "SUCCESSFUL",
        1,
        {"args": [1, "two"], "kwargs": {"greeting": "<b>hi</b>"}},
    )


def test_requeue_a_dead_lettered_task_from_the_dashboard(page, snap, live_server, broker, consumer_in_thread):
    from playwright.sync_api import expect

    TaskType.objects.create(name="browser.fail", handler="demo.fail", queue="browser", max_attempts=1)
    TaskType.objects.create(name="browser.echo", handler="demo.echo", queue="browser")
    log_in(page, live_server.url)
    with consumer_in_thread(queues=["browser"], concurrency=2) as consumer:
        [dead] = producer.enqueue("browser.fail", ["it broke"])
        producer.enqueue("browser.echo", count=3)
        wait_until(
            lambda: broker.inspect.queue_stats("browser").dead == 1, 15, message="the failing task to be dead-lettered"
        )
        wait_until(lambda: broker.inspect.queue_stats("browser").pending == 0, 15, message="the echo tasks to run")

        page.goto(f"{live_server.url}/admin/")
        page.click("#task-queue-links >> text=Queue dashboard")
        row = page.locator('tr.queue-row[data-queue="browser"]')
        expect(row).to_contain_text("browser")
        expect(page.locator("tr.consumer-row")).to_contain_text(consumer.consumer_id)
        snap("dashboard")

        row.locator("a.dead-link").click()
        dead_row = page.locator(f'tr.dead-row[data-task-id="{dead.id}"]')
        expect(dead_row).to_contain_text("browser.fail")
        expect(dead_row).to_contain_text("RuntimeError: it broke")
        snap("dead-letters")
        dead_row.locator("button.requeue-one").click()
        expect(page.locator("ul.messagelist")).to_contain_text("Requeued 1 task(s).")
        # The consumer runs it again (a second run, and it fails again: demo.fail always does).
        wait_until(
            lambda: len(ResultRecord.from_fields(broker.records.get_result(dead.id)).worker_ids) == 2,
            15,
            message="the requeued task to run again",
        )
    entry = LogEntry.objects.get(object_id=dead.id)
    assert (entry.action_flag, entry.user.username) == (CHANGE, "admin")
    page.goto(f"{live_server.url}/admin/")
    expect(page.locator("#recent-actions-module")).to_contain_text(dead.id)


def test_the_dashboard_shows_a_hostile_queue_name_as_text(page, snap, live_server, broker):
    from playwright.sync_api import expect

    hostile = '<img src=x onerror="window.pwned=1;alert(1)">a/b\n<script>window.pwned=2</script>'
    broker.client.sadd(broker.keys.queues(), hostile.encode(), b"caf\xe9", b"default")
    broker.client.zadd(broker.keys.dead("default"), {b"\xff not a task": 1})
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))

    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/dashboard/")
    rows = page.locator("tr.queue-row")
    expect(rows).to_have_count(3)
    hostile_row = rows.filter(has_text="onerror")
    expect(hostile_row).to_contain_text('<img src=x onerror="window.pwned=1;alert(1)">a/b\\n<script>')
    expect(hostile_row.locator("a")).to_have_count(0)
    expect(rows.filter(has_text="caf\\xe9").locator("a")).to_have_count(0)
    snap("hostile-queue-name")
    assert page.evaluate("window.pwned") is None and dialogs == []
    assert page.locator("img[src=x]").count() == 0

    page.click("tr.queue-row[data-queue=default] a.dead-link")
    expect(page.locator("tr.dead-row")).to_have_count(1)
    expect(page.locator("tr.dead-row")).to_contain_text("not a task: delete only")


def test_pause_and_resume_a_queue_from_the_dashboard(page, snap, live_server, broker):
    from playwright.sync_api import expect

    producer.enqueue("demo.echo", count=2)
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/dashboard/")
    row = page.locator('tr.queue-row[data-queue="default"]')
    row.locator("button.pause-button").click()
    expect(page.locator("ul.messagelist")).to_contain_text("Queue default paused.")
    expect(row.locator(".paused-badge")).to_have_text("Paused")
    snap("paused-queue")
    assert broker.control.is_paused("default")
    row.locator("button.pause-button").click()
    expect(page.locator("ul.messagelist")).to_contain_text("Queue default resumed.")
    expect(row.locator(".queue-state")).to_contain_text("Running")
    assert not broker.control.is_paused("default")


def test_a_waiting_tasks_page_says_its_queue_is_paused_until_it_is_resumed(page, live_server, broker):
    from playwright.sync_api import expect

    from tasks_app.control import set_queue_paused

    [task] = producer.enqueue("demo.echo", [1])
    set_queue_paused("default", True, by="ops")
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/{task.id}/")
    expect(page.locator("#task-status")).to_have_text("READY")
    expect(page.locator("#task-queue-paused")).to_have_text("paused")
    set_queue_paused("default", False, by="ops")
    expect(page.locator("#task-queue-paused")).to_have_count(0)  # the page updates itself


def test_two_enqueues_from_the_form_with_the_same_unique_key_give_one_task(page, snap, live_server, broker):
    from playwright.sync_api import expect

    TaskType.objects.create(name="browser.once", handler="demo.echo", queue="browser", unique_for_s=600)
    log_in(page, live_server.url)
    task_ids = []
    for args in ("[1]", "[2]"):
        page.goto(f"{live_server.url}/tasks/enqueue/")
        page.select_option("#id_type", "browser.once")
        page.fill("#id_args", args)
        page.fill("#id_unique_key", "order-7")
        page.click("input[type=submit]")
        page.wait_for_url(re.compile(r"/tasks/[0-9a-f-]{36}/$"))
        task_ids.append(page.url.rstrip("/").rsplit("/", 1)[-1])
    expect(page.locator("ul.messagelist")).to_contain_text("was enqueued already")
    snap("duplicate")
    assert task_ids[0] == task_ids[1]
    assert broker.inspect.queue_stats("browser").pending == 1
    assert ResultRecord.from_fields(broker.records.get_result(task_ids[0])).args == [1]


def test_the_form_takes_arguments_over_djangos_upload_limit_up_to_the_payload_limit(
    page, live_server, broker, settings
):
    from playwright.sync_api import expect

    settings.TASKS_MAX_PAYLOAD_BYTES = 40_000
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_000
    TaskType.objects.create(name="browser.big", handler="demo.echo", queue="browser")
    log_in(page, live_server.url)
    for args, refused in (('["' + "y" * 400_000 + '"]', True), ('["' + "é" * 15_000 + '"]', False)):
        page.goto(f"{live_server.url}/tasks/enqueue/")
        page.select_option("#id_type", "browser.big")
        page.fill("#id_args", args)
        page.click("input[type=submit]")
        if refused:
            expect(page.locator("#enqueue-refused")).to_contain_text("TASKS_MAX_PAYLOAD_BYTES")
            assert enqueued_keys(broker) == []
    page.wait_for_url(re.compile(r"/tasks/[0-9a-f-]{36}/$"))
    task_id = page.url.rstrip("/").rsplit("/", 1)[-1]
    assert ResultRecord.from_fields(waiting_record(broker, task_id, "browser")).args == ["é" * 15_000]


def test_a_saved_task_types_name_shows_read_only_with_how_to_rename(page, live_server, broker):
    from playwright.sync_api import expect

    row = TaskType.objects.create(name="browser.named", handler="demo.echo", queue="browser")
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/admin/tasks_app/tasktype/{row.pk}/change/")
    expect(page.locator(".field-name .readonly")).to_have_text("browser.named")
    assert page.locator("input[name=name]").count() == 0
    expect(page.locator(".field-name")).to_contain_text("It cannot be changed once saved")
    page.fill("#id_queue", "elsewhere")
    page.click("input[name=_save]")
    expect(page.locator("ul.messagelist")).to_contain_text("browser.named")
    row.refresh_from_db()
    assert (row.name, row.queue) == ("browser.named", "elsewhere")


def test_a_schedules_last_run_under_an_id_no_url_can_hold_shows_unlinked(page, live_server, broker):
    from playwright.sync_api import expect

    from tasks_app.models import PeriodicTask

    echo = TaskType.objects.create(name="browser.tick", handler="demo.echo", queue="browser")
    PeriodicTask.objects.create(name="browser.tick", task_type=echo, interval_s=60)
    now_ms = broker.inspect.server_time_ms() // 60_000 * 60_000
    state = {"slot_ms": now_ms, "fired_slot_ms": now_ms, "task_id": "<b>a/b</b>"}  # a foreign writer's
    broker.client.hset(broker.keys.periodic("browser", "browser.tick"), mapping=state)
    log_in(page, live_server.url)
    for url in ("/tasks/dashboard/", "/admin/tasks_app/periodictask/"):
        page.goto(f"{live_server.url}{url}")
        expect(page.locator("body")).to_contain_text(" UTC")
        assert page.locator("a[href*='a/b']").count() == 0 and page.locator("b", has_text="a/b").count() == 0


def test_a_dead_letter_links_its_task_page_only_while_its_record_is_kept(page, live_server, broker, echo_type):
    from playwright.sync_api import expect

    from tests.test_dead_letter_views import make_dead

    kept, expired = make_dead(broker), make_dead(broker)
    broker.client.delete(broker.keys.result(expired.id))  # results expire long before dead letters do
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/dashboard/web/dead/")
    expect(page.locator("tr.dead-row")).to_have_count(2)
    expect(page.locator(f'tr.dead-row[data-task-id="{expired.id}"] a')).to_have_count(0)
    expect(page.locator(f'tr.dead-row[data-task-id="{expired.id}"]')).to_contain_text("its record has expired")
    page.click(f'tr.dead-row[data-task-id="{kept.id}"] a.task-link')
    expect(page.locator("#task-status")).to_have_text("FAILED")
