"""Reading this process's Prometheus metrics in unit tests."""

from __future__ import annotations

from prometheus_client import REGISTRY


def sample(name: str, **labels: str) -> float:
    """The sum of this process's samples called `name` whose labels include `labels` (0 if none)."""
    return sum(
        found.value
        for metric in REGISTRY.collect()
        for found in metric.samples
        if found.name == name and all(found.labels.get(key) == value for key, value in labels.items())
    )
