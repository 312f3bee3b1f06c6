"""Periodic tasks in the admin and the `periodic` command: validation with clear errors, next and last runs."""

from datetime import UTC, datetime
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from tasks_app.models import PeriodicTask, TaskType
from tasks_app.periodic.config import PeriodicConfig, load_configs
from tasks_app.periodic.firing import fire_slot
from tasks_app.periodic.status import schedule_statuses
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.periodic import SlotFiring
from tasks_app.protocol.scripts import connect
from tests.support.enqueued import waiting_record
from tests.support.periodic import pushed_runs

pytestmark = pytest.mark.django_db

ADD_URL = "/admin/tasks_app/periodictask/add/"
LIST_URL = "/admin/tasks_app/periodictask/"


@pytest.fixture
def echo():
    return TaskType.objects.create(name="demo.echo", handler="demo.echo", queue="periodic-out")


def form(echo, **overrides):
    data = {
        "name": "reports.nightly",
        "task_type": str(echo.pk),
        "args": "[]",
        "kwargs": "{}",
        "enabled": "on",
        "interval_s": "",
        "cron": "0 3 * * *",
        "timezone": "Europe/Berlin",
        "queue": "",
        "priority": "0",
        "catch_up": "skip",
    }
    return {**data, **overrides}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"cron": "61 3 * * *"}, "Invalid cron expression"),
        ({"cron": "0 3 * *"}, "5 fields"),
        ({"timezone": "Europe/Atlantis"}, "Unknown time zone"),
        ({"timezone": "Europe"}, "Unknown time zone"),
        ({"timezone": "localtime"}, "names each host&#x27;s own setting"),
        ({"interval_s": "60"}, "exactly one of the two"),
        ({"cron": ""}, "exactly one of the two"),
        ({"args": '{"a": 1}'}, "JSON array"),
        ({"args": "[NaN]"}, "no NaN or Infinity"),
        ({"kwargs": '{"x": "\\ud800"}'}, "no lone surrogates"),
        ({"args": '["' + "x" * 1_100_000 + '"]'}, "over the limit of 1048576"),
        ({"kwargs": '{"a": ' + "[" * 64 + "]" * 64 + "}"}, "nested too deeply (at most 64 levels)"),
        ({"args": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),  # past Python's recursion limit
    ],
)
def test_the_admin_refuses_invalid_schedules_with_a_clear_error(staff, broker, echo, overrides, message):
    response = staff.post(ADD_URL, form(echo, **overrides))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not PeriodicTask.objects.exists()


def test_the_admin_list_shows_the_next_run_and_links_the_last_fired_run(staff, broker, echo):
    assert staff.post(ADD_URL, form(echo, cron="", interval_s="60", timezone="UTC")).status_code == 302
    row = PeriodicTask.objects.select_related("task_type").get()
    now_ms = broker.inspect.server_time_ms() // 60_000 * 60_000
    fire_slot(PeriodicConfig.from_model(row), SlotFiring(now_ms, now_ms - 60_000, 60_000, "skip"), broker)
    [run] = pushed_runs(broker, "periodic-out")
    page = staff.get(LIST_URL).content.decode()
    assert f'href="/tasks/{run.task_id}/"' in page
    assert "every 60 s" in page and " UTC" in page
    dashboard = staff.get("/tasks/dashboard/").content.decode()
    assert f'href="/tasks/{run.task_id}/"' in dashboard and "reports.nightly" in dashboard
    # The run's own page and record name the schedule that fired it.
    assert broker.records.get_result(run.task_id)["periodic"] == "reports.nightly"
    task_page = staff.get(f"/tasks/{run.task_id}/").content.decode()
    assert "Periodic schedule" in task_page and f'href="/admin/tasks_app/periodictask/{row.pk}/change/"' in task_page


