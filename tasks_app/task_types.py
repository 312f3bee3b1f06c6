"""Task type settings as consumers and producers see them: cached, refreshed from the database."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from prometheus_client import Gauge

from tasks_app.models import TIMEOUT_MIN_S, UNIQUE_FOR_MAX_S, TaskType
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol.inspection import UniqueWindow
from tasks_app.registry import Registry

logger = logging.getLogger(__name__)
# After a failed read of the rows, how long claims that need them wait before asking again (s).
RETRY_FAILED_READ_S = 1.0


@dataclass(frozen=True)
class TaskTypeConfig:
    """An immutable snapshot of one TaskType row."""

    name: str
    handler: str
    queue: str = "default"
    enabled: bool = True
    rate_limit: int | None = None
    rate_period_s: float = 1.0
    rate_burst: int = 1
    rate_algorithm: str = TaskType.RateAlgorithm.GCRA
    max_attempts: int = 3
    retry_backoff_s: float = 2.0
    timeout_s: float | None = None
    unique_for_s: float | None = None
    unique_until: str = TaskType.UniqueUntil.WINDOW
    max_running: int | None = None
    rate_limit_key: str = ""
    max_running_key: str = ""
    keep_results: str = TaskType.KeepResults.ALWAYS
    result_ttl_s: int | None = None  # None: TASKS_RESULT_TTL

    @classmethod
    def from_model(cls, row: TaskType) -> TaskTypeConfig:
        """Snapshot a TaskType row, a limit or window written past the admin's bounds read as the nearest bound."""
        # A timeout of 0, NaN or infinity is none (NaN timed an async run out at once, and a thread run never).
        timeout_s = max(row.timeout, TIMEOUT_MIN_S) if row.timeout and math.isfinite(row.timeout) else None
        unique_for_s = row.unique_for_s
        if unique_for_s is not None and not unique_for_s <= UNIQUE_FOR_MAX_S:  # 1e300, infinity, NaN
            unique_for_s = float(UNIQUE_FOR_MAX_S)
        return cls(
            name=row.name,
            handler=row.handler,
            queue=row.queue,
            enabled=row.enabled,
            rate_limit=_at_least_one(row.rate_limit),
            rate_period_s=row.rate_period,
            rate_burst=row.rate_burst,
            rate_algorithm=row.rate_algorithm,
            max_attempts=row.max_attempts,
            retry_backoff_s=row.retry_backoff,
            timeout_s=timeout_s,
            unique_for_s=unique_for_s,
            unique_until=row.unique_until,
            max_running=_at_least_one(row.max_running),
            rate_limit_key=row.rate_limit_key,
            max_running_key=row.max_running_key,
            keep_results=row.keep_results,
            result_ttl_s=row.result_ttl,
        )

    def kept_for_s(self, status: str, default_s: int) -> int:
        """How long the record of a task of this type that ended with `status` is kept (s); 0: not kept."""
        keep = self.keep_results
        if keep == TaskType.KeepResults.NEVER or (keep == TaskType.KeepResults.FAILURES and status != "FAILED"):
            return 0
        return self.result_ttl_s or default_s

    @property
    def unique_window_ms(self) -> int:
        """The uniqueness window in ms (at least 1), or 0 for a type that is not unique."""
        return max(1, int(self.unique_for_s * 1000)) if self.unique_for_s else 0

    @classmethod
    def default_for(cls, handler_name: str) -> TaskTypeConfig:
        """The settings a type gets when its row is created on first use."""
        return cls(name=handler_name, handler=handler_name)


def _at_least_one(limit: int | None) -> int | None:
    # A 0 written past the admin is read as the strictest limit, 1: read as none, it would let a type run unthrottled.
    return None if limit is None else max(1, limit)


class UnknownTaskType(LookupError):
    """A type name with neither a TaskType row nor a registered handler of that name."""


def ensure_task_type(name: str, registry: Registry) -> TaskTypeConfig:
    """Return the type's settings, creating its row with defaults if a handler has its name."""
    row = TaskType.objects.filter(name=name).first()
    if row is not None:
        return TaskTypeConfig.from_model(row)
    if registry.get(name) is None:
        raise UnknownTaskType(f"unknown task type {name!r}: no TaskType row and no handler of that name")
    try:
        with transaction.atomic():
            row = TaskType.objects.create(name=name, handler=name)
    except IntegrityError:  # another process created it first
        row = TaskType.objects.get(name=name)
    return TaskTypeConfig.from_model(row)


