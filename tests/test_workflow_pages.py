"""The workflow page, its cancel button, a task page's workflow part and the browser's workflow filter."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client

import tests.support.workflow_handlers  # noqa: F401  (registers the workflow handlers in this process)
from tasks_app import workflows
from tasks_app.producer import TaskRequest
from tasks_app.workflows import chain, chord
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _chord(members: int = 3, **kwargs):
    return chord([TaskRequest("wf.value", args=[n]) for n in range(members)], then=TaskRequest("wf.collect"), **kwargs)


def _page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


def test_the_page_shows_the_tree_with_statuses_counts_and_links(staff, broker):
    handle = _chord().enqueue()
    html = _page(staff, f"/tasks/workflows/{handle.id}/")
    assert 'id="workflow-status">RUNNING<' in html
    assert re.findall(r'data-status="(\w+)"><span[^>]*>\w+</span> (\d+)', html) == [("WAITING", "1"), ("READY", "3")]
    for path, task_id in handle.task_ids.items():
        assert f'data-path="{path}"' in html
        assert f'href="/tasks/{task_id}/"' in html
    assert 'data-path="0.0"' in html and "workflow-group" in html
    assert 'id="workflow-cancel"' in html  # the superuser may cancel
    assert "tasks_app/live.js" in html and "data-live-done" not in html


def test_a_failed_workflow_names_the_task_that_stopped_it(staff, broker, consumer_in_thread):
    flow = chain(
        TaskRequest("wf.value", args=[1]), TaskRequest("wf.fails_until_fixed", args=[2]), TaskRequest("wf.value")
    )
    with consumer_in_thread():
        handle = flow.enqueue()
        wait_until(lambda: workflows.get_workflow(handle.id).status == workflows.FAILED, 30, message="the failure")
    html = _page(staff, f"/tasks/workflows/{handle.id}/")
    failed = handle.task_ids["0.1"]
    assert re.search(rf'id="workflow-failed"><a href="/tasks/{failed}/">', html)
    assert "wf.fails_until_fixed at <code>0.1</code>" in html
    assert "not fixed yet" in html
    assert "data-live-done" in html  # it ended: the page stops updating


def test_what_a_handler_or_producer_wrote_is_escaped(staff, broker):
    handle = _chord().enqueue()
    reason = "<script>window.pwned = 1</script>"
    broker.workflows.stop(handle.id, workflows.FAILED, reason, 60, "0.1")
    html = _page(staff, f"/tasks/workflows/{handle.id}/")
    assert reason not in html and "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in html
    assert 'id="workflow-status">FAILED<' in html


def test_the_cancel_button_cancels_and_needs_its_permission_and_csrf(broker):
    handle = _chord().enqueue()
    user = get_user_model().objects.create_user("looker", password="x", is_staff=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    html = _page(client, f"/tasks/workflows/{handle.id}/")
    assert 'id="workflow-cancel"' not in html
    assert client.post(f"/tasks/workflows/{handle.id}/cancel/").status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="cancel_task"))
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert 'id="workflow-cancel"' in _page(client, f"/tasks/workflows/{handle.id}/")
    assert client.post(f"/tasks/workflows/{handle.id}/cancel/").status_code == 403  # no CSRF token
    assert workflows.get_workflow(handle.id).status == workflows.RUNNING
    token = client.get(f"/tasks/workflows/{handle.id}/").cookies["csrftoken"].value
    response = client.post(f"/tasks/workflows/{handle.id}/cancel/", {"csrfmiddlewaretoken": token}, follow=True)
    assert "cancelled: nothing more starts; 3 task(s) stopped" in response.content.decode()
    assert workflows.get_workflow(handle.id).status == workflows.CANCELLED
    again = client.post(f"/tasks/workflows/{handle.id}/cancel/", {"csrfmiddlewaretoken": token}, follow=True)
    assert "had ended already (CANCELLED)" in again.content.decode()


def test_the_pages_are_for_staff_only_and_an_unknown_workflow_is_404(client, staff, broker):
    handle = _chord().enqueue()
    assert Client().get(f"/tasks/workflows/{handle.id}/").status_code == 302
    plain = Client()
    plain.force_login(get_user_model().objects.create_user("plain", password="x"))
    assert plain.get(f"/tasks/workflows/{handle.id}/").status_code == 302
    assert plain.post(f"/tasks/workflows/{handle.id}/cancel/").status_code == 302
    assert staff.get("/tasks/workflows/no-such-workflow/").status_code == 404
    assert staff.get("/tasks/workflows/bad%20id/").status_code == 404
    assert staff.post("/tasks/workflows/no-such-workflow/cancel/").status_code == 404


def test_a_big_group_shows_its_first_members_and_counts_the_rest(staff, broker, monkeypatch):
    from tasks_app.web import workflows as pages

    monkeypatch.setattr(pages, "SHOWN_CHILDREN", 5)
    handle = _chord(12).enqueue()
    html = _page(staff, f"/tasks/workflows/{handle.id}/")
    assert len(re.findall(r'data-path="0\.0\.\d+"', html)) == 5
    assert "… and 7 more" in html
    assert 'data-path="0.1"' in html  # the callback


def test_the_task_page_shows_its_place_its_neighbours_and_the_callback(staff, broker):
    handle = _chord().enqueue()
    html = _page(staff, f"/tasks/{handle.task_ids['0.0.1']}/")
    assert f'id="task-workflow-link"><code>{handle.id}</code>' in html
    assert 'id="task-workflow-path">0.0.1<' in html and "in a group" in html
    neighbours = re.search(r'id="task-workflow-neighbours">(.*?)</ul>', html, re.S).group(1)
    assert re.findall(r'data-path="([\d.]+)"', neighbours) == ["0.0.0", "0.0.2"]
    assert f'href="/tasks/{handle.task_ids["0.0.0"]}/"' in neighbours
    callbacks = re.search(r'id="task-workflow-callbacks">(.*?)</ul>', html, re.S).group(1)
    assert re.findall(r'data-path="([\d.]+)"', callbacks) == ["0.1"]
    assert "WAITING" in callbacks


def test_a_task_page_outside_any_workflow_has_no_workflow_part(staff, broker):
    from tasks_app import producer

    [task] = producer.enqueue("demo.echo")
    assert 'id="task-workflow"' not in _page(staff, f"/tasks/{task.id}/")


def test_a_task_of_an_expired_workflow_names_it_unlinked(staff, broker):
    handle = _chord().enqueue()
    broker.client.delete(*broker.keys.workflow(handle.id))
    html = _page(staff, f"/tasks/{handle.task_ids['0.0.0']}/")
    assert "its record has expired" in html and 'id="task-workflow-link"' not in html


def test_the_browser_lists_a_workflows_tasks_in_tree_order(staff, broker):
    handle = _chord(4).enqueue()
    _chord(2).enqueue()  # another workflow's tasks are not listed
    listed = re.findall(r'class="task-row" data-task="([^"]+)"', _page(staff, f"/tasks/?workflow={handle.id}"))
    # The callback is not pushed yet: it has no record.
    assert listed == [handle.task_ids[f"0.0.{n}"] for n in range(4)]
    assert _page(staff, f"/tasks/?workflow={handle.id}&status=RUNNING").count('class="task-row"') == 0
    first = re.findall(r'class="task-row" data-task="([^"]+)"', _page(staff, f"/tasks/?workflow={handle.id}&size=25"))
    assert first == listed


def test_the_browser_pages_through_a_workflows_tasks(staff, broker):
    handle = _chord(60).enqueue()
    html = _page(staff, f"/tasks/?workflow={handle.id}&size=25")
    seen = re.findall(r'class="task-row" data-task="([^"]+)"', html)
    while (more := re.search(r'href="\?([^"]+)" id="page-next"', html)) is not None:
        html = _page(staff, "/tasks/?" + more.group(1).replace("&amp;", "&"))
        seen += re.findall(r'class="task-row" data-task="([^"]+)"', html)
    assert seen == [handle.task_ids[f"0.0.{n}"] for n in range(60)]


def test_the_browser_refuses_a_workflow_id_that_cannot_be_one(staff, broker):
    html = _page(staff, "/tasks/?workflow=bad%20id")
    assert "workflow id" in html.lower() and "errornote" in html