@pytest.mark.parametrize("task_id", ["a/b", "x" * 5000])
def test_a_state_naming_a_last_run_no_url_can_hold_still_shows_the_list_and_the_dashboard(staff, broker, echo, task_id):
    assert staff.post(ADD_URL, form(echo, cron="", interval_s="60", timezone="UTC")).status_code == 302
    now_ms = broker.inspect.server_time_ms() // 60_000 * 60_000
    state = {"slot_ms": now_ms, "fired_slot_ms": now_ms, "task_id": task_id}  # a foreign writer's
    broker.client.hset(broker.keys.periodic("periodic-out", "reports.nightly"), mapping=state)
    for url in (LIST_URL, "/tasks/dashboard/"):
        response = staff.get(url)
        assert response.status_code == 200, url
        assert "reports.nightly" in response.content.decode()


def test_rows_from_code_are_marked_and_only_their_enabled_flag_is_editable(staff, broker, echo):
    row = PeriodicTask.objects.create(name="code.job", task_type=echo, interval_s=5, source=PeriodicTask.Source.CODE)
    page = staff.get(f"{LIST_URL}{row.pk}/change/").content.decode()
    assert 'name="enabled"' in page and 'name="interval_s"' not in page
    assert "Code (TASKS_PERIODIC)" in staff.get(LIST_URL).content.decode()


def test_rows_saved_past_the_admin_with_errors_can_still_be_paused_from_the_list_and_their_page(staff, broker, echo):
    broken = PeriodicTask.objects.create(name="a.broken", task_type=echo, cron="0 3 * * *", timezone="Nowhere/City")
    fine = PeriodicTask.objects.create(name="b.fine", task_type=echo, interval_s=60)
    rows = {"form-TOTAL_FORMS": "2", "form-INITIAL_FORMS": "2", "form-0-id": broken.pk, "form-1-id": fine.pk}
    assert staff.post(LIST_URL, {**rows, "_save": "Save"}).status_code == 302  # both unticked: paused
    assert not PeriodicTask.objects.filter(enabled=True).exists()

    code = PeriodicTask.objects.create(name="code.broken", task_type=echo, cron="0 3 * *", source="code")
    assert staff.post(f"{LIST_URL}{code.pk}/change/", {"_save": "Save"}).status_code == 302
    code.refresh_from_db()
    assert not code.enabled
    # A form that shows the schedule still refuses it.
    refused = staff.post(f"{LIST_URL}{broken.pk}/change/", form(echo, timezone="Nowhere/City"))
    assert refused.status_code == 200 and "Unknown time zone" in refused.content.decode()


