"""Crash recovery, long tasks, graceful shutdown and backpressure with real consumer processes."""

import signal
import threading
import time
from pathlib import Path

import pytest

from tasks_app import producer
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import decode_task, encode_arguments, payload_of
from tasks_app.protocol.enqueue import Enqueueable
from tasks_app.protocol.records import ResultRecord
from tasks_app.protocol.scripts import connect
from tests.chaos.servers import RedisServer
from tests.support.claims import task_bytes
from tests.support.consumers import running
from tests.support.ports import free_port
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs, runs_per_task

pytestmark = pytest.mark.django_db(transaction=True)


def statuses(broker, tasks) -> list[str]:
    return [ResultRecord.from_fields(broker.records.get_result(t.id) or {}).status for t in tasks]


def test_kill_9_mid_batch_loses_nothing_and_duplicates_only_what_the_dead_one_held(broker, consumer_process):
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 0.1}, count=60)
    victim = consumer_process("--consumer-id", "victim", "--lease", "1.5", "--concurrency", "4", "--prefetch", "2")
    wait_until(lambda: len(recorded_runs(broker)) >= 10, 30, message="the victim to start working")
    victim.signal(signal.SIGSTOP)  # freeze it so the snapshot is exactly what it holds when it dies
    held = {decode_task(raw).id for raw in broker.client.lrange(broker.keys.processing("default", "victim"), 0, -1)}
    victim.kill()
    assert held, "the victim held tasks when it died"

    survivor = consumer_process("--burst", "--lease", "1.5", "--concurrency", "4")
    assert survivor.wait(60) == 0, survivor.log()

    assert statuses(broker, tasks) == ["SUCCESSFUL"] * len(tasks)
    runs = runs_per_task(broker)
    assert set(runs) == {t.id for t in tasks}, "nothing lost"
    duplicated = {task_id for task_id, count in runs.items() if count > 1}
    assert duplicated <= held, "only tasks held by the dead consumer ran twice"
    assert max(runs.values()) <= 2


def test_a_task_running_longer_than_three_leases_on_a_live_consumer_runs_once(broker, consumer_process):
    [task] = producer.enqueue("test.record", kwargs={"sleep_s": 3.5})
    runner = consumer_process("--lease", "1", "--concurrency", "2")
    watcher = consumer_process("--lease", "1", "--concurrency", "2")  # its reaper looks at the runner
    wait_until(lambda: statuses(broker, [task]) == ["SUCCESSFUL"], 30, message="the long task to finish")
    assert runs_per_task(broker)[task.id] == 1
    for process in (runner, watcher):
        assert process.terminate() == 0


def test_sigterm_finishes_in_flight_tasks_and_returns_unstarted_ones(broker, consumer_process):
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 1.0}, count=12)
    consumer = consumer_process("--consumer-id", "graceful", "--concurrency", "2", "--prefetch", "4", "--grace", "20")
    wait_until(lambda: len(recorded_runs(broker)) >= 2, 30, message="two tasks to start")
    assert consumer.terminate(timeout_s=30) == 0, consumer.log()

    started = runs_per_task(broker)
    assert all(count == 1 for count in started.values())
    finished = [t for t in tasks if statuses(broker, [t]) == ["SUCCESSFUL"]]
    assert {t.id for t in finished} == set(started), "every started task finished, once"
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing, stats.consumers) == (len(tasks) - len(started), 0, [])
    # The unstarted tasks went back to the head of pending: the oldest runs first next time.
    next_up = decode_task(broker.client.lindex(broker.keys.pending("default"), -1)).id
    unstarted = [t.id for t in tasks if t.id not in started]
    assert next_up == unstarted[0]


