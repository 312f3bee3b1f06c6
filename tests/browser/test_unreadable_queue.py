"""A staff user in headless Chromium: the dashboard beside a queue whose key a foreign writer spoiled."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tests.browser.test_web_flow import log_in

# One worker runs the browser tests one after another: two Chromiums at once only slow each other.
pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser"), pytest.mark.django_db(transaction=True)]


def test_the_dashboard_shows_the_good_queue_and_the_broken_one_as_unreadable(page, snap, live_server, broker):
    from playwright.sync_api import expect

    TaskType.objects.create(name="ops.echo", handler="demo.echo", queue="ops")
    producer.enqueue("ops.echo", ["fine"], count=2)
    [broken] = producer.enqueue("ops.echo", ["lost"], queue="broken")
    broker.client.delete(broker.keys.pending("broken"))
    broker.client.hset(broker.keys.pending("broken"), "foreign", "writer")  # before: 503 for every queue
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/dashboard/")
    good = page.locator('tr.queue-row[data-queue="ops"]')
    expect(good.locator("td").nth(1)).to_have_text("2")
    expect(good.locator(".queue-state")).to_contain_text("Running")
    bad = page.locator('tr.queue-row[data-queue="broken"]')
    expect(bad.locator("td.queue-unreadable")).to_contain_text("Unreadable")
    expect(bad.locator("td.queue-unreadable")).to_contain_text(broker.keys.pending("broken"))
    expect(bad.locator("td.queue-unreadable")).to_contain_text("WRONGTYPE")
    expect(page.locator('.queue-charts[data-queue="ops"] svg')).to_have_count(2)  # its charts, as usual
    expect(page.locator("#redis-away")).to_have_count(0)
    snap("dashboard")

    page.click("text=Browse tasks")
    expect(page.locator("tr.task-row")).to_have_count(3)  # the history of both queues is readable
    page.goto(f"{live_server.url}/tasks/{broken.id}/")
    expect(page.locator("#task-status")).to_have_text("READY")