def test_periodic_list_shows_each_schedule_and_flags_an_invalid_one(broker, echo):
    PeriodicTask.objects.create(name="ok.job", task_type=echo, interval_s=30)
    PeriodicTask.objects.create(name="bad.job", task_type=echo, cron="0 3 * * *", timezone="Nowhere/City")
    out = StringIO()
    call_command("periodic", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["name", "schedule", "next", "run", "last", "run", "enabled"]
    assert any(line.startswith("ok.job") and "every 30 s" in line for line in lines)
    assert any(line.startswith("bad.job") and "INVALID: unknown time zone" in line for line in lines)


def test_the_list_shows_a_schedule_parked_at_the_end_of_the_calendar_without_a_next_run(broker, echo):
    PeriodicTask.objects.create(
        name="parked", task_type=echo, cron="0 3 * * *", start_at=datetime(9999, 12, 31, 4, tzinfo=UTC)
    )
    out = StringIO()
    call_command("periodic", "list", stdout=out)
    [line] = [line for line in out.getvalue().splitlines() if line.startswith("parked")]
    assert line.split()[1:6] == ["cron", "0", "3", "*", "*"] and " - " in line


def test_a_row_whose_arguments_are_of_the_wrong_shape_is_flagged_and_never_fired_with_other_arguments(broker, echo):
    # Saved past the admin's validation (a shell, a data migration).
    PeriodicTask.objects.create(name="bad.args", task_type=echo, interval_s=1, args={"days": 7})
    PeriodicTask.objects.create(name="bad.kwargs", task_type=echo, interval_s=1, kwargs="days=7")
    assert load_configs() == []
    out = StringIO()
    call_command("periodic", "list", stdout=out)
    assert "INVALID: Arguments must be a JSON array" in out.getvalue()
    assert "INVALID: Keyword arguments must be a JSON object" in out.getvalue()


def test_periodic_run_enqueues_one_ordinary_task_now(broker, echo):
    PeriodicTask.objects.create(name="ok.job", task_type=echo, interval_s=3600, args=[7])
    out = StringIO()
    call_command("periodic", "run", "ok.job", stdout=out)
    task_id = out.getvalue().strip()
    assert waiting_record(broker, task_id, broker.records.get_result(task_id)["queue"])["args"] == "[7]"
    # outside the schedule
    assert broker.periodic.periodic_states([("periodic-out", "ok.job")])[0].fired_slot_ms is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"cron": "99 * * * *"}, "Invalid cron expression"), ({"cron": "0 3 * * *", "timezone": "Bad/Zone"}, "time zone")],
)
def test_periodic_run_refuses_an_invalid_row_and_enqueues_nothing(broker, echo, fields, message):
    PeriodicTask.objects.create(name="bad.job", task_type=echo, **fields)  # saved past the admin's validation
    with pytest.raises(CommandError, match=message):
        call_command("periodic", "run", "bad.job", stdout=StringIO())
    with pytest.raises(CommandError, match="no periodic task named"):
        call_command("periodic", "run", "no.such.job", stdout=StringIO())
    assert pushed_runs(broker, "periodic-out") == []


@pytest.mark.parametrize("name", ["\udcff", "has space", "x" * 101])
def test_periodic_run_refuses_a_name_no_row_can_have_in_one_line(broker, name):
    # Before: "\udcff" (a non-UTF-8 byte of argv) ended in a UnicodeEncodeError traceback from the query.
    with pytest.raises(CommandError, match="invalid periodic task name"):
        call_command("periodic", "run", name, stdout=StringIO())


def test_periodic_sync_writes_code_schedules_and_refuses_invalid_ones(broker, echo, settings):
    PeriodicTask.objects.create(name="old.code", task_type=echo, interval_s=5, source=PeriodicTask.Source.CODE)
    PeriodicTask.objects.create(name="admin.job", task_type=echo, interval_s=5)
    settings.TASKS_PERIODIC = {"nightly": {"task": "demo.echo", "cron": "0 3 * * *", "timezone": "Europe/Berlin"}}
    out = StringIO()
    call_command("periodic", "sync", stdout=out)
    assert "created: nightly" in out.getvalue() and "removed: old.code" in out.getvalue()
    nightly = PeriodicTask.objects.get(name="nightly")
    assert (nightly.source, nightly.cron, nightly.enabled) == ("code", "0 3 * * *", True)
    assert set(PeriodicTask.objects.values_list("name", flat=True)) == {"nightly", "admin.job"}

    saved_at = nightly.updated_at
    call_command("periodic", "sync", stdout=(again := StringIO()))
    assert "unchanged: nightly" in again.getvalue()
    nightly.refresh_from_db()
    assert nightly.updated_at == saved_at  # not saved again: catch-up still counts from the last real edit

    PeriodicTask.objects.filter(name="nightly").update(enabled=False)  # an operator pauses it
    settings.TASKS_PERIODIC = {
        "nightly": {"task": "demo.echo", "cron": "0 4 * * *"},
        "broken": {"task": "demo.echo", "cron": "0 25 * * *"},
        "epoch.start": {"task": "demo.echo", "interval_s": 60, "start_at": 1767225600},
        "word.start": {"task": "demo.echo", "interval_s": 60, "start_at": "tomorrow", "end_at": "2027-01-01T00:00Z"},
    }
    with pytest.raises(
        CommandError, match=r"broken: cron: Invalid cron expression.*epoch\.start: start_at.*word\.start: start_at"
    ):
        call_command("periodic", "sync", stdout=StringIO())
    nightly.refresh_from_db()
    assert (nightly.cron, nightly.timezone, nightly.enabled) == ("0 4 * * *", "UTC", False)
    assert not PeriodicTask.objects.filter(name="broken").exists()


