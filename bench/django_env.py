"""Point this process (and the consumers it starts) at a private Redis and a throwaway SQLite DB."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from support import ROOT

PREFIX = "bench"


# The Redis URL and DB directory of this process's set-up: Django, once set up, keeps its first DATABASES.
_set_up: tuple[str, Path] | None = None


def setup(redis_url: str) -> Path:
    """Set the environment, start Django, migrate a fresh SQLite DB (once per process); return its directory."""
    global _set_up
    if _set_up is not None:
        first_url, db_dir = _set_up
        if first_url != redis_url:
            raise RuntimeError(f"Django is already set up for {first_url}, not {redis_url}: one Redis per process")
        return db_dir
    db_dir = Path(tempfile.mkdtemp(prefix="bench-db-"))
    _set_up = (redis_url, db_dir)
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "scheduler_site.settings",
            "REDIS_URL": redis_url,
            "TASKS_KEY_PREFIX": PREFIX,
            "DATABASE_URL": f"sqlite:///{db_dir / 'bench.sqlite3'}",
            "TASK_HANDLER_MODULES": "bench.handlers",
            "BENCH_REDIS_URL": redis_url,
        }
    )
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    return db_dir


def runconsumer_argv(*args: str) -> list[str]:
    """The command line of one `manage.py runconsumer` with this Python (and BENCH_CONSUMER_ARGS, split on spaces)."""
    extra = os.environ.get("BENCH_CONSUMER_ARGS", "").split()  # e.g. "--concurrency 2 --prefetch 128"
    return [sys.executable, str(ROOT / "manage.py"), "runconsumer", *args, *extra]
