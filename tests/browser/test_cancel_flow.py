"""A staff user in headless Chromium cancels a queued task from its page."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tests.browser.test_web_flow import log_in

# One worker runs the browser tests one after another: two Chromiums at once only slow each other.
pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser"), pytest.mark.django_db(transaction=True)]


def test_cancel_a_queued_task_from_its_page(page, snap, live_server, broker):
    from playwright.sync_api import expect

    task_id = producer.enqueue("demo.echo", [1], delay_s=600)[0].id
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/{task_id}/")
    expect(page.locator("#task-status")).to_have_text("READY")
    page.click("#task-cancel")
    expect(page.locator("ul.messagelist")).to_contain_text("cancelled: it will not run")
    expect(page.locator("#task-status")).to_have_text("CANCELLED")
    expect(page.locator("#task-cancelled")).to_contain_text("by user:admin")
    expect(page.locator("#task-cancel")).to_have_count(0)
    snap("cancelled")
    assert broker.records.get_result(task_id)["status"] == "CANCELLED"
