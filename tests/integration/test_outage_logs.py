"""A Redis outage under a running consumer: every failure counted, each loop's outage logged once, and its end."""

from pathlib import Path

import pytest

from tasks_app.protocol.broker import Broker
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.ports import free_port
from tests.support.processes import wait_until
from tests.support.scrape import scrape

pytestmark = pytest.mark.django_db(transaction=True)

ERRORS = "taskqueue_redis_errors_total"


def heartbeat_errors(url: str) -> float:
    """The heartbeat's Redis errors the consumer counted (-1 while its metrics do not answer)."""
    scraped = scrape(url)
    return scraped.value(ERRORS, loop="heartbeat") if scraped else -1


def test_an_outage_is_logged_once_per_loop_while_every_error_is_counted_and_its_end_once(
    tmp_path: Path, key_prefix, consumer_process
):
    # Before: every heartbeat (each sixth of the lease) and every backoff of every loop logged a line.
    server = RedisServer(tmp_path).start()
    try:
        private = Broker(connect(server.url), key_prefix)
        port = free_port()
        consumer = consumer_process("--lease", "2", "--metrics-port", str(port), REDIS_URL=server.url)
        url = f"http://127.0.0.1:{port}/metrics"
        wait_until(lambda: private.inspect.queue_stats("default").consumers, 30, message="the consumer to register")
        server.kill()
        wait_until(
            lambda: heartbeat_errors(url) >= 6,
            60,
            message=lambda: f"six failed renewals (counted: {heartbeat_errors(url)}); log:\n{consumer.log()}",
        )
        server.start()
        wait_until(lambda: "heartbeat: works again" in consumer.log(), 30, message="the renewal after the outage")
        log = consumer.log()
        assert log.count("heartbeat: redis error") == 1, log
        assert log.count("scheduler: redis error") == 1, log
        assert log.count("heartbeat: works again") == 1, log
        assert consumer.terminate(timeout_s=30) == 0, consumer.log()
    finally:
        server.remove()
