"""Staff pages of workflows: a workflow's page (its tree, live), its cancel button, and a task page's workflow part."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import permission_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from tasks_app import workflows
from tasks_app.models import CANCEL_PERMISSION
from tasks_app.protocol.records import ResultRecord, datetime_of_ms
from tasks_app.web.common import admin_context, redis_required

REFRESH_S = 2
# Children of one chain or group a page shows (a group may hold 10,000; the page reloads every REFRESH_S).
SHOWN_CHILDREN = 200
# Other tasks of its group or chain, and callbacks, a task page shows.
SHOWN_NEIGHBOURS = 50
# The order of the counts on the page; a status not listed follows in name order.
STATUS_ORDER = ("WAITING", "READY", "RUNNING", "SUCCESSFUL", "FAILED", "CANCELLED")


@staff_member_required
@redis_required
def workflow_detail(request: HttpRequest, workflow_id: str) -> HttpResponse:
    """Show a workflow's status, counts and tree, each task linked to its page; it updates itself while it runs."""
    try:
        state = workflows.get_workflow(workflow_id)
    except workflows.WorkflowError as exc:
        raise Http404(str(exc)) from None
    ended = state.status != workflows.RUNNING
    return render(
        request,
        "tasks_app/workflow.html",
        admin_context(
            request,
            f"Workflow {state.id}",
            state=state,
            tree=shown_tree(state.tree),
            started_at=datetime_of_ms(state.created_at_ms),
            ended_at=None if state.ended_at_ms is None else datetime_of_ms(state.ended_at_ms),
            failed=next((m for m in state.members if m.task_id == state.failed_task_id), None),
            counts=sorted(state.counts.items(), key=_status_rank),
            refresh_s=None if ended else REFRESH_S,
            can_cancel=state.status in (workflows.RUNNING, workflows.FAILED)
            and request.user.has_perm(CANCEL_PERMISSION),
        ),
    )


@staff_member_required
@redis_required
@permission_required(CANCEL_PERMISSION, raise_exception=True)
@require_http_methods(["POST"])
def cancel_workflow(request: HttpRequest, workflow_id: str) -> HttpResponse:
    """Cancel the workflow (its page's button) and go back to its page, saying what happened."""
    try:
        cancelled = workflows.cancel_workflow(workflow_id, cancelled_by=f"user:{request.user.get_username()}")
    except workflows.WorkflowError as exc:
        raise Http404(str(exc)) from None
    if cancelled.cancelled:
        stopped = len(cancelled.task_ids)
        messages.success(request, f"Workflow {workflow_id} cancelled: nothing more starts; {stopped} task(s) stopped.")
    else:
        messages.error(request, f"Workflow {workflow_id} had ended already ({cancelled.status}).")
    return redirect("tasks_app:workflow", workflow_id=workflow_id)


def _status_rank(item: tuple[str, int]) -> tuple[int, str]:
    status = item[0]
    return (STATUS_ORDER.index(status) if status in STATUS_ORDER else len(STATUS_ORDER), status)


def shown_tree(node: dict[str, Any]) -> dict[str, Any]:
    """The tree as the page shows it: at most SHOWN_CHILDREN children of a node, with the count of the rest."""
    if node["kind"] == "task":
        return node
    children = node["children"]
    return {
        **node,
        "children": [shown_tree(child) for child in children[:SHOWN_CHILDREN]],
        "more": max(0, len(children) - SHOWN_CHILDREN),
    }


def place_of(record: ResultRecord) -> dict[str, Any] | None:
    """Where a task stands in its workflow (None for a task of none): its path, its neighbours, the callbacks."""
    if not record.workflow:
        return None
    place: dict[str, Any] = {"workflow_id": record.workflow, "path": record.workflow_path}
    try:
        state = workflows.get_workflow(record.workflow)
    except workflows.WorkflowError:
        return place  # the workflow has expired
    parent = record.workflow_path.rpartition(".")[0]
    spec = _node_at(state.tree, parent) if parent else None
    # The others of its group or chain, and the callbacks, but this task.
    neighbours = [m for m in state.members if m.path.rpartition(".")[0] == parent and m.path != record.workflow_path]
    callbacks = [m for m in state.members if m.callback and m.path != record.workflow_path]
    return {
        **place,
        "state": state,
        "parent_kind": spec["kind"] if spec else "",  # "group" or "chain"
        "neighbours": neighbours[:SHOWN_NEIGHBOURS],
        "more_neighbours": max(0, len(neighbours) - SHOWN_NEIGHBOURS),
        "callbacks": callbacks[:SHOWN_NEIGHBOURS],
        "more_callbacks": max(0, len(callbacks) - SHOWN_NEIGHBOURS),
    }


def _node_at(tree: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The node of `tree` at `path` (None if it names none: a producer's record may hold any path)."""
    node = tree
    for position in path.split(".")[1:]:
        children = node.get("children", [])
        if not position.isdigit() or int(position) >= len(children):
            return None
        node = children[int(position)]
    return node
