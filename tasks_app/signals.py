"""Signal receivers: a TaskType edit in this process reaches its producers at once."""

from typing import Any

from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from tasks_app.models import TaskType
from tasks_app.task_types import recent_task_types


@receiver([post_save, post_delete], sender=TaskType, dispatch_uid="tasks_app.forget_task_type")
def forget_task_type(sender: type[TaskType], instance: TaskType, **kwargs: Any) -> None:
    """Make the next enqueue of this type read its new settings."""
    recent_task_types.forget(instance.name)
