"""Shared start-up of a peer driver: import paths and the environment its worker needs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
PEERS_DIR = BENCH_DIR / "peers"
APPS_DIR = PEERS_DIR / "apps"


def prepare(redis_url: str) -> dict[str, str]:
    """Make the bench modules and peer apps importable here and in workers; return the worker env."""
    for path in (str(BENCH_DIR), str(APPS_DIR)):
        if path not in sys.path:
            sys.path.insert(0, path)
    env = {"BENCH_REDIS_URL": redis_url, "PYTHONPATH": f"{BENCH_DIR}:{APPS_DIR}", "PYTHONUNBUFFERED": "1"}
    os.environ.update(env)
    return env


def bin_path(name: str) -> str:
    """The path of a console script installed in this virtualenv."""
    return str(Path(sys.executable).parent / name)
