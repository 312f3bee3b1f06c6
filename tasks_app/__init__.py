"""A reliable, rate-limited task queue for Django on Redis."""

from tasks_app.exceptions import TaskTimeout
from tasks_app.registry import handler

__all__ = ["TaskTimeout", "handler"]
