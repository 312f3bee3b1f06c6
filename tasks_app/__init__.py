"""A reliable, rate-limited task queue for Django on Redis."""

from .exceptions import TaskTimeout
from .registry import handler

__all__ = ["TaskTimeout", "handler"]
