"""Real `manage.py runconsumer` subprocesses for tests that kill, freeze or signal them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.db import connection

PROJECT_DIR = Path(__file__).resolve().parents[2]


def consumer_env(prefix: str, **extra: str) -> dict[str, str]:
    """Environment for a consumer subprocess sharing this test's Redis prefix and database."""
    env = dict(os.environ)
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        database_url = f"sqlite:///{db['NAME']}"
    else:
        database_url = (
            f"postgres://{db['USER'] or ''}:{db['PASSWORD'] or ''}@{db['HOST'] or '127.0.0.1'}:"
            f"{db['PORT'] or 5432}/{db['NAME']}"
        )
    env.update(
        {
            "DATABASE_URL": database_url,
            "REDIS_URL": settings.REDIS_URL,
            "REDIS_CLUSTER": "1" if settings.REDIS_CLUSTER else "0",
            "TASKS_KEY_PREFIX": prefix,
            "TASK_HANDLER_MODULES": "tests.support.handlers",
            "TASKS_CONFIG_REFRESH_S": str(settings.TASKS_CONFIG_REFRESH_S),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "WARNING",
        }
    )
    env.update(extra)
    return env


class ConsumerProcess:
    """A `runconsumer` subprocess; stop it gracefully, kill it, freeze it."""

    def __init__(self, prefix: str, *args: str, log_dir: Path, name: str = "consumer", **env: str) -> None:
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(PROJECT_DIR / "manage.py"), "runconsumer", *args],
                cwd=PROJECT_DIR,
                env=consumer_env(prefix, **env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a test can kill the group as a supervisor would
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the whole process group (the consumer and anything it started), and reap the process."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM, wait for the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Make sure the process is gone (used at teardown)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.kill()


def wait_until(
    condition: Callable[[], object],
    timeout_s: float,
    interval_s: float = 0.05,
    message: str | Callable[[], str] = "condition",
) -> object:
    """Poll `condition` until it is truthy; fail the test after `timeout_s` (`message` may be a callable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            waited_for = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout_s} s waiting for {waited_for}")
        time.sleep(interval_s)
