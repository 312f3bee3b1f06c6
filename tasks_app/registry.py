"""The registry of task handlers: the only code a consumer will ever run."""
from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .names import validate_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Handler:
    """A registered handler: a function and whether it takes a context first."""

    name: str
    func: Callable[..., Any]
    takes_context: bool = False
    # A django.tasks Task object when the handler came from `@django.tasks.task`.
    django_task: Any = None


@dataclass
class Registry:
    """Handlers by name, plus the modules that failed to import (and why)."""

    handlers: dict[str, Handler] = field(default_factory=dict)
    import_errors: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, entry: Handler) -> None:
        """Register a handler, refusing a second, different function under the same name."""
        with self._lock:
            existing = self.handlers.get(entry.name)
            if existing is not None and _qualname(existing.func) != _qualname(entry.func):
                raise ValueError(
                    f"handler {entry.name!r} is already registered to {_qualname(existing.func)}"
                )
            self.handlers[entry.name] = entry

    def get(self, name: str) -> Handler | None:
        """Return the handler registered under `name`, if any."""
        return self.handlers.get(name)

    def names(self) -> list[str]:
        """Return every registered handler name, sorted."""
        return sorted(self.handlers)

    def import_modules(self, modules: Iterable[str]) -> None:
        """Import handler modules, recording (not raising) the errors of those that fail."""
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception as exc:  # any error in user code must not stop the process
                self.import_errors[module] = f"{type(exc).__name__}: {exc}"
                logger.error("cannot import handler module %s: %s", module, exc)


registry = Registry()


def _qualname(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def handler(name: str, *, takes_context: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the handler of task type `name`."""
    validate_name(name, "handler name")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        registry.add(Handler(name=name, func=func, takes_context=takes_context))
        return func

    return decorate