class TaskTypeCache:
    """Every TaskType in memory; `refresh()` reloads them all in one query."""

    def __init__(self, age_gauge: Gauge | None = None) -> None:
        """`age_gauge`, if given, reports `age_s()` at each scrape."""
        self._configs: dict[str, TaskTypeConfig] = {}
        if age_gauge is not None:
            age_gauge.set_function(self.age_s)
        self.loaded = False  # until the rows were read once, no type's settings are known
        # When the last successful refresh began (monotonic s): it read every row created before then.
        self.read_at = float("-inf")
        self._failed_at = float("-inf")
        # Called with each type a refresh found changed (a deleted row's: its last settings less the rate limit).
        self.on_change: list[Callable[[TaskTypeConfig], None]] = []
        self._problem: ProblemLog[str] = ProblemLog(logger)  # the database away at every refresh

    def get(self, name: str) -> TaskTypeConfig | None:
        """Return the cached settings of type `name` (None if it has no row)."""
        return self._configs.get(name)

    def disabled(self, name: str) -> bool:
        """True while type `name` is disabled, or while no row was read yet (its state is unknown)."""
        config = self._configs.get(name)
        return not self.loaded or (config is not None and not config.enabled)

    def kept_for_s(self, name: str, status: str, default_s: int) -> int:
        """How long the record of a task of type `name` that ended with `status` is kept (s); 0: not kept."""
        config = self._configs.get(name)
        return default_s if config is None else config.kept_for_s(status, default_s)

    def age_s(self) -> float:
        """Seconds since the rows were last read (infinite before the first read)."""
        return time.monotonic() - self.read_at

    def holds_rows_since(self, since_s: float) -> bool:
        """True if the cache holds every row created before `since_s` (monotonic), reading them if need be."""
        if self.read_at >= since_s:
            return True
        if time.monotonic() - self._failed_at < RETRY_FAILED_READ_S:
            return False
        return self.refresh()

    def refresh(self) -> bool:
        """Reload every row; on a database error keep serving the last snapshot and return False."""
        began = time.monotonic()
        try:
            # Without the time stamps: a malformed one (a raw UPDATE on SQLite) would fail the read of every row.
            rows = TaskType.objects.all().defer("created_at", "updated_at")
            configs = {row.name: TaskTypeConfig.from_model(row) for row in rows}
        except Exception as exc:  # the database may be briefly away; stale settings beat none
            self._failed_at = began
            if self.loaded:
                message = "cannot reload task types, keeping the last ones: %s"
            else:
                message = "cannot read the task types, claiming nothing until then: %s"
            self._problem.failed("refresh", repr(exc), message, exc)
            return False
        self._problem.recovered("refresh", "task types reloaded again")
        before, self._configs, self.loaded, self.read_at = self._configs, configs, True, began
        changed = [config for name, config in configs.items() if name in before and before[name] != config]
        # A row deleted: its tasks run unlimited or are dead-lettered, so none may wait for its limit's slots.
        changed += [replace(config, rate_limit=None) for name, config in before.items() if name not in configs]
        for config in changed:
            for listener in self.on_change:
                listener(config)
        return True


def unique_windows(names: Iterable[str]) -> dict[str, UniqueWindow]:
    """The uniqueness windows of the named types that are unique, as the database has them now."""
    rows = TaskType.objects.filter(name__in=set(names)).defer("created_at", "updated_at")
    configs = [TaskTypeConfig.from_model(row) for row in rows]
    finished = TaskType.UniqueUntil.FINISHED
    return {c.name: UniqueWindow(c.unique_window_ms, c.unique_until == finished) for c in configs if c.unique_window_ms}


class RecentTaskTypes:
    """Producer-side settings per type, re-read from the database at most every `max_age_s`."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[TaskTypeConfig, float]] = {}

    def get(self, name: str, registry: Registry, max_age_s: float) -> TaskTypeConfig:
        """Return the settings of type `name`, creating its row on first use (see ensure_task_type)."""
        entry = self._entries.get(name)
        if entry is not None and time.monotonic() - entry[1] < max_age_s:
            return entry[0]
        read_at = time.monotonic()
        config = ensure_task_type(name, registry)
        # Read (or created) inside the caller's transaction: kept once it commits, so a row its rollback
        # removes (or settings it undoes) is not taken for the database's. A dict's item is set atomically.
        transaction.on_commit(functools.partial(self._entries.__setitem__, name, (config, read_at)))
        return config

    def forget(self, name: str | None = None) -> None:
        """Drop one type (or all) so the next enqueue reads the database."""
        if name is None:
            self._entries.clear()
        else:
            self._entries.pop(name, None)


recent_task_types = RecentTaskTypes()


@receiver([post_save, post_delete], sender=TaskType, dispatch_uid="tasks_app.forget_task_type")
def forget_task_type(sender: type[TaskType], instance: TaskType, **kwargs: Any) -> None:
    """Make the next enqueue of this type in this process read its new settings."""
    recent_task_types.forget(instance.name)
