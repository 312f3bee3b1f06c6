"""Reading what `test.record` wrote."""

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from tasks_app.protocol.broker import Broker

from .handlers import HANDLER_STARTS_KEY_SUFFIX, MARKS_KEY_SUFFIX, RUNS_KEY_SUFFIX
from .processes import wait_until


def recorded_runs(broker: Broker) -> list[dict[str, Any]]:
    """Every run recorded so far, in the order they started."""
    raw = broker.client.lrange(f"{broker.keys.prefix}:{RUNS_KEY_SUFFIX}", 0, -1)
    return [json.loads(item) for item in raw]


def handler_starts(broker: Broker) -> list[dict[str, Any]]:
    """Every start `test.handler_start` and `test.async_handler_start` noted so far, in order."""
    raw = broker.client.lrange(f"{broker.keys.prefix}:{HANDLER_STARTS_KEY_SUFFIX}", 0, -1)
    return [json.loads(item) for item in raw]


def runs_per_task(broker: Broker) -> Counter[str]:
    """How many times each task id ran."""
    return Counter(run["task_id"] for run in recorded_runs(broker))


def most_starts_in_any_window(starts: list[float], window: float) -> int:
    """The most starts inside any half-open window [t, t + window), checking a window at each start."""
    ordered = sorted(starts)
    most, first = 0, 0
    for last, start in enumerate(ordered):
        while start - ordered[first] >= window:
            first += 1
        most = max(most, last - first + 1)
    return most


def marks(broker: Broker) -> list[dict[str, Any]]:
    """Every mark `test.hang` (and the async test handlers) left, in order."""
    raw = broker.client.lrange(f"{broker.keys.prefix}:{MARKS_KEY_SUFFIX}", 0, -1)
    return [json.loads(item) for item in raw]


def remove_limit_and_wait_for_runs(broker: Broker, row: Any, tasks: Iterable[Any], message: str) -> None:
    """Remove the rate limit of TaskType `row` in the admin's way (a save) and wait until every task has run."""
    row.rate_limit = None
    row.save(update_fields=["rate_limit"])
    wanted = {task.id for task in tasks}
    wait_until(lambda: {run["task_id"] for run in recorded_runs(broker)} >= wanted, 15, message=message)
