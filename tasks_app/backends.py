"""`tasks_app.backends.RedisBackend`, the path a project's TASKS setting names: the backend lives in django_tasks."""

from tasks_app.django_tasks.backend import RedisBackend

__all__ = ["RedisBackend"]
