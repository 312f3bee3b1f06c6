"""A script re-run by source after NOSCRIPT that meets a passing server state is sent again, not refused."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from tasks_app.consumer.ack_batcher import AckBatcher
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import Task
from tests.chaos.servers import RedisServer
from tests.support.claims import running

pytestmark = pytest.mark.django_db

ENDLESS_SCRIPT = "while true do end"


class BusyOnFirstEval(redis.Redis):
    """A client whose first EVAL (a NOSCRIPT re-run) meets another connection's script running past the limit."""

    armed = False  # set: the next EVAL meets Redis BUSY

    def eval(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if not self.armed:
            return super().eval(*args, **kwargs)
        self.armed = False
        other = redis.Redis(connection_pool=redis.ConnectionPool(**self.connection_pool.connection_kwargs))
        endless = threading.Thread(target=_run_until_killed, args=(other,))
        endless.start()
        try:
            _wait_busy(self)
            return super().eval(*args, **kwargs)
        finally:
            self.script_kill()
            endless.join()


def _run_until_killed(client: redis.Redis) -> None:
    with contextlib.suppress(redis.ResponseError):  # killed
        client.eval(ENDLESS_SCRIPT, 0)


def _wait_busy(client: redis.Redis) -> None:
    while True:
        try:
            client.ping()
        except redis.ResponseError as exc:
            if str(exc).startswith("BUSY"):
                return


def test_a_run_whose_record_rerun_meets_a_busy_server_is_recorded_as_it_ended(tmp_path: Path):
    # A fresh server has no scripts: the ack flush's record write and ack answer NOSCRIPT and are
    # re-run by source, the record's while another client's script keeps Redis BUSY. That passes:
    # the flush is sent again, and the run's success is recorded, not a failure to store it.
    server = RedisServer(tmp_path, "--busy-reply-threshold", "10").start()
    try:
        client = BusyOnFirstEval.from_url(server.url)
        broker = Broker(client, "P")
        task, raw, fence = running(broker, Task(id="busy-1", type="demo.echo", queue="q"))
        client.script_flush()
        client.armed = True

        batcher = AckBatcher(broker, threading.Event())
        outcome: list[bool | None] = []
        batcher.ack("q", "c1", raw, records.succeeded(task, '"done"', 5, 60, fence, 0.1), outcome.append)
        assert batcher.flush_once(block_s=0.1) == 1

        assert not client.armed
        assert outcome == [True] and client.llen(broker.keys.processing("q", "c1")) == 0
        record = broker.records.get_result(task.id)
        assert (record["status"], record["return_value"]) == (records.SUCCESSFUL, '"done"')
    finally:
        server.remove()
