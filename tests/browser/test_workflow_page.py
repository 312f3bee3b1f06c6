"""A staff user in headless Chromium watching a workflow's page while a real consumer runs its chord."""

from __future__ import annotations

import pytest

import tests.support.workflow_handlers  # noqa: F401  (registers the workflow handlers in this process)
from tasks_app.producer import TaskRequest
from tasks_app.workflows import chord
from tests.browser.test_web_flow import log_in

# One worker runs the browser tests one after another: two Chromiums at once only slow each other.
pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser"), pytest.mark.django_db(transaction=True)]


def test_the_workflow_page_follows_a_chord_live_on_a_real_consumer(
    page, snap, live_server, broker, consumer_process, monkeypatch
):
    from playwright.sync_api import expect

    monkeypatch.setattr("tasks_app.web.workflows.REFRESH_S", 1)  # the live server runs in this process
    handle = chord([TaskRequest("wf.hold", args=[n]) for n in range(3)], then=TaskRequest("wf.collect")).enqueue()
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/workflows/{handle.id}/")
    expect(page.locator("#workflow-status")).to_have_text("RUNNING")
    callback = page.locator('li.workflow-member[data-path="0.1"] .tasks-status')
    expect(callback).to_have_text("WAITING")
    expect(page.locator('#workflow-counts [data-status="READY"]')).to_contain_text("3")
    page.evaluate("() => { window.sameDocument = true; }")  # gone if the page were loaded again

    consumer_process("--concurrency", "4", "--lease", "2", TASK_HANDLER_MODULES="tests.support.workflow_handlers")
    # The members run, held: the page shows it by its own refreshes.
    expect(page.locator('#workflow-counts [data-status="RUNNING"]')).to_contain_text("3", timeout=30_000)
    expect(page.locator('li.workflow-member[data-path="0.0.1"] .tasks-status')).to_have_text("RUNNING")
    expect(callback).to_have_text("WAITING")
    assert page.evaluate("() => window.sameDocument") is True
    snap("running")

    broker.client.set(f"{broker.keys.prefix}:test:release", 1)
    expect(page.locator("#workflow-status")).to_have_text("SUCCESSFUL", timeout=30_000)
    expect(callback).to_have_text("SUCCESSFUL")
    expect(page.locator('#workflow-counts [data-status="SUCCESSFUL"]')).to_contain_text("4")
    expect(page.locator("#workflow-cancel")).to_have_count(0)  # an ended workflow has nothing to cancel
    snap("successful")
    page.click('li.workflow-member[data-path="0.1"] a')
    expect(page.locator("#task-workflow-path")).to_have_text("0.1")
    expect(page.locator("#task-status")).to_have_text("SUCCESSFUL")
