"""The task browser `/tasks/`: recent tasks of every queue, filtered and paged from the history index; bulk actions."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol import history
from tasks_app.protocol.broker import get_broker
from tasks_app.protocol.records import ResultRecord
from tasks_app.web import bulk
from tasks_app.web.browser_query import PAGE_SIZES, RANGES, Filters, find_page, page_json, query_without, row_json
from tasks_app.web.common import admin_context, redis_required

REFRESH_S = 5


@staff_member_required
@redis_required
@require_http_methods(["GET", "POST"])
def task_browser(request: HttpRequest) -> HttpResponse:
    """List recent tasks newest first (`?format=json` as JSON); POST runs a bulk action on the selected ones."""
    if request.method == "POST":
        _run_action(request)
        return redirect(request.get_full_path())
    filters = Filters.from_query(request.GET)
    broker = get_broker()
    queues = broker.inspect.known_queues()
    page = find_page(broker, filters, queues)
    if request.GET.get("format") == "json":
        return JsonResponse(page_json(page))
    base_query = query_without(request.GET, "before", "seen", "after", "format")
    return render(
        request,
        "tasks_app/browser.html",
        admin_context(
            request,
            "Tasks",
            filters=filters,
            page=page,
            rows=[{**row_json(record, score), "record": record} for record, score in page.records],
            history_max=broker.enqueuer.history_max,
            older_cursor=repr(page.older) if page.older is not None else "",
            statuses=history.STATUSES,
            queues=queues,
            types=TaskType.objects.values_list("name", flat=True),
            ranges=list(RANGES),
            page_sizes=PAGE_SIZES,
            base_query=base_query,
            page_query=query_without(request.GET, "format"),
            actions=bulk.allowed_actions(request),
            refresh_s=REFRESH_S,
        ),
    )


def _run_action(request: HttpRequest) -> None:
    """Run the posted action on the posted task ids, if this user may; tell what happened."""
    action = bulk.ACTIONS.get(request.POST.get("action", ""))
    if action is None:
        messages.error(request, "Unknown action.")
        return
    if not request.user.has_perm(action.permission):
        raise PermissionDenied(f"permission {action.permission} is required")
    ids = list(dict.fromkeys(request.POST.getlist("task")))[: bulk.MAX_SELECTED]
    records = [ResultRecord.from_fields(fields) for fields in get_broker().records.get_results(ids) if fields]
    if not records:
        messages.warning(request, "Select at least one task (that still has a record).")
        return
    shown = {r.id: request.POST.get(f"retried_as:{r.id}", "") for r in records}  # each row's, as the page showed it
    try:
        outcome = action.run(bulk.Selection(records, f"user:{request.user.get_username()}", shown))
    except (producer.EnqueueError, producer.QueueUnavailable) as exc:
        messages.error(request, f"{action.label}: {exc}")
        return
    bulk.log(request, outcome.logged)
    gone = len(ids) - len(records)  # deleted or expired since the page was shown
    messages.success(
        request, outcome.message + (f" {gone} selected task(s) no longer had a record, left." if gone else "")
    )
