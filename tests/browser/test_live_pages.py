"""A staff user in headless Chromium on the pages that update themselves (live.js): what a refresh keeps and tells."""

from __future__ import annotations

import pytest

from tasks_app import producer
from tasks_app.protocol.broker import get_broker
from tests.browser.test_web_flow import log_in
from tests.support.enqueued import file_ready

# One worker runs the browser tests one after another: two Chromiums at once only slow each other.
pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser"), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def fast_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The task browser refreshes every second (the live server runs in this process)."""
    monkeypatch.setattr("tasks_app.web.browser.REFRESH_S", 1)


def _held_back(count: int) -> list[str]:
    """Enqueue tasks due in an hour with READY records in the history (as old producers did): what the browser lists."""
    ids = [t.id for t in producer.enqueue("demo.echo", queue="ops", count=count, delay_s=3600)]
    file_ready(get_broker(), ids, "ops")
    return ids


def _next_refresh(page) -> None:
    """Wait until the page has swapped in its next refresh."""
    page.evaluate("() => new Promise(done => document.addEventListener('tasks:refreshed', done, {once: true}))")


def test_select_all_still_selects_every_row_after_a_refresh(page, live_server, broker, fast_refresh):
    from playwright.sync_api import expect

    _held_back(3)
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/")
    expect(page.locator("tr.task-row")).to_have_count(3)
    _next_refresh(page)
    page.check("#tasks-select-all")
    expect(page.locator("input[name=task]:checked")).to_have_count(3)
    page.uncheck("#tasks-select-all")
    expect(page.locator("input[name=task]:checked")).to_have_count(0)


def test_a_selection_holds_the_rows_until_the_bulk_action_even_when_newer_tasks_arrive(
    page, live_server, broker, fast_refresh
):
    from playwright.sync_api import expect

    [chosen] = _held_back(1)
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?size=25")
    page.check(f'input[name=task][value="{chosen}"]')
    page.select_option("#bulk-action", "cancel")  # the focus leaves the rows
    _held_back(25)  # a refresh would now show 25 newer rows, and the chosen one on the next page
    expect(page.locator("#tasks-live-note")).to_contain_text("held while tasks are selected")
    expect(page.locator(f'input[name=task][value="{chosen}"]')).to_be_checked()
    page.click("#bulk-go")
    expect(page.locator("ul.messagelist")).to_contain_text("Cancelled 1 task(s)")
    assert broker.records.get_result(chosen)["status"] == "CANCELLED"
    expect(page.locator("#tasks-live-note")).to_have_text("")
    expect(page.locator("tr.task-row")).to_have_count(25)


def test_a_refresh_that_fails_leaves_the_stamp_and_says_why(page, live_server, broker, fast_refresh, settings):
    from playwright.sync_api import expect

    _held_back(1)
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/")
    _next_refresh(page)
    redis_url, settings.REDIS_URL = settings.REDIS_URL, "redis://127.0.0.1:1/0"  # nothing listens there
    expect(page.locator("#tasks-live-note")).to_contain_text("not updated since: the server answered 503")
    # A refresh already under way when Redis went away may have set the stamp: read it once one has failed.
    stamp = page.locator("#tasks-live-stamp").text_content()
    page.evaluate("() => { document.getElementById('tasks-live-note').textContent = ''; }")
    expect(page.locator("#tasks-live-note")).to_contain_text("not updated since: the server answered 503")
    expect(page.locator("#tasks-live-stamp")).to_have_text(stamp)
    expect(page.locator("tr.task-row")).to_have_count(1)  # the rows last seen stay
    settings.REDIS_URL = redis_url
    expect(page.locator("#tasks-live-note")).to_have_text("")
    page.context.clear_cookies()  # the session ends: a refresh would be sent to the login page
    expect(page.locator("#tasks-live-note")).to_contain_text("signed out: reload the page to sign in again")
    expect(page.locator("tr.task-row")).to_have_count(1)
