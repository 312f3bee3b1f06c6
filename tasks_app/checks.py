"""System checks for the task queue's settings."""

import math
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register

from tasks_app.protocol.keys import NAME_PATTERN
from tasks_app.tracing import PROPAGATIONS

# Settings that must lie in a range, by check id: name, lowest, highest, unit, why (if not plain).
_BOUNDED_SETTINGS: dict[str, tuple[str, float, float, str, str]] = {
    "E003": ("TASKS_RESULT_TTL", 1, math.inf, " seconds", ""),
    "E004": ("TASKS_MAX_PAYLOAD_BYTES", 1, math.inf, " bytes", ""),
    "E005": ("TASKS_CONFIG_REFRESH_S", 0.1, 3600, " seconds", "Admin edits reach consumers within it."),
    "E020": ("TASKS_MAX_DELAY_S", 1, math.inf, " seconds", ""),
    "E021": ("TASKS_DEAD_LETTER_MAX", 0, math.inf, " tasks", ""),
    "E022": ("TASKS_DEAD_LETTER_MAX_AGE_S", 1, math.inf, " seconds", ""),
    # Well under Redis's default proto-max-bulk-len (512 MiB): a record holds a value and a traceback.
    "E030": ("TASKS_MAX_RESULT_BYTES", 1024, 64 * 1024 * 1024, " bytes", "Redis refuses values over 512 MiB."),
    "E031": ("TASKS_CLUSTER_WAIT_MS", 1, 10_000, " milliseconds", "0 would make Redis wait forever for a replica."),
    "E040": ("TASKS_THROTTLE_RECHECK_S", 0.1, 3600, " seconds", "Tasks waiting for a slot look again this often."),
    "E050": ("TASKS_PERIODIC_GRACE_S", 0, 7 * 86400, " seconds", "A slot reached later than this counts as missed."),
    "E060": ("TASKS_HISTORY_MAX", 1, 10_000_000, " tasks", "Each queue's history index keeps this many tasks."),
    "E070": ("TASKS_WORKFLOW_MAX_TASKS", 1, 100_000, " tasks", "A workflow is stored and started by one script."),
    "E071": ("TASKS_WORKFLOW_MAX_DEPTH", 1, 100, " levels", "Its scripts walk the tree recursively."),
}


@register()
def check_task_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Validate the task queue settings and report handler modules that failed to import."""
    from tasks_app.registry import registry

    problems: list[CheckMessage] = []
    prefix, url = settings.TASKS_KEY_PREFIX, settings.REDIS_URL
    if not (isinstance(prefix, str) and NAME_PATTERN.fullmatch(prefix)):
        problems.append(Error("TASKS_KEY_PREFIX must be 1-100 characters of A-Z a-z 0-9 _ . : -", id="tasks_app.E001"))
    if not (isinstance(url, str) and url.startswith(("redis://", "rediss://", "unix://"))):
        problems.append(Error("REDIS_URL must start with redis://, rediss:// or unix://", id="tasks_app.E002"))
    for check_id, (name, low, high, unit, hint) in _BOUNDED_SETTINGS.items():
        if not _within(getattr(settings, name), low, high):
            span = f"at least {low}" if high == math.inf else f"between {low} and {high}"
            problems.append(
                Error(f"{name} must be a number {span}{unit}", hint=hint or None, id=f"tasks_app.{check_id}")
            )
    periodic: object = settings.TASKS_PERIODIC  # a project's settings.py may hold anything
    if not isinstance(periodic, dict):
        problems.append(Error("TASKS_PERIODIC must be a dict: schedule name -> entry", id="tasks_app.E051"))
    if settings.TASKS_TRACE_PROPAGATION not in PROPAGATIONS:
        problems.append(
            Error(
                f"TASKS_TRACE_PROPAGATION must be one of {', '.join(map(repr, PROPAGATIONS))}",
                hint="A run's span is the child of its task's send span, or linked to it.",
                id="tasks_app.E080",
            )
        )
    for module, error in registry.import_errors.items():
        problems.append(
            Warning(
                f"handler module {module} failed to import: {error}",
                hint="Tasks whose handler lives there will be dead-lettered.",
                id="tasks_app.W001",
            )
        )
    return problems


def _within(value: object, low: float, high: float) -> bool:
    """Whether `value` is a number from `low` to `high`: not a bool, a string, None, NaN or an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not (isinstance(value, float) and math.isinf(value)) and low <= value <= high  # NaN fails both
