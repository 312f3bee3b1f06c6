"""The registry of task handlers: the only code a consumer will ever run."""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from django.tasks import Task  # also registers Django's system checks of the TASKS backends

from tasks_app.protocol.keys import validate_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Handler:
    """A registered handler: a function and whether it takes a context first."""

    name: str
    func: Callable[..., Any]
    takes_context: bool = False
    # A django.tasks Task object when the handler came from `@django.tasks.task`.
    django_task: Any = None

    @cached_property
    def is_async(self) -> bool:
        """True for an `async def` function (or an object with an `async def __call__`): it runs on the event loop."""
        if inspect.iscoroutinefunction(self.func):
            return True
        return not inspect.isroutine(self.func) and inspect.iscoroutinefunction(type(self.func).__call__)


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
                raise ValueError(f"handler {entry.name!r} is already registered to {_qualname(existing.func)}")
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
                # `@django.tasks.task` functions of a handler module are handlers too.
                for candidate in vars(importlib.import_module(module)).values():
                    if isinstance(candidate, Task):
                        self.add_django_task(candidate)
            except Exception as exc:  # any error in user code must not stop the process
                self.import_errors[module] = f"{type(exc).__name__}: {exc}"
                logger.error("cannot import handler module %s: %s", module, exc)

    def add_django_task(self, task: Any) -> Handler:
        """Register a `@django.tasks.task` object under its `module_path` (kept if already there)."""
        existing = self.get(task.module_path)
        if existing is not None and existing.func is task.func:
            return existing
        entry = Handler(name=task.module_path, func=task.func, takes_context=task.takes_context, django_task=task)
        self.add(entry)
        return entry

    def load_django_task(self, name: str) -> Handler | None:
        """Import the module of `name` and register the `django.tasks.Task` it names, if it is one."""
        module_name, _, attribute = name.rpartition(".")
        if not module_name:
            return None
        try:
            candidate = getattr(importlib.import_module(module_name), attribute, None)
        except Exception as exc:  # user code: a broken module must not stop the consumer
            self.import_errors[module_name] = f"{type(exc).__name__}: {exc}"
            logger.error("cannot import task module %s: %s", module_name, exc)
            return None
        if not isinstance(candidate, Task) or candidate.module_path != name:
            return None
        return self.add_django_task(candidate)


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
