"""Point this process (and the consumers it starts) at a private Redis and a throwaway SQLite DB."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from support import ROOT

PREFIX = "bench"


_db_dirs: dict[str, Path] = {}  # one migrated DB per process: Django, once set up, keeps its first DATABASES


def setup(redis_url: str) -> Path:
    """Set the environment, start Django, migrate a fresh SQLite DB (once per process); return its directory."""
    if _db_dirs:
        [(first_url, db_dir)] = _db_dirs.items()
        if first_url != redis_url:
            raise RuntimeError(f"Django is already set up for {first_url}, not {redis_url}: one Redis per process")
        return db_dir
    db_dir = _db_dirs[redis_url] = Path(tempfile.mkdtemp(prefix="bench-db-"))
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
    """The command line of one `manage.py runconsumer` with this Python."""
    return [sys.executable, str(ROOT / "manage.py"), "runconsumer", *args]
