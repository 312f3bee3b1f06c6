"""System checks for the task queue's settings."""

import math
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning, register

from tasks_app.protocol.keys import NAME_PATTERN

# Well under Redis's default proto-max-bulk-len (512 MiB): a record holds a value and a traceback.
MAX_RESULT_BYTES_LIMIT = 64 * 1024 * 1024
# A consumer's acks wait at most this long for a replica (WAIT 0 would block forever).
MAX_CLUSTER_WAIT_MS = 10_000

# Settings that must lie in a range: name, lowest, highest, unit, why, check id.
_BOUNDED_SETTINGS = (
    (
        "TASKS_CONFIG_REFRESH_S",
        0.1,
        3600,
        " seconds",
        "Consumers reload task types this often, so admin edits reach them within it; "
        "NaN would stop the reloads altogether.",
        "tasks_app.E005",
    ),
    (
        "TASKS_MAX_RESULT_BYTES",
        1024,
        MAX_RESULT_BYTES_LIMIT,
        "",
        "Redis refuses values over its proto-max-bulk-len (512 MiB by default).",
        "tasks_app.E030",
    ),
    (
        "TASKS_CLUSTER_WAIT_MS",
        1,
        MAX_CLUSTER_WAIT_MS,
        " milliseconds",
        "Acks wait this long at most for a replica; 0 would make Redis wait forever.",
        "tasks_app.E031",
    ),
    (
        "TASKS_THROTTLE_RECHECK_S",
        0.1,
        3600,
        " seconds",
        "Tasks waiting for a concurrency slot look again this often should a wake be lost.",
        "tasks_app.E040",
    ),
    (
        "TASKS_HISTORY_MAX",
        1,
        10_000_000,
        " tasks",
        "Each queue's history index keeps this many tasks; ten million would take gigabytes of Redis memory.",
        "tasks_app.E060",
    ),
    (
        "TASKS_PERIODIC_GRACE_S",
        0,
        7 * 86400,
        " seconds",
        "A periodic slot reached later than this counts as missed (its catch-up policy decides).",
        "tasks_app.E050",
    ),
)


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
    if not _within(settings.TASKS_RESULT_TTL, 1):
        problems.append(Error("TASKS_RESULT_TTL must be a positive number of seconds", id="tasks_app.E003"))
    if not _within(settings.TASKS_MAX_PAYLOAD_BYTES, 1):
        problems.append(Error("TASKS_MAX_PAYLOAD_BYTES must be positive", id="tasks_app.E004"))
    if not _within(settings.TASKS_MAX_DELAY_S, 1):
        problems.append(Error("TASKS_MAX_DELAY_S must be a positive number of seconds", id="tasks_app.E020"))
    if not _within(settings.TASKS_DEAD_LETTER_MAX, 0):
        problems.append(Error("TASKS_DEAD_LETTER_MAX must be 0 or more", id="tasks_app.E021"))
    if not _within(settings.TASKS_DEAD_LETTER_MAX_AGE_S, 1):
        problems.append(Error("TASKS_DEAD_LETTER_MAX_AGE_S must be a positive number of seconds", id="tasks_app.E022"))
    periodic: object = settings.TASKS_PERIODIC  # a project's settings.py may hold anything
    if not isinstance(periodic, dict):
        problems.append(Error("TASKS_PERIODIC must be a dict: schedule name -> entry", id="tasks_app.E051"))
    problems += [
        Error(f"{name} must be between {low} and {high}{unit}", hint=hint, id=check_id)
        for name, low, high, unit, hint, check_id in _BOUNDED_SETTINGS
        if not _within(getattr(settings, name), low, high)
    ]
    for module, error in registry.import_errors.items():
        problems.append(
            Warning(
                f"handler module {module} failed to import: {error}",
                hint="Tasks whose handler lives there will be dead-lettered.",
                id="tasks_app.W001",
            )
        )
    return problems


def _within(value: object, low: float, high: float = math.inf) -> bool:
    """Whether `value` is a number from `low` to `high`: not a bool, a string, None, NaN or an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not (isinstance(value, float) and math.isinf(value)) and low <= value <= high  # NaN fails both
