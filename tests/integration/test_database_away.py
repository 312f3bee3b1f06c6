"""A real consumer whose database cannot give it the task types: it claims nothing, then runs once it can."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.protocol.records import ResultRecord
from tests.support.ports import free_port
from tests.support.processes import PROJECT_DIR, consumer_env, wait_until
from tests.support.scrape import scrape

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_consumer_on_a_database_without_tables_claims_nothing_until_it_is_migrated(
    broker, consumer_process, key_prefix, tmp_path: Path
):
    # What `make bench` met: consumers pointed at a fresh SQLite file nobody had migrated.
    [task] = producer.enqueue("test.record")
    empty_db = f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    port = free_port()
    consumer = consumer_process(
        "--consumer-id", "c1", "--metrics-port", str(port), DATABASE_URL=empty_db, TASKS_CONFIG_REFRESH_S="0.5"
    )
    wait_until(lambda: "claiming nothing until then" in consumer.log(), 60, message="the consumer to say it waits")
    wait_until(lambda: broker.inspect.queue_stats("default").consumers, 30, message="the consumer to register")
    time.sleep(1.0)  # a few refreshes and claim loops later
    assert broker.client.llen(broker.keys.pending("default")) == 1, "claimed although nothing could run"
    assert broker.queue.held_by("default", "c1") == [] and broker.client.zcard(broker.keys.delayed("default")) == 0
    scraped = scrape(f"http://127.0.0.1:{port}/metrics")
    assert scraped and scraped.value("taskqueue_consumer_task_types_age_seconds") == float("inf")
    assert probe(port, "/healthz") == (200, False), "Redis answers: alive, not to be restarted"
    assert probe(port, "/readyz") == (503, False), "ready although it claims nothing"

    migrate = [sys.executable, str(PROJECT_DIR / "manage.py"), "migrate", "--noinput", "-v", "0"]
    subprocess.run(migrate, env=consumer_env(key_prefix, DATABASE_URL=empty_db), check=True, timeout=120)
    wait_until(
        lambda: ResultRecord.from_fields(broker.records.get_result(task.id) or {}).status == "SUCCESSFUL",
        30,
        message="the task to run once the task types can be read",
    )
    assert probe(port, "/readyz") == (200, True)
    assert consumer.terminate() == 0


def probe(port: int, path: str) -> tuple[int, bool]:
    """The status of the consumer's `path` and the `ready` of its JSON body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    return status, json.loads(body)["ready"]