@pytest.mark.parametrize(
    ("name", "entry", "field"),
    [
        ("nightly", {"queue": "reports\n"}, "queue"),  # a value read from a file, its line end kept
        ("nightly\n", {}, "name"),
    ],
)
def test_periodic_sync_refuses_a_name_or_queue_with_a_trailing_line_end(broker, echo, settings, name, entry, field):
    settings.TASKS_PERIODIC = {name: {"task": "demo.echo", "interval_s": 60, **entry}}
    with pytest.raises(CommandError, match=f"{field}: Use 1-100 characters"):
        call_command("periodic", "sync", stdout=StringIO())
    assert not PeriodicTask.objects.exists()


def test_a_code_schedule_with_dates_without_an_offset_is_stored_once_and_not_saved_again_at_each_sync(
    broker, echo, settings
):
    window = {"start_at": "2026-01-01 03:00", "end_at": "2027-01-01T00:00:00+01:00"}
    settings.TASKS_PERIODIC = {"nightly": {"task": "demo.echo", "interval_s": 60, "catch_up": "once", **window}}
    call_command("periodic", "sync", stdout=StringIO())
    nightly = PeriodicTask.objects.get(name="nightly")
    assert nightly.start_at == datetime(2026, 1, 1, 3, tzinfo=UTC)  # read in TIME_ZONE (UTC)
    call_command("periodic", "sync", stdout=(again := StringIO()))
    assert "unchanged: nightly" in again.getvalue()
    assert PeriodicTask.objects.get(name="nightly").updated_at == nightly.updated_at


def test_a_code_schedule_with_tuples_or_nones_is_stored_and_not_saved_again_at_each_sync(broker, echo, settings):
    settings.TASKS_PERIODIC = {
        "tuples": {"task": "demo.echo", "interval_s": 60, "args": (16, 16), "kwargs": {"sizes": (1, 2)}},
        "nones": {"task": "demo.echo", "cron": "0 3 * * *", "interval_s": None, "queue": None, "timezone": None},
        "queue.none": {"task": "demo.echo", "interval_s": 60, "queue": None},  # was a crash of the whole sync
    }
    call_command("periodic", "sync", stdout=(first := StringIO()))
    assert "created: tuples, nones, queue.none" in first.getvalue()
    tuples, nones = PeriodicTask.objects.get(name="tuples"), PeriodicTask.objects.get(name="nones")
    assert (tuples.args, tuples.kwargs) == ([16, 16], {"sizes": [1, 2]})
    assert (nones.queue, nones.timezone) == ("", "UTC")  # not given: the defaults
    call_command("periodic", "sync", stdout=(again := StringIO()))
    assert "unchanged: tuples, nones, queue.none" in again.getvalue()  # catch-up still counts from the last real edit
    assert PeriodicTask.objects.get(name="tuples").updated_at == tuples.updated_at


def test_the_admin_refuses_a_cron_that_never_matches(staff, broker, echo):
    # Saved, it took down the periodic list, the queue dashboard and `periodic list` (cronsim's StopIteration).
    response = staff.post(ADD_URL, form(echo, cron="0 0 */32 * 1#5"))
    assert response.status_code == 200 and "never matches" in response.content.decode()
    assert not PeriodicTask.objects.exists()


def test_every_schedule_says_redis_unavailable_while_redis_is_away(key_prefix, echo):
    PeriodicTask.objects.create(name="ok.job", task_type=echo, interval_s=30)
    [status] = schedule_statuses(Broker(connect("redis://127.0.0.1:1/0"), key_prefix))
    assert status.state_error == "Redis unavailable" and status.error == "" and status.next_run is not None
