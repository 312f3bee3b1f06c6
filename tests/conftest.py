"""Shared fixtures: a private key prefix per test, a broker, consumers in threads and processes."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

import tests.support.handlers  # noqa: F401  (registers the test handlers in this process)
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.models import TaskType
from tasks_app.protocol.broker import Broker, get_broker
from tasks_app.task_types import recent_task_types
from tests.support.consumers import running
from tests.support.processes import ConsumerProcess

pytest_plugins = ["tests.support.alone"]

ARTIFACTS_DIR = Path(__file__).resolve().parent.parent / "test-artifacts"


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    django_db_modify_db_settings_parallel_suffix: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Keep the SQLite test database in a file, so consumer subprocesses can share it.

    Under pytest-xdist each worker has a database of its own: pytest-django's suffix (`_gw0`, ...)
    names the PostgreSQL one, and the SQLite file lies in the worker's own temporary directory.
    """
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        db.setdefault("TEST", {})["NAME"] = str(tmp_path_factory.mktemp("db") / "test.sqlite3")


@pytest.fixture
def key_prefix(settings: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    recent_task_types.forget()  # rows of earlier tests are gone from the database
    settings.TASKS_KEY_PREFIX = prefix
    settings.TASKS_CONFIG_REFRESH_S = 0.5
    client = get_broker().client  # the test may point REDIS_URL elsewhere; clean up here
    yield prefix
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)


@pytest.fixture
def broker(key_prefix: str) -> Broker:
    """The broker for this test's prefix, on the Redis of REDIS_URL."""
    return get_broker()


@pytest.fixture
def consumer_in_thread(broker: Broker) -> Iterator[contextlib.AbstractContextManager[Consumer]]:
    """Factory of real consumers running in a thread of this process (stopped at exit)."""

    @contextlib.contextmanager
    def start(**options: object) -> Iterator[Consumer]:
        opts = {"lease_s": 2.0, "grace_s": 5.0, "block_s": 0.5, **options}
        with running(Consumer(ConsumerOptions(**opts), broker=broker)) as consumer:  # type: ignore[arg-type]
            yield consumer

    return start


@pytest.fixture
def consumer_process(key_prefix: str, tmp_path: Path) -> Iterator[type]:
    """Factory of `runconsumer` subprocesses on this test's prefix (killed at teardown)."""
    started: list[ConsumerProcess] = []

    def start(*args: str, **env: str) -> ConsumerProcess:
        process = ConsumerProcess(key_prefix, *args, log_dir=tmp_path, **env)
        started.append(process)
        return process

    yield start  # type: ignore[misc]
    for process in started:
        process.stop()


@pytest.fixture(scope="session", autouse=True)
def redis_up_for_a_while() -> None:
    """Wait until the test Redis has been up for 3 s.

    Reapers refuse to act until Redis has been up for a consumer's lease (so live consumers
    can renew after a restart); a Redis started just before the suite would otherwise make
    the first recovery tests wait for that guard.
    """
    import time

    from tasks_app.protocol.scripts import connect

    client = connect(settings.REDIS_URL, settings.REDIS_CLUSTER)
    uptime_s = int(client.info("server")["uptime_in_seconds"])
    if uptime_s < 3:
        time.sleep(3 - uptime_s)


@pytest.fixture
def staff(client: Client) -> Client:
    """The test client, logged in as a staff superuser."""
    user = get_user_model().objects.create_superuser("boss", "boss@example.com", None)
    client.force_login(user)
    return client


@pytest.fixture
def echo_type() -> TaskType:
    """A task type of the demo echo handler on the web queue."""
    return TaskType.objects.create(name="web.echo", handler="demo.echo", queue="web")
