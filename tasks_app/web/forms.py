"""The staff enqueue form: JSON arguments checked server-side, errors shown next to their field."""

from __future__ import annotations

from typing import Any, cast

from django import forms
from django.conf import settings

from tasks_app.models import TaskType, name_validator
from tasks_app.producer import MAX_UNIQUE_KEY_CHARS
from tasks_app.protocol.codec import PRIORITY_MAX, PRIORITY_MIN, JsonTooDeep, loads_bounded
from tasks_app.registry import Registry, registry as default_registry

JSON_TEXTAREA = forms.Textarea(attrs={"rows": 3, "cols": 60, "class": "vLargeTextField", "spellcheck": "false"})


def enqueueable_type_names(registry: Registry = default_registry) -> list[str]:
    """Return the names of enabled task types whose handler is registered in this process."""
    return [
        row.name
        for row in TaskType.objects.filter(enabled=True).only("name", "handler")
        if registry.get(row.handler) is not None
    ]


def parse_json_field[T](text: str, expected: type[T], what: str) -> T:
    """Parse `text` as JSON of type `expected` (empty means empty), with a precise message on error."""
    if not text.strip():
        return expected()
    try:
        value = loads_bounded(text)
    except JsonTooDeep as exc:
        raise forms.ValidationError(str(exc), code="too_deep") from None
    except ValueError as exc:
        raise forms.ValidationError(f"Invalid JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, expected):
        raise forms.ValidationError(
            f"{what} must be a JSON {'array' if expected is list else 'object'}, got {type(value).__name__}",
            code="wrong_type",
        )
    return value


class EnqueueForm(forms.Form):
    """Which task to enqueue and with what arguments."""

    type = forms.ChoiceField(label="Task type", choices=())
    args = forms.CharField(
        label="Args",
        required=False,
        widget=JSON_TEXTAREA,
        help_text='Positional arguments as a JSON array, e.g. <code>[1, "two"]</code>.',
    )
    kwargs = forms.CharField(
        label="Kwargs",
        required=False,
        widget=JSON_TEXTAREA,
        help_text='Keyword arguments as a JSON object, e.g. <code>{"to": "a@b.c"}</code>.',
    )
    queue = forms.CharField(
        label="Queue",
        required=False,
        max_length=100,
        validators=[name_validator],
        help_text="Leave empty for the task type's queue.",
    )
    priority = forms.IntegerField(
        label="Priority",
        initial=0,
        min_value=PRIORITY_MIN,
        max_value=PRIORITY_MAX,
        help_text=f"{PRIORITY_MIN} to {PRIORITY_MAX}; higher runs first.",
    )
    delay = forms.FloatField(
        label="Delay (seconds)",
        initial=0,
        min_value=0,
        max_value=settings.TASKS_MAX_DELAY_S,
        help_text="Run no sooner than this many seconds from now.",
    )
    unique_key = forms.CharField(
        label="Unique key",
        required=False,
        strip=False,
        max_length=MAX_UNIQUE_KEY_CHARS,
        help_text="For task types with <code>unique_for_s</code>: a task enqueued with the same key within the "
        "window is not enqueued again (you are taken to the first one). Leave empty for a hash of the arguments.",
    )

    def __init__(self, *args: Any, registry: Registry = default_registry, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        type_field = cast(forms.ChoiceField, self.fields["type"])
        type_field.choices = [("", "---------"), *((n, n) for n in enqueueable_type_names(registry))]

    def clean_args(self) -> list[Any]:
        return parse_json_field(self.cleaned_data["args"], list, "Args")

    def clean_kwargs(self) -> dict[str, Any]:
        return parse_json_field(self.cleaned_data["kwargs"], dict, "Kwargs")

    def clean_unique_key(self) -> str | None:
        return self.cleaned_data["unique_key"] or None


# Which form field a producer error is about, by the start of its message.
_ERROR_FIELDS = (
    ("payload", "args"),
    ("arguments", "args"),
    ("args", "args"),
    ("kwargs", "kwargs"),
    ("invalid queue", "queue"),
    ("priority", "priority"),
    ("delay", "delay"),
    ("unique_key", "unique_key"),
    ("invalid task type", "type"),
    ("unknown task type", "type"),
    ("task type", "type"),
)


def error_field(message: str) -> str | None:
    """Return the form field a producer's EnqueueError message is about (None: the whole form)."""
    return next((name for start, name in _ERROR_FIELDS if message.startswith(start)), None)
