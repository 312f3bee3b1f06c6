"""App configuration: setting defaults, handler discovery and system checks."""

from types import ModuleType
from typing import Any

from django.apps import AppConfig
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
    "TASKS_WORKFLOW_MAX_TASKS": 20_000,
    "TASKS_WORKFLOW_MAX_DEPTH": 10,
    "TASKS_PERIODIC": {},
    "TASKS_PERIODIC_GRACE_S": 60.0,
    "TASKS_TRACE_PROPAGATION": "child",
}

# Modules of every installed app searched for handlers: `@handler` functions and, in Django's
# usual home for them, `@django.tasks.task` functions.
HANDLER_SUBMODULES = ("handlers", "tasks")


class TasksAppConfig(AppConfig):
    """Imports every installed app's handlers.py and tasks.py, then TASK_HANDLER_MODULES."""

    name = "tasks_app"
    verbose_name = "Task queue"
    default_auto_field = "django.db.models.BigAutoField"

    def __init__(self, app_name: str, app_module: ModuleType | None) -> None:
        super().__init__(app_name, app_module)
        # Before any installed app's models or ready() import a module of ours.
        for name, value in DEFAULTS.items():
            if not hasattr(settings, name):
                setattr(settings, name, value)

    def ready(self) -> None:
        from django.apps import apps
        from django.utils.module_loading import module_has_submodule

        # Imported for their effect: checks registers the system checks, task_types a signal receiver.
        from tasks_app import checks, task_types  # noqa: F401
        from tasks_app.registry import registry

        discovered = [
            f"{app.name}.{submodule}"
            for app in apps.get_app_configs()
            for submodule in HANDLER_SUBMODULES
            if module_has_submodule(app.module, submodule)
        ]
        registry.import_modules([*discovered, *settings.TASK_HANDLER_MODULES])
