"""Names no producer of ours makes, met in Redis on a 3-master Redis Cluster: they spoil nothing else.

A queue name that is empty or starts with "}" gives its keys an empty hash tag, so they hash
apart: a call that takes them together is refused before it is sent (RedisClusterException).
"""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

pytestmark = [pytest.mark.chaos, pytest.mark.django_db(transaction=True)]

SPLIT_NAMES = ["", "}x"]  # every key of such a queue lies in a slot of its own


@pytest.mark.timeout(60)
def test_queue_counts_of_foreign_queue_names_are_read_on_a_cluster(cluster_broker):
    broker = cluster_broker
    broker.client.sadd(broker.keys.queues(), "default", *SPLIT_NAMES)
    broker.client.lpush(broker.keys.pending("}x"), b"not a task")
    broker.client.zadd(broker.keys.dead("}x"), {b"dead": 1})

    stats = broker.inspect.queue_stats("}x")
    assert (stats.pending, stats.dead) == (1, 1)
    assert broker.inspect.completed_last_minute("}x") == 0
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    assert sorted(row["queue"] for row in json.loads(out.getvalue())["queues"]) == sorted(["default", *SPLIT_NAMES])


@pytest.mark.timeout(60)
def test_a_record_naming_a_foreign_queue_spoils_no_other_cancel_on_a_cluster(cluster_broker):
    broker = cluster_broker
    broker.client.hset(broker.keys.result("waiting"), mapping={"status": "READY", "queue": "}x", "unique_digest": "d"})
    broker.client.hset(broker.keys.result("foreign"), mapping={"status": "RUNNING", "queue": "}x"})
    broker.client.hset(broker.keys.result("ours"), mapping={"status": "RUNNING", "queue": "default"})

    replies = broker.control.cancel_many(["waiting", "foreign", "ours"], force=True)

    assert [reply.outcome for reply in replies] == ["cancelled", "requested", "requested"]
    assert broker.control.cancel_marks("default", ["ours"]) == [2]  # its consumer is told, and stops it
