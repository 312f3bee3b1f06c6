"""App configuration: setting defaults, handler discovery and system checks."""

from types import ModuleType

from django.apps import AppConfig

from tasks_app.conf import apply_defaults

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
        apply_defaults()  # before any installed app's models or ready() import a module of ours

    def ready(self) -> None:
        from django.apps import apps
        from django.conf import settings
        from django.utils.module_loading import module_has_submodule

        # Imported for their effect: checks registers the system checks, signals connects the receivers.
        from tasks_app import checks, signals  # noqa: F401
        from tasks_app.registry import registry

        discovered = [
            f"{app.name}.{submodule}"
            for app in apps.get_app_configs()
            for submodule in HANDLER_SUBMODULES
            if module_has_submodule(app.module, submodule)
        ]
        registry.import_modules([*discovered, *settings.TASK_HANDLER_MODULES])
