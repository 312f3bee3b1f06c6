"""Defaults of the task queue's settings, for a project whose settings.py leaves some out."""

from typing import Any

from django.conf import settings

# Every REDIS_* / TASKS_* / TASK_* setting tasks_app reads, with the default of README's settings table.
DEFAULTS: dict[str, Any] = {
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    "REDIS_CLUSTER": False,
    "TASKS_KEY_PREFIX": "ts",
    "TASK_HANDLER_MODULES": [],
    "TASKS_RESULT_TTL": 7 * 24 * 3600,
    "TASKS_MAX_PAYLOAD_BYTES": 1024 * 1024,
    "TASKS_MAX_RESULT_BYTES": 1024 * 1024,
    "TASKS_CONFIG_REFRESH_S": 2.0,
    "TASKS_MAX_DELAY_S": 365 * 24 * 3600,
    "TASKS_DEAD_LETTER_MAX": 10000,
    "TASKS_DEAD_LETTER_MAX_AGE_S": 180 * 24 * 3600,
    "TASKS_CLUSTER_WAIT_MS": 100,
    "TASKS_THROTTLE_RECHECK_S": 5.0,
    "TASKS_HISTORY_MAX": 100_000,
    "TASKS_PERIODIC": {},
    "TASKS_PERIODIC_GRACE_S": 60.0,
}


def apply_defaults() -> None:
    """Give each setting of DEFAULTS that the project does not set its default value."""
    for name, value in DEFAULTS.items():
        if not hasattr(settings, name):
            setattr(settings, name, value)
