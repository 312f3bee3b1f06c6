"""A reliable, rate-limited task queue for Django on Redis."""
from .registry import handler

__all__ = ["handler"]
