"""Bulk enqueue against private Redis servers: all or nothing on one server, no duplicates on retry."""

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tasks_app.models import TaskType
from tasks_app.producer import QueueUnavailable, TaskRequest, enqueue_many
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.records import ResultUpdate
from tests.chaos.servers import RedisClusterServers, RedisServer
from tests.support.enqueued import waiting_count
from tests.support.midway import MovesMidway
from tests.support.proxy import RedisProxy

pytestmark = pytest.mark.django_db

PREFIX = "batch"


def requests(with_ids: bool = False, queues: tuple[str, str] = ("A", "B")) -> list[TaskRequest]:
    """1,000 tasks for queue A and 1,000 for queue B, some prioritized and some delayed."""
    made = []
    for queue in queues:
        for n in range(1000):
            made.append(
                TaskRequest(
                    "demo.echo",
                    [n, "x" * 100],
                    queue=queue,
                    priority=5 if n % 10 == 0 else 0,
                    delay_s=60 if n % 10 == 1 else 0,
                    task_id=f"{queue}-{n}" if with_ids else None,
                )
            )
    return made


def queued(broker: Broker, queue: str) -> int:
    keys = broker.keys
    woken = broker.client.lpos(keys.pending(queue), b"\x00wake") is not None
    return (
        broker.client.llen(keys.pending(queue))
        + broker.client.zcard(keys.prioritized(queue))
        + broker.client.zcard(keys.delayed(queue))
        - woken
    )


def waiting(client: redis.Redis) -> int:
    """READY records and waiting marks: one per waiting task."""
    return waiting_count(Broker(client, PREFIX))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.remove()


def test_a_batch_over_the_memory_limit_is_enqueued_entirely_or_not_at_all(server):
    client = redis.Redis.from_url(server.url)
    broker = Broker(client, PREFIX)
    enqueue_many(requests()[:10], broker=broker)  # load the scripts and announce A and B
    client.delete(*client.keys(f"{PREFIX}:*"))
    client.config_set("maxmemory-policy", "noeviction")
    # Room for the command (its arguments count) and a few batches: batches are enqueued until
    # one starts over the limit, and the one that crosses it must be whole.
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 3_000_000)
    outcomes = []
    while "refused" not in outcomes and len(outcomes) < 20:
        before = (queued(broker, "A"), queued(broker, "B"), waiting(client))
        try:
            enqueue_many(requests(), broker=broker)
            refusal = None
        except QueueUnavailable as exc:
            refusal = str(exc)
        after = (queued(broker, "A"), queued(broker, "B"), waiting(client))
        if refusal is None:
            outcomes.append("enqueued")
            assert after == (before[0] + 1000, before[1] + 1000, before[2] + 2000)
        else:
            assert "maxmemory" in refusal
            outcomes.append("refused")
            assert after == before
    assert outcomes[0] == "enqueued" and outcomes[-1] == "refused"


def test_a_retry_with_the_same_ids_does_not_push_them_twice(server):
    broker = Broker(redis.Redis.from_url(server.url), PREFIX)
    enqueue_many(requests(with_ids=True), broker=broker)
    enqueue_many(requests(with_ids=True)[500:1500], broker=broker)
    assert (queued(broker, "A"), queued(broker, "B")) == (1000, 1000)
    enqueue_many(
        [TaskRequest("demo.echo", queue="A"), TaskRequest("demo.echo", queue="A", task_id="new")] * 2, broker=broker
    )
    assert queued(broker, "A") == 1003  # ids given once are pushed once; generated ones always


def test_on_a_cluster_a_partial_enqueue_is_completed_by_a_retry_without_duplicates(tmp_path, settings):
    settings.REDIS_CLUSTER = True
    cluster = RedisClusterServers(tmp_path).start()
    try:
        client = redis.RedisCluster.from_url(cluster.url)
        broker = Broker(client, PREFIX)
        a_port = client.get_node_from_key(broker.keys.pending("A")).port
        b_queue = next(q for q in "BCDEFGHIJK" if client.get_node_from_key(broker.keys.pending(q)).port != a_port)
        b_node = client.get_node_from_key(broker.keys.pending(b_queue))
        batch = requests(with_ids=True, queues=("A", b_queue))
        # Scripts cached on every node: each node's calls then answer in place (a re-run by source
        # meeting B's refusal would raise before A's re-runs, and nothing would be enqueued at all).
        for source in broker.scripts.sources.values():
            client.script_load(source)
        b_server = redis.Redis(port=b_node.port)
        b_server.config_set("maxmemory-policy", "noeviction")
        b_server.config_set("maxmemory", 1)  # B's node refuses every write
        with pytest.raises(QueueUnavailable, match="some may be enqueued"):
            enqueue_many(batch, broker=broker)
        # A's tasks are pushed but those whose id's record lies on B's node: an id not claimed is not pushed.
        assert 0 < queued(broker, "A") < 1000 and queued(broker, b_queue) == 0
        b_server.config_set("maxmemory", 0)
        enqueue_many(batch, broker=broker)
        assert (queued(broker, "A"), queued(broker, b_queue)) == (1000, 1000)
        assert broker.records.get_result(f"{b_queue}-7")["status"] == "READY"
        assert broker.records.get_result("A-7")["status"] == "READY"
    finally:
        cluster.remove()


