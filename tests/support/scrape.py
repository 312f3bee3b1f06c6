"""Reading Prometheus text exposition in tests."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from django.test import Client
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tasks_app.collectors import QueueCollector

# The series a family of each type exposes, after its name.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
}
# A metric name of ours or django-prometheus' in a PromQL expression.
METRIC_NAME = re.compile(r"\b(?:taskqueue|django)_[a-zA-Z0-9_]+")


def http_get(url: str) -> tuple[int, bytes]:
    """GET a URL; (0, b"") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


class Scrape:
    """One scrape's samples, looked up by name and a subset of labels."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.samples = [sample for family in self.families for sample in family.samples]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 if none)."""
        return sum(
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def has(self, name: str, **labels: str) -> bool:
        """True if some sample called `name` has these labels."""
        return any(s.name == name and all(s.labels.get(k) == v for k, v in labels.items()) for s in self.samples)


def scrape(url: str) -> Scrape | None:
    """Scrape a `/metrics` URL; None when it does not answer 200."""
    status, body = http_get(url)
    return Scrape(body.decode()) if status == 200 else None


def exported_names(broker) -> set[str]:
    """Every series name the consumer and the web app export, from real scrapes."""
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: broker))
    text = generate_latest(REGISTRY).decode() + generate_latest(registry).decode()
    text += Client(HTTP_HOST="localhost").get("/metrics").content.decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names
