"""The web app's `/metrics` and `/healthz` under real gunicorn with two workers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port
from tests.support.processes import PROJECT_DIR, consumer_env, wait_until
from tests.support.scrape import http_get as get

pytestmark = pytest.mark.django_db(transaction=True)

HEALTHZ_RESPONSES = "django_http_responses_total_by_status_view_method"
STALE_FILE = "counter_999999.db"


@pytest.fixture
def multiproc_dir(tmp_path: Path) -> Path:
    """A multiprocess directory holding a file left by an earlier run, which start-up must remove."""
    directory = tmp_path / "multiproc"
    directory.mkdir()
    (directory / STALE_FILE).write_bytes(b"left by an earlier run")
    return directory


@pytest.fixture
def gunicorn(key_prefix: str, multiproc_dir: Path, tmp_path: Path) -> Iterator[str]:
    """`gunicorn scheduler_site.wsgi` with 2 workers, configured by the project's gunicorn.conf.py."""
    port = free_port()
    env = consumer_env(key_prefix, PROMETHEUS_MULTIPROC_DIR=str(multiproc_dir), DJANGO_DEBUG="0")
    with open(tmp_path / "gunicorn.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "scheduler_site.wsgi", "-b", f"127.0.0.1:{port}", "-w", "2"],
            cwd=PROJECT_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: get(f"{base}/healthz")[0] == 200 or process.poll() is not None, 30, message="gunicorn to answer"
        )
        assert process.poll() is None, (tmp_path / "gunicorn.log").read_text()
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def healthz_count(metrics_text: str) -> float:
    """Sum of 200 responses of the healthz view, over every worker."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == HEALTHZ_RESPONSES:
            return sum(
                sample.value
                for sample in family.samples
                if sample.name.endswith("_total")
                and sample.labels.get("view") == "healthz"
                and sample.labels.get("status") == "200"
            )
    return 0.0


def worker_pids_with_samples(directory: Path) -> set[str]:
    return {path.stem.rsplit("_", 1)[1] for path in directory.glob("counter_*.db")}


def test_metrics_add_up_requests_served_by_every_worker(gunicorn, multiproc_dir):
    assert not (multiproc_dir / STALE_FILE).exists(), "gunicorn start-up must empty the multiprocess directory"
    # The first healthz calls (startup probing) count too: start from what /metrics says now.
    status, body = get(f"{gunicorn}/metrics")
    assert status == 200
    before = healthz_count(body.decode())
    assert before >= 1

    made = 0
    with ThreadPoolExecutor(max_workers=8) as pool:

        def burst() -> bool:
            nonlocal made
            statuses = list(pool.map(lambda _: get(f"{gunicorn}/healthz")[0], range(16)))
            assert statuses == [200] * 16
            made += 16
            return len(worker_pids_with_samples(multiproc_dir)) >= 2

        wait_until(burst, 30, message="both workers to serve requests")

    # Every scrape, whichever worker answers it, sees the requests of both workers.
    for _ in range(6):
        status, body = get(f"{gunicorn}/metrics")
        assert status == 200
        assert healthz_count(body.decode()) == before + made
    assert b"django_http_requests_latency_seconds_by_view_method_bucket" in body
