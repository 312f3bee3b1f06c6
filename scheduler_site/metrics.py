"""The web app's `/metrics`: django-prometheus' request and database metrics, then the queue gauges read from Redis.

The web app runs whether or not consumers do, so a scaler reading the queue gauges here can start the first
consumer of a queue that has none.
"""

from __future__ import annotations

from functools import cache

from django.http import HttpRequest, HttpResponse
from django_prometheus.exports import ExportToDjangoView  # type: ignore[import-untyped]
from prometheus_client import CollectorRegistry, generate_latest

from tasks_app.collectors import QueueCollector
from tasks_app.protocol.broker import get_broker


@cache
def _queue_registry() -> CollectorRegistry:
    """A registry of this process's own for the queue gauges: multiprocess mode sums only the files of workers."""
    registry = CollectorRegistry()
    registry.register(QueueCollector(get_broker))
    return registry


def metrics(request: HttpRequest) -> HttpResponse:
    """Serve django-prometheus' exposition followed by the queue gauges (one read of Redis per scrape)."""
    response: HttpResponse = ExportToDjangoView(request)
    response.content = response.content + generate_latest(_queue_registry())
    return response