def test_sigterm_while_redis_is_down_exits_within_the_grace_period_leaving_the_tasks_to_the_lease(
    tmp_path: Path, key_prefix, consumer_process
):
    # Before: the stop retried returning its prefetched tasks until Redis came back, for good.
    server = RedisServer(tmp_path, "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        private = Broker(connect(server.url), key_prefix)
        slow = payload_of(*encode_arguments([], {"sleep_s": 3.0}))  # the one running outlasts the grace period
        raws = [task_bytes(f"t{n}", queue="default", payload=slow) for n in range(6)]
        private.enqueuer.enqueue([Enqueueable(queue="default", raw=raw) for raw in raws], result_ttl_s=60)
        args = ("--consumer-id", "cut-off", "--concurrency", "1", "--prefetch", "4", "--grace", "1")
        consumer = consumer_process(*args, REDIS_URL=server.url)
        processing = private.keys.processing("default", "cut-off")
        wait_until(lambda: private.client.llen(processing) == 5 and recorded_runs(private), 30, message="a full hand")
        server.kill()
        assert consumer.terminate(timeout_s=30) == 0, consumer.log()
        server.start()
        assert private.client.llen(processing) == 5, "nothing lost: what it held waits in its list"
        assert private.client.llen(private.keys.pending("default")) == 1
        assert private.client.zscore(private.keys.consumers("default"), "cut-off") is not None, "for the reapers"
    finally:
        server.remove()


def test_sigterm_before_redis_was_ever_reached_exits_0(consumer_process):
    # Before: the start retried registering until Redis answered, whatever signal came meanwhile.
    consumer = consumer_process("--lease", "2", REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    wait_until(lambda: "redis error during register" in consumer.log(), 60, message="the consumer to retry")
    assert consumer.terminate(timeout_s=20) == 0, consumer.log()
    assert "stopped before it could register" in consumer.log()


def test_a_consumer_never_holds_more_than_concurrency_plus_prefetch(broker, consumer_process):
    producer.enqueue("test.record", kwargs={"sleep_s": 0.05}, count=80)
    consumer = consumer_process("--consumer-id", "bounded", "--burst", "--concurrency", "2", "--prefetch", "1")
    key = broker.keys.processing("default", "bounded")
    most_held = 0
    while consumer.process.poll() is None:
        most_held = max(most_held, broker.client.llen(key))
        time.sleep(0.005)
    assert consumer.wait(10) == 0, consumer.log()
    assert 1 <= most_held <= 3
    assert len(runs_per_task(broker)) == 80


def test_bad_input_is_dead_lettered_and_the_consumer_carries_on(broker, consumer_process):
    from tasks_app.models import TaskType
    from tasks_app.protocol.codec import Task, encode_task
    from tasks_app.protocol.enqueue import Enqueueable

    TaskType.objects.create(name="needs.missing.module", handler="broken.handler")
    foreign = [
        b"\xff\xfe garbage",
        encode_task(Task(id="unknown-1", type="no.such.type", queue="default")),
        encode_task(Task(id="broken-1", type="needs.missing.module", queue="default")),
        encode_task(Task(id="badpayload-1", type="test.record", queue="default", payload=b"[not json")),
    ]
    broker.enqueuer.enqueue([Enqueueable(queue="default", raw=raw) for raw in foreign], result_ttl_s=60)
    good = producer.enqueue("test.record", count=20)
    consumer = consumer_process(
        "--burst", "--concurrency", "2", TASK_HANDLER_MODULES="tests.support.handlers,tests.support.broken_handlers"
    )
    assert consumer.wait(60) == 0, consumer.log()

    assert statuses(broker, good) == ["SUCCESSFUL"] * 20
    dead = {}
    for raw, _ in broker.inspect.list_dead("default"):
        task = decode_task(raw)
        dead[task.id if task.type != "_undecodable" else "garbage"] = task
    assert set(dead) == {"garbage", "unknown-1", "broken-1", "badpayload-1"}
    assert dead["garbage"].payload == b"\xff\xfe garbage"
    assert "undecodable" in dead["garbage"].dead_reason
    assert "unknown task type 'no.such.type'" in dead["unknown-1"].dead_reason
    assert "broken.handler" in dead["broken-1"].dead_reason
    assert "simulated: a dependency" in dead["broken-1"].dead_reason
    assert "not UTF-8 JSON" in dead["badpayload-1"].dead_reason
    assert ResultRecord.from_fields(broker.records.get_result("unknown-1")).status == "FAILED"


def test_a_signal_echo_is_not_a_second_signal_but_a_later_one_exits_at_once(broker, consumer_process):
    [task] = producer.enqueue("test.record", kwargs={"sleep_s": 3.0})
    consumer = consumer_process("--grace", "20")
    wait_until(lambda: recorded_runs(broker), 30, message="the slow task to start")
    consumer.signal(signal.SIGINT)  # Ctrl-C reaches the whole process group...
    consumer.signal(signal.SIGTERM)  # ...and the supervisor forwards it too
    assert consumer.wait(30) == 0, consumer.log()
    assert statuses(broker, [task]) == ["SUCCESSFUL"]

    [slow] = producer.enqueue("test.record", kwargs={"sleep_s": 30.0})
    impatient = consumer_process("--grace", "60", "--consumer-id", "impatient", "--lease", "1")
    wait_until(lambda: slow.id in runs_per_task(broker), 30, message="the second slow task to start")
    impatient.signal(signal.SIGTERM)
    time.sleep(1.5)
    impatient.signal(signal.SIGTERM)
    assert impatient.wait(10) == 1
    assert "second signal" in impatient.log()


def test_sighup_stops_a_consumer_gracefully_and_sigquit_at_once(broker, consumer_process):
    # Before: both had their default action, so a closed terminal or Ctrl-\ killed the consumer mid-run.
    [task] = producer.enqueue("test.record", kwargs={"sleep_s": 2.0})
    consumer = consumer_process("--grace", "20")
    wait_until(lambda: recorded_runs(broker), 30, message="the slow task to start")
    consumer.signal(signal.SIGHUP)
    assert consumer.wait(30) == 0, consumer.log()
    assert statuses(broker, [task]) == ["SUCCESSFUL"]

    [held] = producer.enqueue("test.record", kwargs={"hold_until": "never"})
    quitting = consumer_process("--grace", "60", "--consumer-id", "quitting", "--lease", "1")
    wait_until(lambda: held.id in runs_per_task(broker), 30, message="the held task to start")
    quitting.signal(signal.SIGQUIT)
    assert quitting.wait(10) == 1, quitting.log()
    assert "SIGQUIT" in quitting.log() and statuses(broker, [held]) != ["SUCCESSFUL"]


class PreemptedAfterReading(threading.Event):
    """A stop event whose first read by a worker thread that finds it clear is preempted: it sleeps before returning."""

    def __init__(self) -> None:
        super().__init__()
        self.preempted = threading.Event()

    def is_set(self) -> bool:
        value = super().is_set()
        if not value and threading.current_thread().name.startswith("worker-") and not self.preempted.is_set():
            self.preempted.set()
            time.sleep(1.0)
        return value


def test_a_task_a_worker_starts_as_the_stop_begins_is_waited_for_and_not_returned(broker):
    # Before: a worker that found the stop not begun, then lost the CPU before counting itself
    # busy, was not waited for: the stop went on, returned its task to pending and it ran twice.
    [task] = producer.enqueue("test.record", kwargs={"sleep_s": 0.2})
    consumer = Consumer(ConsumerOptions(concurrency=1, prefetch=0, lease_s=2, block_s=0.5), broker=broker)
    consumer.claiming_stopped = stop = PreemptedAfterReading()
    with running(consumer):
        wait_until(stop.preempted.is_set, 30, message="the worker to take the task")
    assert statuses(broker, [task]) == ["SUCCESSFUL"]
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing) == (0, 0), "not returned: it ran, once"


def test_a_stopped_consumer_exits_although_a_handler_left_a_thread_running(broker, consumer_process):
    # Interpreter shutdown would join that thread: a consumer that said "stopped" would live on for a minute.
    [task] = producer.enqueue("test.leaves_thread", [60])
    consumer = consumer_process("--grace", "2")
    wait_until(
        lambda: ResultRecord.from_fields(broker.records.get_result(task.id) or {}).status == "SUCCESSFUL",
        30,
        message="the task to run",
    )
    began = time.monotonic()
    assert consumer.terminate(timeout_s=20) == 0
    assert time.monotonic() - began < 15, "lived on with the thread its handler left"


def test_a_queue_named_twice_is_consumed_once_and_runs_nothing_twice(broker, consumer_process):
    # Before: a claimer thread per `--queue`, two on one processing list: each audit (every lease)
    # took the other's fresh claims for strays of a lost reply and returned them, to run again.
    assert ConsumerOptions(queues=["q", "q", "r", "q"]).queues == ["q", "r"]
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 0.002}, queue="q", count=3000)
    flags = ["--queue", "q", "--queue", "q", "--lease", "0.5", "--concurrency", "8", "--prefetch", "4"]
    consumer = consumer_process(*flags, "--burst")
    assert consumer.wait(300) == 0, consumer.log()
    assert runs_per_task(broker) == {task.id: 1 for task in tasks}
    assert "claim reply was lost" not in consumer.log()
