"""Admin of periodic tasks: validation in the form, next run and last fired run (linking to its task page)."""

from __future__ import annotations

from typing import Any, ClassVar

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db import models
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest
from django.utils.html import format_html

from tasks_app.admin_forms import ShownFieldsForm
from tasks_app.models import PeriodicTask
from tasks_app.periodic.code import ENTRY_FIELDS
from tasks_app.periodic.status import ScheduleStatus, schedule_statuses
from tasks_app.protocol.broker import get_broker
from tasks_app.templatetags.tasks_display import url_or_empty

# Fields that rows from code take from TASKS_PERIODIC: read-only in the admin (only `enabled` may change).
CODE_OWNED_FIELDS = ("name", "task_type", *sorted(ENTRY_FIELDS))


class ArgumentsField(forms.JSONField):
    """Django's JSON form field, saying so for text nested too deeply and showing a lone surrogate as its escape."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise ValidationError("JSON nested too deeply.", code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except RecursionError:
            return InvalidJSONInput(data)

    def prepare_value(self, value: Any) -> Any:
        text = super().prepare_value(value)
        return text.encode("utf-8", "backslashreplace").decode() if isinstance(text, str) else text


class PeriodicTaskForm(ShownFieldsForm):
    """A periodic task's form: a list row or a row from code saves what it shows, whatever the rest holds."""

    # The row's own errors are about cron and interval together.
    non_field_errors_with = "cron"


class PeriodicTaskAdmin(admin.ModelAdmin):
    """Periodic tasks; the list shows each one's next run and last fired run, read from Redis once per page."""

    list_display = ("name", "task_type", "schedule", "enabled", "source", "next_run", "last_run")
    list_filter = ("enabled", "source", "catch_up")
    list_editable = ("enabled",)
    search_fields = ("name", "task_type__name", "cron")
    list_select_related = ("task_type",)
    readonly_fields = ("source",)
    form = PeriodicTaskForm
    formfield_overrides: ClassVar[dict[Any, dict[str, Any]]] = {models.JSONField: {"form_class": ArgumentsField}}
    fieldsets = (
        (None, {"fields": ("name", "task_type", "args", "kwargs", "enabled", "source")}),
        ("Schedule", {"fields": ("interval_s", "cron", "timezone", "start_at", "end_at", "catch_up")}),
        ("Routing", {"fields": ("queue", "priority")}),
    )

    def get_readonly_fields(self, request: HttpRequest, obj: PeriodicTask | None = None) -> Any:
        if obj is not None and obj.source == PeriodicTask.Source.CODE:
            return ("source", *CODE_OWNED_FIELDS)
        return self.readonly_fields

    def get_changelist_form(self, request: HttpRequest, **kwargs: Any) -> Any:
        return super().get_changelist_form(request, **{"form": PeriodicTaskForm, **kwargs})

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        """Read the Redis state of the page's rows in one round trip before they are rendered."""
        changelist = super().get_changelist_instance(request)
        rows = list(changelist.result_list)  # evaluates the queryset once: the page renders these objects
        # Kept on each row of this request (this ModelAdmin is shared by every request).
        for row, status in zip(rows, schedule_statuses(get_broker(), rows), strict=True):
            row.periodic_status = status
        return changelist

    @staticmethod
    def _status(obj: PeriodicTask) -> ScheduleStatus | None:
        return getattr(obj, "periodic_status", None)

    @admin.display(description="Schedule")
    def schedule(self, obj: PeriodicTask) -> str:
        status = self._status(obj)
        return status.schedule if status else obj.cron or f"every {obj.interval_s} s"

    @admin.display(description="Next run")
    def next_run(self, obj: PeriodicTask) -> str:
        status = self._status(obj)
        if status is None or (status.error and not status.next_run):
            return f"invalid: {status.error}" if status and status.error else "-"
        return f"{status.next_run:%Y-%m-%d %H:%M:%S} UTC" if status.next_run else "-"

    @admin.display(description="Last fired run")
    def last_run(self, obj: PeriodicTask) -> str:
        status = self._status(obj)
        if status is None or not status.last_task_id or status.last_slot is None:
            return status.state_error if status and status.state_error else "-"
        when = f"{status.last_slot:%Y-%m-%d %H:%M:%S} UTC"
        url = url_or_empty("tasks_app:task", status.last_task_id)  # "": an id no URL can hold
        return format_html('<a href="{}">{}</a>', url, when) if url else when
