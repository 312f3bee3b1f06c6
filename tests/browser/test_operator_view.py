"""A staff user in headless Chromium: the task browser's filters and search, the dashboard's charts, a bulk retry."""

from __future__ import annotations

import json
import time

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol import records
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.records import ResultUpdate
from tests.browser.test_web_flow import log_in
from tests.support.enqueued import file_ready, waiting_records
from tests.support.processes import wait_until

# One worker runs the browser tests one after another: two Chromiums at once only slow each other.
pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("browser"), pytest.mark.django_db(transaction=True)]


def _finished(broker, task_id: str, status: str, error: str = "") -> None:
    """Record a task as finished (its task waits delayed, so nothing runs it)."""
    entry = records.error_record("demo.Boom", f"Traceback\nRuntimeError: {error}") if error else None
    now_ms = time.time() * 1000
    fields = {
        "status": status,
        "enqueued_at_ms": str(int(now_ms) - 4000),
        "started_at_ms": f"{now_ms - 1834.5:.3f}",
        "finished_at_ms": f"{now_ms:.3f}",
    }
    broker.records.record_result(ResultUpdate(task_id, fields, 600, append_error=entry, queue="ops"))


def _held_back(type_name: str, count: int = 1, **kwargs) -> list[str]:
    """Enqueue tasks due in an hour with READY records in the history (as old producers did): what the browser shows."""
    ids = [t.id for t in producer.enqueue(type_name, queue="ops", count=count, delay_s=3600, **kwargs)]
    file_ready(get_broker(), ids, "ops", ttl_s=600)
    return ids


def test_the_failed_filter_and_an_id_prefix_search(page, snap, live_server, broker):
    from playwright.sync_api import expect

    TaskType.objects.create(name="ops.echo", handler="demo.echo", queue="ops")
    ok = _held_back("ops.echo", 3, args=["fine"])
    bad = _held_back("ops.echo", 2, args=["broken"])
    for task_id in ok:
        _finished(broker, task_id, "SUCCESSFUL")
    for task_id in bad:
        _finished(broker, task_id, "FAILED", error="card declined <b>bold</b>")
    waiting = _held_back("ops.echo")
    log_in(page, live_server.url)
    page.click("#task-queue-links >> text=Tasks")
    expect(page.locator("tr.task-row")).to_have_count(6)
    snap("browser")

    page.select_option("#f-status", "FAILED")
    page.click("#task-filters input[type=submit]")
    expect(page.locator("tr.task-row")).to_have_count(2)
    listed = page.locator("tr.task-row").evaluate_all("rows => rows.map(r => r.dataset.task)")
    assert sorted(listed) == sorted(bad)
    expect(page.locator("tr.task-row").first).to_contain_text("RuntimeError: card declined <b>bold</b>")
    assert "status=FAILED" in page.url
    snap("browser-failed")

    page.goto(f"{live_server.url}/tasks/")
    page.fill("#f-q", waiting[0][:7])
    page.click("#task-filters input[type=submit]")
    expect(page.locator("tr.task-row")).to_have_count(1)
    expect(page.locator("tr.task-row")).to_have_attribute("data-task", waiting[0])
    page.click("tr.task-row a.task-link")
    expect(page.locator("#task-status")).to_have_text("READY")


def test_the_dashboard_draws_its_charts(page, snap, live_server, broker, consumer_in_thread):
    from playwright.sync_api import expect

    TaskType.objects.create(name="ops.echo", handler="demo.echo", queue="ops")
    TaskType.objects.create(name="ops.fail", handler="demo.fail", queue="ops", max_attempts=1)
    with consumer_in_thread(queues=["ops"], concurrency=2):
        producer.enqueue("ops.echo", count=12)
        producer.enqueue("ops.fail", count=2)
        wait_until(
            lambda: broker.records.history_count(["ops"], "SUCCESSFUL", None) == 12, 20, message="the echoes to run"
        )
        wait_until(
            lambda: broker.records.history_count(["ops"], "FAILED", None) == 2, 20, message="the failures to fail"
        )
        broker.inspect.sample_backlog("ops")
        log_in(page, live_server.url)
        page.goto(f"{live_server.url}/tasks/dashboard/")
        charts = page.locator("#charts-queues svg.tasks-chart")
        expect(charts).to_have_count(2)
        expect(page.locator("#charts-types svg.tasks-chart")).to_have_count(4)
        assert page.locator("#charts-queues polyline").count() >= 3
        box = charts.first.bounding_box()
        assert box and box["width"] > 200 and box["height"] > 80
        expect(page.locator("#charts-types tr.type-row", has_text="ops.echo")).to_contain_text("12")
        snap("dashboard")


