"""The TaskType admin: handlers are chosen from the registry, never typed in."""

import pytest

from tasks_app.admin import TaskTypeForm
from tasks_app.models import TaskType

pytestmark = pytest.mark.django_db


def form_data(**overrides):
    data = {
        "name": "billing.invoice",
        "handler": "demo.echo",
        "queue": "default",
        "enabled": "on",
        "rate_period": "1",
        "rate_burst": "1",
        "rate_algorithm": "gcra",
        "max_attempts": "3",
        "retry_backoff": "2",
        "keep_results": "always",
    }
    data.update(overrides)
    return data


def test_handler_choices_are_the_registered_handlers():
    choices = [value for value, _ in TaskTypeForm().fields["handler"].choices]
    assert {"demo.echo", "demo.sleep", "demo.fail", "demo.flaky"} <= set(choices)


def test_an_unregistered_handler_is_rejected():
    form = TaskTypeForm(data=form_data(handler="os.system"))
    assert not form.is_valid()
    assert "handler" in form.errors


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "bad name"), ("queue", "q/1"), ("max_attempts", "0"), ("rate_limit", "0"), ("timeout", "-1")],
)
def test_invalid_settings_are_rejected(field, value):
    assert field in TaskTypeForm(data=form_data(**{field: value})).errors


def test_burst_cannot_exceed_the_limit():
    form = TaskTypeForm(data=form_data(rate_limit="2", rate_burst="5"))
    assert not form.is_valid()
    assert "rate_burst" in form.errors


def test_unique_until_finished_needs_a_window():
    form = TaskTypeForm(data=form_data(unique_until="finished"))
    assert not form.is_valid()
    assert "needs a window" in form.errors["unique_until"][0]
    assert TaskTypeForm(data=form_data(unique_until="finished", unique_for_s="60")).is_valid()


def test_a_row_whose_handler_left_the_code_stays_editable():
    row = TaskType.objects.create(name="legacy", handler="removed.handler")
    form = TaskTypeForm(instance=row)
    assert ("removed.handler", "removed.handler") in form.fields["handler"].choices


def test_admin_add_page_renders_for_staff(admin_client):
    response = admin_client.get("/admin/tasks_app/tasktype/add/")
    assert response.status_code == 200
    assert b"demo.flaky" in response.content


def test_a_saved_types_name_is_read_only_and_a_post_cannot_rename_it(admin_client):
    row = TaskType.objects.create(name="billing.invoice", handler="demo.echo")
    url = f"/admin/tasks_app/tasktype/{row.pk}/change/"
    page = admin_client.get(url).content.decode()
    assert 'name="name"' not in page and "billing.invoice" in page
    assert "It cannot be changed once saved" in page and "add a new one" in page
    response = admin_client.post(url, form_data(name="billing.renamed", queue="billing", unique_until="window"))
    assert response.status_code == 302
    row.refresh_from_db()
    assert (row.name, row.queue) == ("billing.invoice", "billing")  # the rest of the form still saves


def test_a_new_type_is_named_on_the_add_page(admin_client):
    page = admin_client.get("/admin/tasks_app/tasktype/add/").content.decode()
    assert 'name="name"' in page and "It cannot be changed once saved" in page
    added = admin_client.post("/admin/tasks_app/tasktype/add/", form_data(name="billing.new", unique_until="window"))
    assert added.status_code == 302
    assert TaskType.objects.filter(name="billing.new").exists()


def test_the_list_saves_enabled_beside_a_row_saved_past_the_admin_breaking_a_rule(admin_client):
    # Saved from code, or before the rule existed: a burst over its limit.
    bad = TaskType.objects.create(name="bad.row", handler="demo.echo", rate_limit=1, rate_burst=5)
    other = TaskType.objects.create(name="other.row", handler="demo.echo")
    rows = {"form-TOTAL_FORMS": "2", "form-INITIAL_FORMS": "2", "form-0-id": str(bad.pk), "form-1-id": str(other.pk)}
    # Before: a ValueError (the list's form has no field rate_burst), a server error on every save of the page.
    response = admin_client.post("/admin/tasks_app/tasktype/", {**rows, "form-1-enabled": "on", "_save": "Save"})
    assert response.status_code == 302
    bad.refresh_from_db()
    other.refresh_from_db()
    assert (bad.enabled, other.enabled) == (False, True)
