"""Reading this process's Prometheus metrics in unit tests."""
from __future__ import annotations

from prometheus_client import REGISTRY


def sample(name: str, **labels: str) -> float:
    """The current value of one sample of this process's default registry (0 if it has none yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0