@pytest.mark.parametrize("cut_before_round_trip", [0, 1, 2])
def test_a_batch_with_unique_tasks_is_enqueued_whole_or_not_at_all_when_redis_goes_away(server, cut_before_round_trip):
    TaskType.objects.create(name="unique.echo", handler="demo.echo", unique_for_s=600)
    proxy = RedisProxy(server.port)
    try:
        client = MovesMidway(redis.Redis.from_url(proxy.url), proxy.cut, before=cut_before_round_trip)
        batch = [TaskRequest("demo.echo", [1]), TaskRequest("unique.echo", [2]), TaskRequest("demo.echo", [3])]
        try:
            enqueue_many(batch, broker=Broker(client, PREFIX))
            outcome = "enqueued"
        except QueueUnavailable:
            outcome = "refused"
    finally:
        proxy.close()
    direct = Broker(redis.Redis.from_url(server.url), PREFIX)
    pushed = (queued(direct, "default"), waiting(direct.client))
    assert (outcome, pushed) in {("enqueued", (3, 3)), ("refused", (0, 0))}


def echo(n: int, task_id: str, type_name: str = "demo.echo", **options: object) -> TaskRequest:
    return TaskRequest(type_name, [n], task_id=task_id, **{"queue": "A", **options})  # type: ignore[arg-type]


def started(broker: Broker, task_id: str) -> dict[str, str]:
    """Write a run's start to a task's record, as its consumer would; return the record as it then reads."""
    broker.records.record_result(
        ResultUpdate(task_id, {"status": "RUNNING", "attempts": "1"}, 60, fence=broker.queue.issue_fence("A"))
    )
    return broker.records.get_result(task_id)


@pytest.mark.parametrize("options", [{}, {"priority": 5}, {"delay_s": 60}])
def test_one_caller_id_given_to_two_requests_of_a_call_pushes_and_records_the_first(broker, options):
    first, second, other = enqueue_many(
        [echo(1, "twice", **options), echo(2, "twice", **options), TaskRequest("demo.echo", [3], queue="A")],
        broker=broker,
    )
    assert (first.duplicate, second.duplicate, second.id, other.duplicate) == (False, True, "twice", False)
    assert queued(broker, "A") == 2
    assert broker.records.get_result("twice")["args"] == "[1]"
    assert broker.records.get_result(other.id)["status"] == "READY"  # its mark


def test_repeated_ids_of_interleaved_queues_keep_the_first_records(broker):
    """The records follow the sections' order, which is not the call's when its queues interleave."""
    in_b = {"queue": "B", "priority": 3}
    enqueued = enqueue_many(
        [echo(1, "x"), echo(1, "y", **in_b), echo(9, "z"), echo(2, "y", **in_b), echo(2, "x"), echo(1, "w", **in_b)],
        broker=broker,
    )
    assert [task.duplicate for task in enqueued] == [False, False, False, True, True, False]
    assert [broker.records.get_result(task_id)["args"] for task_id in "xyzw"] == ["[1]", "[1]", "[9]", "[1]"]
    assert (queued(broker, "A"), queued(broker, "B")) == (2, 2)


def test_a_retried_request_leaves_the_record_of_its_task_alone(broker):
    [task] = enqueue_many([echo(1, "again")], broker=broker)
    running = started(broker, "again")
    [retry] = enqueue_many([echo(2, "again"), TaskRequest("demo.echo", queue="A")], broker=broker)[:1]
    assert (retry.duplicate, retry.id) == (True, task.id)
    assert broker.records.get_result("again") == running
    assert queued(broker, "A") == 2


