"""A consumer on many queues: a task on any of them starts at once while it idles, its threads and
connections do not grow with the queues, and its queues are served in the order given."""

import time
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.alone]

QUEUES = [f"wide{index}" for index in range(50)]
# A generous bound for one idle pick-up (a few ms on a quiet machine): before, tasks waited seconds.
PICK_UP_BOUND_MS = 50


def redis_now_ms(broker) -> float:
    seconds, micros = broker.client.time()
    return seconds * 1000 + micros / 1000


def test_a_task_on_each_of_fifty_queues_starts_at_once_on_an_idle_consumer_of_concurrency_two(broker, consumer_process):
    queue_args = [arg for queue in QUEUES for arg in ("--queue", queue)]
    consumer = consumer_process("--concurrency", "2", "--consumer-id", "wide", *queue_args)
    wait_until(
        lambda: len(broker.inspect.queue_stats(QUEUES[-1]).consumers) == 1, 30, message="the consumer to register"
    )
    time.sleep(3)  # idle past a blocking claim's timeout (2 s), so every queue's wait has cycled once
    assert_picked_up_at_once(broker, consumer, QUEUES)


def assert_picked_up_at_once(broker, consumer, queues: list[str]) -> None:
    """Enqueue a task on each queue in turn, each once the one before started: each starts within the bound."""
    waits_ms: dict[str, float] = {}
    for queue in queues:
        enqueued_ms = redis_now_ms(broker)
        (task,) = producer.enqueue("test.record", queue=queue)
        wait_until(
            lambda task=task: any(run["task_id"] == task.id for run in recorded_runs(broker)),
            10,
            message=lambda queue=queue: f"the task on {queue} to start ({consumer.log()})",
        )
        run = next(run for run in recorded_runs(broker) if run["task_id"] == task.id)
        waits_ms[queue] = run["start_ms"] - enqueued_ms
    late = {queue: round(wait_ms, 1) for queue, wait_ms in waits_ms.items() if wait_ms > PICK_UP_BOUND_MS}
    assert not late, f"tasks started more than {PICK_UP_BOUND_MS} ms after their enqueue: {late}"


def threads_of(pid: int) -> int:
    """The threads a process runs now."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def settled_footprint(consumer, client, queues: list[str]) -> tuple[int, int]:
    """(threads, Redis connections) of an idle consumer, once it registered on every queue and settled."""
    private = Broker(client, consumer.prefix)
    wait_until(
        lambda: all(private.inspect.queue_stats(queue).consumers for queue in (queues[0], queues[-1])),
        60,
        message=lambda: f"the consumer to register ({consumer.log()})",
    )
    time.sleep(3)  # past a blocking claim's timeout and every loop's first pass
    # Our own client holds one connection.
    return threads_of(consumer.pid), int(client.info("clients")["connected_clients"]) - 1


def test_threads_and_redis_connections_do_not_grow_with_the_queues(tmp_path: Path, key_prefix, consumer_process):
    server = RedisServer(tmp_path).start()
    try:
        client = connect(server.url)
        footprints = {}
        for count in (1, 200):
            queues = [f"many{index}" for index in range(count)]
            queue_args = [arg for queue in queues for arg in ("--queue", queue)]
            consumer = consumer_process("--concurrency", "2", *queue_args, REDIS_URL=server.url)
            consumer.prefix = key_prefix
            footprints[count] = settled_footprint(consumer, client, queues)
            assert consumer.terminate(timeout_s=60) == 0, consumer.log()
            wait_until(lambda: int(client.info("clients")["connected_clients"]) == 1, 10, message="its connections")
        # A connection pool opens what its threads use at once, so connections are bounded by threads.
        (threads_1, _), (threads_200, connections_200) = footprints[1], footprints[200]
        assert threads_200 == threads_1, f"(threads, connections) by queue count: {footprints}"
        assert connections_200 <= threads_1, f"(threads, connections) by queue count: {footprints}"
    finally:
        server.remove()


def test_a_higher_queue_drains_before_a_lower_one_starts(broker, consumer_process):
    for _ in range(20):
        producer.enqueue("test.record", kwargs={"from_queue": "low"}, queue="low")
        producer.enqueue("test.record", kwargs={"from_queue": "high"}, queue="high")
    consumer = consumer_process("--concurrency", "1", "--queue", "high", "--queue", "low")
    wait_until(lambda: len(recorded_runs(broker)) == 40, 60, message=lambda: f"every task to run ({consumer.log()})")
    order = [run["from_queue"] for run in recorded_runs(broker)]
    assert order == ["high"] * 20 + ["low"] * 20, order


def test_weighted_queues_share_the_claims_by_their_weights(broker, consumer_process):
    for _ in range(60):
        producer.enqueue("test.record", kwargs={"from_queue": "low"}, queue="low")
        producer.enqueue("test.record", kwargs={"from_queue": "high"}, queue="high")
    args = ["--concurrency", "1", "--prefetch", "0", "--queue", "low", "--queue", "high", "--weight", "high=3"]
    consumer = consumer_process(*args)
    wait_until(lambda: len(recorded_runs(broker)) >= 60, 60, message=lambda: f"60 tasks to run ({consumer.log()})")
    first = [run["from_queue"] for run in recorded_runs(broker)[:60]]
    # Each claim takes high first with odds 3 in 4: 45 of 60 expected, 0.55-0.95 is 3.5 deviations each way.
    assert 0.55 <= first.count("high") / 60 <= 0.95, first


def test_a_task_costs_one_claim_however_many_consumers_wait_on_its_queue(tmp_path: Path, key_prefix, consumer_process):
    # Redis tells every consumer that read a queue of a push to it: told so, each idle consumer claimed,
    # and a task cost a claim script per idle consumer. On one queue each, a blocking move hands it to one.
    server = RedisServer(tmp_path).start()
    try:
        client = connect(server.url)
        private = Broker(client, key_prefix)
        consumers = [consumer_process("--concurrency", "2", REDIS_URL=server.url) for _ in range(6)]
        wait_until(
            lambda: len(private.inspect.queue_stats("default").consumers) == len(consumers),
            60,
            message=lambda: "the consumers to register\n" + "\n".join(each.log() for each in consumers),
        )
        time.sleep(3)  # every loop past its first pass
        client.config_resetstat()
        tasks = []
        for _ in range(50):
            tasks += producer.enqueue("test.record", broker=private)
            time.sleep(0.01)
        wait_until(lambda: len(recorded_runs(private)) == len(tasks), 30, message="every task to run")
        scripts = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        # One consumer's task costs about six scripts in all (enqueue, claim, receipt, ack, ...).
        assert scripts / len(tasks) < 10, f"{scripts / len(tasks):.1f} scripts per task with {len(consumers)} waiting"
    finally:
        server.remove()
