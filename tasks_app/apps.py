"""App configuration: handler discovery and system checks."""
from django.apps import AppConfig


class TasksAppConfig(AppConfig):
    """Imports every installed app's handlers.py and TASK_HANDLER_MODULES once Django is ready."""

    name = "tasks_app"
    verbose_name = "Task queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from django.utils.module_loading import autodiscover_modules

        from . import checks  # noqa: F401  (registers the system checks)
        from .registry import registry

        autodiscover_modules("handlers")
        registry.import_modules(settings.TASK_HANDLER_MODULES)