def test_on_a_cluster_a_retried_request_leaves_the_record_of_its_task_alone(tmp_path, settings):
    """A record lies in another slot than its queue: it is written beside the push, before the id check."""
    settings.REDIS_CLUSTER = True
    TaskType.objects.create(name="unique.echo", handler="demo.echo", unique_for_s=600)
    cluster = RedisClusterServers(tmp_path).start()
    try:
        broker = Broker(redis.RedisCluster.from_url(cluster.url), PREFIX)
        for type_name in ("demo.echo", "unique.echo"):
            task_id = f"{type_name}-1"
            first, second = enqueue_many([echo(1, task_id, type_name), echo(2, task_id, type_name)], broker=broker)
            assert (first.duplicate, second.duplicate, second.id) == (False, True, task_id)
            assert broker.records.get_result(task_id)["args"] == "[1]"
            running = started(broker, task_id)
            [retry] = enqueue_many([echo(3, task_id, type_name)], broker=broker)
            assert (retry.duplicate, retry.id) == (True, task_id)
            assert broker.records.get_result(task_id) == running
        assert queued(broker, "A") == 2
    finally:
        cluster.remove()


@pytest.fixture(params=["server", "cluster"])
def any_broker(request, broker, tmp_path, settings) -> Iterator[Broker]:
    """A broker on the shared Redis server, or on a private 3-master Redis Cluster."""
    if request.param == "server":
        yield broker
        return
    settings.REDIS_CLUSTER = True
    cluster = RedisClusterServers(tmp_path).start()
    try:
        yield Broker(redis.RedisCluster.from_url(cluster.url), PREFIX)
    finally:
        cluster.remove()


def test_a_caller_id_whose_record_names_another_queue_is_taken(any_broker):
    """A task's record is global by id: an id in use in one queue is a duplicate in any other, nothing written."""
    broker = any_broker
    TaskType.objects.create(name="unique.echo", handler="demo.echo", unique_for_s=600)
    in_b = 0
    for type_name, options, beside in itertools.product(
        ["demo.echo", "unique.echo"], [{}, {"priority": 5}, {"delay_s": 60}], [False, True]
    ):
        task_id = f"mine-{type_name}-{len(options) and next(iter(options))}-{beside}"
        enqueue_many([echo(1, task_id)], broker=broker)
        record = started(broker, task_id)
        batch = [echo(2, task_id, type_name, queue="B", **options)]
        batch += [TaskRequest("demo.echo", [3], queue="B")] if beside else []
        again = enqueue_many(batch, broker=broker)[0]
        in_b += beside
        assert (again.duplicate, again.id) == (True, task_id)
        assert broker.records.get_result(task_id) == record
        assert queued(broker, "B") == in_b


def test_one_caller_id_given_to_two_unique_requests_records_the_task_pushed(any_broker):
    broker = any_broker
    TaskType.objects.create(name="unique.echo", handler="demo.echo", unique_for_s=600)
    enqueue_many([echo(1, "holder", "unique.echo")], broker=broker)
    # The first is a duplicate of the holder, the second is pushed: the record is the second's.
    first, second = enqueue_many(
        [echo(1, "twice", "unique.echo"), echo(2, "twice", "unique.echo", priority=5)], broker=broker
    )
    assert (first.duplicate, first.id, second.duplicate) == (True, "holder", False)
    assert {k: v for k, v in broker.records.get_result("twice").items() if k in ("args", "priority")} == {
        "args": "[2]",
        "priority": "5",
    }
    # Both duplicates of the holder: no record; the first pushed: its record, the second a duplicate of it.
    assert [t.id for t in enqueue_many([echo(1, "none", "unique.echo")] * 2, broker=broker)] == ["holder"] * 2
    assert broker.records.get_result("none") is None
    first, second = enqueue_many([echo(3, "first", "unique.echo"), echo(1, "first", "unique.echo")], broker=broker)
    assert (first.duplicate, second.duplicate, second.id) == (False, True, "first")
    assert broker.records.get_result("first")["args"] == "[3]"
    assert queued(broker, "A") == 3


def test_a_caller_id_whose_record_key_holds_another_type_is_still_pushed(broker):
    broker.client.set(broker.keys.result("odd"), "not a hash")
    [task] = enqueue_many([echo(1, "odd", queue="B")], broker=broker)
    assert not task.duplicate and queued(broker, "B") == 1
