"""Gunicorn settings for the web app, read from the project directory (`gunicorn scheduler_site.wsgi`).

Prometheus needs multiprocess mode under several workers: each worker writes its samples to files
in PROMETHEUS_MULTIPROC_DIR and `/metrics` (any worker) sums them. The directory is emptied when
the server starts, so counts of an earlier run never leak in, and a dead worker's live gauges are
dropped. Without PROMETHEUS_MULTIPROC_DIR a private directory is created for this server.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

wsgi_app = "scheduler_site.wsgi:application"
bind = [os.environ.get("GUNICORN_BIND", "0.0.0.0:8000")]
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
accesslog = "-"

# Must be in the environment before any worker imports prometheus_client.
_owns_multiproc_dir = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
if _owns_multiproc_dir:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="prometheus-multiproc-")
MULTIPROC_DIR = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])


def on_starting(server: Any) -> None:
    """Empty the multiprocess directory (it may be a volume kept from an earlier run)."""
    MULTIPROC_DIR.mkdir(parents=True, exist_ok=True)
    for entry in MULTIPROC_DIR.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def child_exit(server: Any, worker: Any) -> None:
    """Drop the live gauges of a worker that exited."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid, str(MULTIPROC_DIR))


def on_exit(server: Any) -> None:
    """Remove the directory if this server created it."""
    if _owns_multiproc_dir:
        shutil.rmtree(MULTIPROC_DIR, ignore_errors=True)