def test_a_bulk_retry_reaches_successful_on_a_real_consumer(page, snap, live_server, broker, consumer_process):
    from playwright.sync_api import expect

    TaskType.objects.create(name="ops.echo", handler="demo.echo", queue="ops")
    [original] = _held_back("ops.echo", args=["again"])
    _finished(broker, original, "FAILED", error="flaky upstream")
    consumer = consumer_process("--queue", "ops", "--lease", "2", TASK_HANDLER_MODULES="examples.handlers")
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?status=SUCCESSFUL")
    expect(page.locator("tr.task-row")).to_have_count(0)
    page.goto(f"{live_server.url}/tasks/?status=FAILED")
    page.check(f'input[name=task][value="{original}"]')
    page.select_option("#bulk-action", "retry")
    page.click("#bulk-go")
    expect(page.locator("ul.messagelist")).to_contain_text("Enqueued 1 retry task(s).")

    page.goto(f"{live_server.url}/tasks/?status=SUCCESSFUL")
    # No reload from here on: the page updates itself when the retry has run.
    expect(page.locator("tr.task-row")).to_have_count(1, timeout=30_000)
    retry_id = page.locator("tr.task-row").get_attribute("data-task")
    assert retry_id != original
    record = records.ResultRecord.from_fields(broker.records.get_result(retry_id))
    assert (record.status, record.args, record.retry_of) == ("SUCCESSFUL", ["again"], original)
    page.click("tr.task-row a.task-link")
    expect(page.locator("#task-status")).to_have_text("SUCCESSFUL")
    expect(page.locator("tr.task-origin")).to_contain_text(original)
    snap("retried-task")
    assert consumer.process.poll() is None


# Draw an inline SVG on a canvas and count its pixels of one colour (within a small tolerance).
COUNT_PIXELS_JS = """async ([svg, rgb]) => {
  const image = new Image();
  image.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(new XMLSerializer().serializeToString(svg));
  await image.decode();
  const canvas = document.createElement("canvas");
  canvas.width = svg.width.baseVal.value;
  canvas.height = svg.height.baseVal.value;
  const context = canvas.getContext("2d");
  context.drawImage(image, 0, 0);
  const data = context.getImageData(0, 0, canvas.width, canvas.height).data;
  let count = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (data[i + 3] > 128 && [0, 1, 2].every(c => Math.abs(data[i + c] - rgb[c]) < 40)) count++;
  }
  return count;
}"""


def test_a_chart_with_one_minute_of_data_shows_it(page, live_server, broker):
    from playwright.sync_api import expect

    _held_back("demo.echo", 3)
    broker.inspect.sample_backlog("ops")  # the backlog of this minute only: one point, no line to draw
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/dashboard/")
    backlog = page.locator('.queue-charts[data-queue="ops"] svg.tasks-chart').nth(1)
    expect(backlog.locator("title")).to_have_text("ops: backlog")
    backlog_blue = [0x15, 0x65, 0xC0]
    assert backlog.evaluate(f"svg => ({COUNT_PIXELS_JS})([svg, {backlog_blue}])") > 0


def test_an_id_prefix_search_says_when_more_ids_match_and_keeps_the_time_range(page, live_server, broker):
    from playwright.sync_api import expect

    ids = [f"batch-{n:03d}" for n in range(30)]
    producer.enqueue_many([producer.TaskRequest("demo.echo", queue="ops", delay_s=3600, task_id=i) for i in ids])
    file_ready(broker, ids, "ops")
    two_hours_ago_ms = (time.time() - 7200) * 1000
    broker.client.zadd(broker.keys.history("ops"), {ids[1]: two_hours_ago_ms}, xx=True)
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?size=25&q=batch-")
    expect(page.locator("tr.task-row")).to_have_count(25)
    expect(page.locator("#search-cut")).to_contain_text("more may match, type more of the id")
    expect(page.locator("p.paginator")).not_to_contain_text("end of the history")

    page.goto(f"{live_server.url}/tasks/?size=25&q=batch-00&range=1h")
    listed = page.locator("tr.task-row").evaluate_all("rows => rows.map(r => r.dataset.task)")
    assert sorted(listed) == [i for i in ids[:10] if i != ids[1]]
    expect(page.locator("p.paginator")).to_contain_text("end of the history")


