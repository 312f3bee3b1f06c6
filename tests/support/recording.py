"""Reading what `test.record` wrote."""
import json
from collections import Counter
from typing import Any

from tasks_app.broker import Broker

from .handlers import RUNS_KEY_SUFFIX


def recorded_runs(broker: Broker) -> list[dict[str, Any]]:
    """Every run recorded so far, in the order they started."""
    raw = broker.client.lrange(f"{broker.keys.prefix}:{RUNS_KEY_SUFFIX}", 0, -1)
    return [json.loads(item) for item in raw]


def runs_per_task(broker: Broker) -> Counter[str]:
    """How many times each task id ran."""
    return Counter(run["task_id"] for run in recorded_runs(broker))
