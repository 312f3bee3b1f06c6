"""Admin of task types (the handler a choice among registered handlers), API tokens and periodic tasks."""

from typing import Any, ClassVar, cast

from django import forms
from django.contrib import admin
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import models
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.html import format_html

from tasks_app.models import ApiToken, PeriodicTask, TaskType
from tasks_app.periodic.code import ENTRY_FIELDS
from tasks_app.periodic.status import ScheduleStatus, schedule_statuses
from tasks_app.protocol.broker import get_broker
from tasks_app.registry import registry
from tasks_app.templatetags.tasks_display import url_or_empty
from tasks_app.web.common import admin_context

# Tasks carry their type's name (queued, delayed, dead, in results) and producers enqueue by it:
# a renamed row would leave them all behind, so a name is fixed once saved.
NAME_HELP = (
    "The type name producers enqueue, e.g. billing.send_invoice. It cannot be changed once saved: "
    "tasks waiting under a name would be left without their settings. To rename a type, add a new "
    "one, move producers (and periodic tasks) to it, and delete this one once none of its tasks is left."
)


FIELDSETS: Any = (
    (None, {"fields": ("name", "handler", "queue", "enabled")}),
    (
        "Rate limit",
        {
            "fields": ("rate_limit", "rate_period", "rate_burst", "rate_algorithm", "rate_limit_key"),
            "description": "How many tasks of this type may start per period, across every consumer; "
            "with a key, per value of that keyword argument (per tenant, say).",
        },
    ),
    (
        "Concurrency cap",
        {
            "fields": ("max_running", "max_running_key"),
            "description": "How many tasks of this type may run at the same time, across every consumer; "
            "with a key, per value of that keyword argument. Both throttles may be set: each holds. To stop "
            "a whole queue for a while, pause it on the queue dashboard instead.",
        },
    ),
    ("Retries and timeout", {"fields": ("max_attempts", "retry_backoff", "timeout")}),
    ("Unique tasks", {"fields": ("unique_for_s", "unique_until")}),
    ("Results", {"fields": ("keep_results", "result_ttl")}),
)


class ShownFieldsForm(forms.ModelForm):
    """A model form that leaves out the row's errors on fields it does not show."""

    # The field whose presence makes the row's own errors ("__all__") this form's; None: always.
    non_field_errors_with: str | None = None

    def add_error(self, field: str | None, error: Any) -> None:
        """Add `error`, leaving out the row's errors on fields this form does not show."""
        if field is None and isinstance(error, ValidationError) and hasattr(error, "error_dict"):
            owner = self.non_field_errors_with
            shown = {
                name: errors
                for name, errors in error.error_dict.items()
                if name in self.fields or (name == NON_FIELD_ERRORS and (owner is None or owner in self.fields))
            }
            if not shown:
                return
            error = shown
        super().add_error(field, error)


class TaskTypeForm(forms.ModelForm):
    """TaskType form whose handler field lists the handlers registered in code."""

    handler = forms.ChoiceField(choices=(), help_text=TaskType._meta.get_field("handler").help_text)

    class Meta:
        model = TaskType
        fields = tuple(name for _, options in FIELDSETS for name in options["fields"])
        help_texts: ClassVar = {"name": NAME_HELP}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = registry.names()
        current = self.instance.handler if self.instance and self.instance.pk else None
        if current and current not in names:
            names.append(current)  # keep a row editable after its handler was removed from code
        cast(forms.ChoiceField, self.fields["handler"]).choices = [(name, name) for name in names]


@admin.register(TaskType)
class TaskTypeAdmin(admin.ModelAdmin):
    form = TaskTypeForm
    list_display = (
        "name",
        "handler",
        "queue",
        "enabled",
        "rate_limit",
        "rate_period",
        "max_running",
        "max_attempts",
        "retry_backoff",
        "timeout",
        "updated_at",
    )
    list_filter = ("enabled", "queue", "rate_algorithm")
    list_editable = ("enabled",)
    search_fields = ("name", "handler", "queue")
    fieldsets = FIELDSETS

    def get_changelist_form(self, request: HttpRequest, **kwargs: Any) -> Any:
        """A list row saves `enabled` even when the row breaks a rule on fields the list does not show."""
        return super().get_changelist_form(request, **{"form": ShownFieldsForm, **kwargs})

    def get_readonly_fields(self, request: HttpRequest, obj: TaskType | None = None) -> tuple[str, ...]:
        """The name once the type exists (see NAME_HELP)."""
        return ("name",) if obj is not None else ()


# The admin index links to the queue dashboard and the enqueue form.
admin.site.index_template = "tasks_app/admin_index.html"


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Create tokens (the secret is shown once, only its hash is kept) and revoke them."""

    list_display = ("name", "user", "key_prefix", "created_at", "last_used_at", "revoked_at")
    list_select_related = ("user",)
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("name", "user__username", "key_prefix")
    actions = ("revoke",)

    def get_queryset(self, request: HttpRequest) -> Any:
        """A superuser sees every token; anyone else only their own (a token acts with its user's rights)."""
        tokens = super().get_queryset(request)
        return tokens if request.user.is_superuser else tokens.filter(user=request.user)

    def get_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> tuple[str, ...]:
        if obj is None:
            return ("user", "name") if request.user.is_superuser else ("name",)
        return ("user", "name", "key_prefix", "created_at", "last_used_at", "revoked_at")

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> list[str]:
        if obj is None:
            return []
        # A revocation is for good (a leaked secret must not work again): a new token is minted instead.
        return ["user", "key_prefix", "created_at", "last_used_at", *(["revoked_at"] if obj.revoked_at else [])]

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if not change:
            user = request.user
            if user.is_authenticated and not user.is_superuser:
                obj.user = user  # only a superuser mints tokens for someone else
            # Kept on the instance (not on this shared ModelAdmin) until response_add shows it.
            obj.secret = obj.new_secret()  # type: ignore[attr-defined]
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiToken, post_url_continue: str | None = None) -> HttpResponse:
        """Show the new token once, on its own page (never in a cookie or the database)."""
        secret = obj.secret  # type: ignore[attr-defined]
        context = admin_context(request, "API token created", token=obj, secret=secret, opts=self.opts)
        return render(request, "tasks_app/token_created.html", context)

    @admin.action(description="Revoke selected API tokens")
    def revoke(self, request: HttpRequest, queryset: Any) -> None:
        """Revoke tokens: requests with them are refused from now on."""
        revoked = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {revoked} token(s).")


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


@admin.register(PeriodicTask)
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
    def _status(obj: PeriodicTask) -> ScheduleStatus:
        return obj.periodic_status  # type: ignore[attr-defined, no-any-return]

    @admin.display(description="Schedule")
    def schedule(self, obj: PeriodicTask) -> str:
        return self._status(obj).schedule

    @admin.display(description="Next run")
    def next_run(self, obj: PeriodicTask) -> str:
        status = self._status(obj)
        if status.next_run:
            return f"{status.next_run:%Y-%m-%d %H:%M:%S} UTC"
        return f"invalid: {status.error}" if status.error else "-"

    @admin.display(description="Last fired run")
    def last_run(self, obj: PeriodicTask) -> str:
        status = self._status(obj)
        if not status.last_task_id or status.last_slot is None:
            return status.state_error or "-"
        when = f"{status.last_slot:%Y-%m-%d %H:%M:%S} UTC"
        url = url_or_empty("tasks_app:task", status.last_task_id)  # "": an id no URL can hold
        return format_html('<a href="{}">{}</a>', url, when) if url else when
