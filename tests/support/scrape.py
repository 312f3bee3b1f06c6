"""Reading Prometheus text exposition in tests."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


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
