"""A consumer never runs beside another live holder of its id; a holder known dead is no reason to wait."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tasks_app.consumer.membership import default_consumer_id, holder_is_gone, live_holders, pid_namespace
from tasks_app.protocol.codec import encode_arguments, payload_of
from tests.support.claims import push, task_bytes
from tests.support.processes import wait_until
from tests.support.recording import recorded_runs


def holder(pid: object, **fields: object) -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": pid, "pid_ns": pid_namespace(), **fields}


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_holder_of_this_host_whose_process_is_gone_is_dead():
    assert holder_is_gone(holder(dead_pid()))
    assert holder_is_gone(holder(os.getpid())), "an earlier process that had this pid is not running now"


@pytest.mark.parametrize(
    "info",
    [
        holder(os.getppid()),
        {"pid": 1},
        holder(-5, host="elsewhere"),
        holder(os.getpid(), pid_ns="pid:[1]"),
        {},
    ],
    ids=["alive", "no-host", "other-host", "other-pid-namespace", "empty"],
)
def test_a_holder_that_may_be_alive_is_not_presumed_dead(info):
    assert not holder_is_gone(info)


def test_only_fresh_entries_of_live_holders_count(broker):
    broker.leases.heartbeat(["a"], "x", 60_000, holder(os.getppid()))
    broker.leases.heartbeat(["b"], "x", 60_000, holder(dead_pid()))
    broker.leases.heartbeat(["c"], "x", 1, holder(os.getppid(), host="elsewhere"))
    time.sleep(0.01)
    assert [entry.queue for entry in live_holders(broker, ["a", "b", "c", "d"], "x")] == ["a"]


@pytest.mark.django_db
def test_a_consumer_waits_while_a_live_process_holds_its_id_and_starts_once_it_left(
    broker, consumer_in_thread, caplog, tmp_path
):
    broker.leases.heartbeat(["default"], "fixed", 60_000, holder(os.getppid()))
    health_file = tmp_path / "healthy"
    with consumer_in_thread(consumer_id="fixed", health_file=str(health_file)):
        wait_until(lambda: "is held by a live process" in caplog.text, 10, message="the consumer to wait")
        assert [c["pid"] for c in broker.inspect.queue_stats("default").consumers] == [os.getppid()], (
            "it took nothing over"
        )
        wait_until(health_file.exists, 5, message="the waiting consumer to show it is alive")
        beaten_at = health_file.stat().st_mtime_ns
        wait_until(lambda: health_file.stat().st_mtime_ns > beaten_at, 5, message="its health file to stay fresh")
        broker.leases.deregister("default", "fixed")
        wait_until(
            lambda: [c["pid"] for c in broker.inspect.queue_stats("default").consumers] == [os.getpid()],
            10,
            message="start",
        )


def test_a_renewal_or_a_leave_by_another_instance_of_the_id_is_refused(broker):
    broker.leases.heartbeat(["q"], "x", 60_000, holder(os.getppid(), instance="theirs"))
    broker.client.lpush(broker.keys.processing("q", "x"), b"their task")
    assert broker.leases.renew_leases(["q"], "x", 60_000, instance="ours") == ["q"], "another process registered it"
    assert broker.leases.renew_leases(["q"], "x", 60_000, instance="theirs") == []
    assert broker.leases.renew_leases(["q"], "x", 60_000) == [], "a renewal naming no instance is not checked"
    assert broker.leases.deregister("q", "x", "ours") == -1
    assert broker.client.lrange(broker.keys.processing("q", "x"), 0, -1) == [b"their task"], "left to them"
    assert broker.leases.deregister("q", "x", "theirs") == 1


@pytest.mark.django_db
def test_a_consumer_whose_id_another_process_registered_moves_on_and_leaves_that_process_alone(
    broker, consumer_in_thread, caplog
):
    # Say this process froze past its lease while a restart elsewhere took over its fixed id.
    with consumer_in_thread(consumer_id="fixed") as consumer:
        wait_until(lambda: broker.inspect.queue_stats("default").consumers, 10, message="the consumer to register")
        broker.leases.heartbeat(["default"], "fixed", 60_000, holder(os.getppid(), instance="the restart"))
        wait_until(lambda: consumer.consumer_id == "fixed.1", 5, message="the consumer to take a new id")
    assert "lost its lease" in caplog.text
    [other] = broker.inspect.queue_stats("default").consumers
    assert (other["id"], other["pid"]) == ("fixed", os.getppid()), "its lease was neither renewed nor dropped by us"


def test_the_default_id_holds_only_characters_an_id_may_hold(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "büro server/1")
    consumer_id = default_consumer_id()
    assert consumer_id.startswith(f"b-ro-server-1-{os.getpid()}-")
    assert consumer_id.encode().decode() == consumer_id, "a reaper can read it back"


@pytest.mark.django_db
def test_a_run_whose_fixed_id_a_restart_took_meanwhile_leaves_the_restarts_claim_alone(
    broker, consumer_in_thread, caplog
):
    raw = task_bytes(
        "t", queue="default", payload=payload_of(*encode_arguments([], {"hold_until": "go", "fail_until_attempt": 1}))
    )
    with consumer_in_thread(consumer_id="fixed", concurrency=1, prefetch=0):
        wait_until(lambda: broker.inspect.queue_stats("default").consumers, 10, message="the consumer to register")
        push(broker, raw, queue="default")
        wait_until(lambda: recorded_runs(broker), 10, message="the run to start")
        # The consumer froze past its lease: a restart took its fixed id, recovered its list and
        # claimed the task again (the same bytes in the same list).
        assert broker.leases.reap("default", "fixed", 60_000, own_earlier_run=True).requeued == 1
        broker.leases.heartbeat(["default"], "fixed", 60_000, holder(os.getppid(), instance="the restart"))
        assert broker.queue.claim_with_suspect("default", "fixed", 1).tasks == [raw]
        broker.client.set(f"{broker.keys.prefix}:go", 1)  # the frozen run thaws and fails
        wait_until(lambda: "its outcome here was not applied" in caplog.text, 10, message="the retry to be lost")
    assert broker.queue.held_by("default", "fixed") == [raw], "the restart's claim is left to it"
    assert broker.client.zcard(broker.keys.delayed("default")) == 0, "and no retry runs beside it"
