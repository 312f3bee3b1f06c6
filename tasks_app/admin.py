"""Admin for task types: the handler is a choice among registered handlers."""
from typing import Any

from django import forms
from django.contrib import admin

from .models import TaskType
from .registry import registry


class TaskTypeForm(forms.ModelForm):
    """TaskType form whose handler field lists the handlers registered in code."""

    handler = forms.ChoiceField(choices=(), help_text=TaskType._meta.get_field("handler").help_text)

    class Meta:
        model = TaskType
        fields = "__all__"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = registry.names()
        current = self.instance.handler if self.instance and self.instance.pk else None
        if current and current not in names:
            names.append(current)  # keep a row editable after its handler was removed from code
        self.fields["handler"].choices = [(name, name) for name in names]


@admin.register(TaskType)
class TaskTypeAdmin(admin.ModelAdmin):
    form = TaskTypeForm
    list_display = ("name", "handler", "queue", "enabled", "rate_limit", "rate_period", "max_attempts",
                    "retry_backoff", "timeout", "updated_at")
    list_filter = ("enabled", "queue", "rate_algorithm")
    list_editable = ("enabled",)
    search_fields = ("name", "handler", "queue")
    fieldsets = (
        (None, {"fields": ("name", "handler", "queue", "enabled")}),
        ("Rate limit", {"fields": ("rate_limit", "rate_period", "rate_burst", "rate_algorithm")}),
        ("Retries and timeout", {"fields": ("max_attempts", "retry_backoff", "timeout")}),
    )