def test_the_json_link_of_an_older_page_gives_that_page(page, live_server, broker):
    ids = _held_back("demo.echo", 30)[::-1]
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?size=25")
    page.click("#page-older")
    page.wait_for_url("**before=**")
    page.click("#page-json")
    shown = json.loads(page.locator("body").inner_text())
    assert [row["id"] for row in shown["tasks"]] == ids[25:]


def test_a_retrys_page_does_not_link_an_original_whose_record_was_deleted(page, live_server, broker):
    from playwright.sync_api import expect

    [original] = _held_back("demo.echo")
    _finished(broker, original, "FAILED", error="flaky upstream")
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?status=FAILED")
    for action, said in (("retry", "Enqueued 1 retry task(s)."), ("delete", "Deleted 1 record(s).")):
        page.check(f'input[name=task][value="{original}"]')
        page.select_option("#bulk-action", action)
        page.click("#bulk-go")
        expect(page.locator("ul.messagelist")).to_contain_text(said)
    page.goto(f"{live_server.url}/tasks/?status=READY")
    page.click("tr.task-row a.task-link")
    origin = page.locator("tr.task-origin", has_text="Retry of")
    expect(origin).to_contain_text(original)
    expect(origin).to_contain_text("its record has expired or was deleted")
    expect(origin.locator("a")).to_have_count(0)


def test_a_bulk_action_says_how_many_selected_tasks_were_gone_meanwhile(page, live_server, broker):
    from playwright.sync_api import expect

    first, second = _held_back("demo.echo", 2)
    for task_id in (first, second):
        _finished(broker, task_id, "FAILED", error="flaky upstream")
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?status=FAILED")
    page.check("#tasks-select-all")
    broker.records.delete_finished([("ops", second)])  # from another tab, while this one shows it selected
    page.select_option("#bulk-action", "retry")
    page.click("#bulk-go")
    expect(page.locator("ul.messagelist")).to_have_text(
        "Enqueued 1 retry task(s). 1 selected task(s) no longer had a record, left."
    )


def _copies_of(broker, original: str) -> list[str]:
    """The ids of the tasks waiting in queue ops that retry `original`, oldest first (pending is pushed at its head)."""
    waiting = reversed(waiting_records(broker, "ops").items())
    return [task_id for task_id, fields in waiting if fields.get("retry_of") == original]


def test_the_retry_form_sent_twice_enqueues_one_copy_and_a_retry_of_it_another(page, snap, live_server, broker):
    from playwright.sync_api import expect

    [original] = _held_back("demo.echo")
    _finished(broker, original, "FAILED", error="flaky upstream")
    log_in(page, live_server.url)
    page.goto(f"{live_server.url}/tasks/?status=FAILED")
    page.check(f'input[name=task][value="{original}"]')
    page.select_option("#bulk-action", "retry")
    sent = page.eval_on_selector("#changelist-form", "form => new URLSearchParams(new FormData(form)).toString()")
    page.click("#bulk-go")
    expect(page.locator("ul.messagelist")).to_have_text("Enqueued 1 retry task(s).")
    [copy] = _copies_of(broker, original)
    # The same form once more, as a re-submit or a second click would send it (its answer shows on the next page).
    page.evaluate(
        """async ([url, body]) => await fetch(url, {method: "POST", body, redirect: "manual",
            headers: {"Content-Type": "application/x-www-form-urlencoded"}})""",
        [page.url, sent],
    )
    page.reload()
    expect(page.locator("ul.messagelist")).to_have_text(
        f"Enqueued 0 retry task(s). 1 already retried as {copy} (a repeated request), not enqueued again."
    )
    assert _copies_of(broker, original) == [copy]
    row = page.locator(f'tr.task-row[data-task="{original}"]')
    expect(row.locator(".tasks-retried-as code")).to_have_attribute("title", copy)
    snap("retried-once")

    row.locator("input[name=task]").check()  # a new decision, from the page showing the first copy
    page.select_option("#bulk-action", "retry")
    page.click("#bulk-go")
    expect(page.locator("ul.messagelist")).to_have_text("Enqueued 1 retry task(s).")
    [first, second] = _copies_of(broker, original)
    assert first == copy != second and broker.records.get_result(original)["retried_as"] == second
    expect(row.locator(".tasks-retried-as code")).to_have_attribute("title", second)
