"""Each consumer settles under the instance token it registered, whatever broker it was given."""

from __future__ import annotations

import json
import time

import pytest

from tasks_app import producer
from tests.support.handlers import runs_key

pytestmark = pytest.mark.django_db(transaction=True)


def test_consumers_given_one_broker_each_settle_under_their_own_token(broker, consumer_in_thread, caplog):
    # Each consumer registers a token of its own with its settles; one broker shared by two carried
    # only the last one's, so the other's settles found their tasks "no longer held" and they ran again.
    count = 120
    with (
        consumer_in_thread(queues=["q"], consumer_id="a", concurrency=4),
        consumer_in_thread(queues=["q"], consumer_id="b", concurrency=4),
    ):
        producer.enqueue("test.record", kwargs={"sleep_s": 0.01}, queue="q", count=count, broker=broker)
        deadline = time.monotonic() + 30
        while broker.client.llen(runs_key()) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a run a lost settle would bring back
    runs = [json.loads(line)["task_id"] for line in broker.client.lrange(runs_key(), 0, -1)]
    assert len(runs) == len(set(runs)) == count
    assert not [m for m in caplog.messages if "no longer held" in m]
