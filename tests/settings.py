"""Settings of a test run: the site's own, with a secret key of this run (consumer subprocesses inherit it)."""

import os
import secrets

os.environ.setdefault("DJANGO_SECRET_KEY", f"test-run-{secrets.token_urlsafe(32)}")

from scheduler_site.settings import *  # noqa: F403

# The demo handlers (`demo.echo`, ...) are examples, enabled here as `make run` enables them.
TASK_HANDLER_MODULES = [*TASK_HANDLER_MODULES, "examples.handlers"]  # noqa: F405
