"""Process mode: `runconsumer --processes N` replaces dead children, stops cleanly, recycles, enforces hard limits."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tasks_app import producer
from tasks_app.models import TaskType
from tasks_app.protocol.records import ResultRecord
from tests.support.ports import free_port
from tests.support.process_tree import alive, children_of
from tests.support.processes import PROJECT_DIR, consumer_env, wait_until
from tests.support.recording import marks, recorded_runs, runs_per_task

pytestmark = pytest.mark.django_db(transaction=True)


def record_of(broker, task) -> ResultRecord:
    return ResultRecord.from_fields(broker.records.get_result(task.id) or {})


def statuses(broker, tasks) -> list[str]:
    return [record_of(broker, task).status for task in tasks]


def test_a_child_killed_mid_batch_is_replaced_and_nothing_is_lost(broker, consumer_process):
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 0.1}, count=60)
    group = consumer_process(
        "--processes", "2", "--consumer-id", "grp", "--lease", "1.5", "--concurrency", "3", "--prefetch", "2"
    )
    wait_until(lambda: any(run["consumer"] == "grp-0" for run in recorded_runs(broker)), 60, message="child 0 to work")
    victim = next(run["pid"] for run in recorded_runs(broker) if run["consumer"] == "grp-0")
    os.kill(victim, signal.SIGKILL)

    wait_until(lambda: statuses(broker, tasks) == ["SUCCESSFUL"] * len(tasks), 60, message="every task to succeed")
    runs = runs_per_task(broker)
    assert set(runs) == {task.id for task in tasks}, "nothing lost"
    assert max(runs.values()) <= 2
    wait_until(lambda: len(children_of(group.pid)) == 2, 30, message="the victim to be replaced")
    assert victim not in children_of(group.pid)
    assert group.terminate(timeout_s=60) == 0, group.log()
    assert "was killed by signal 9 (SIGKILL)" in group.log()


def test_sigterm_stops_every_child_gracefully_and_exits_0(broker, consumer_process):
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 0.3}, count=16)
    group = consumer_process("--processes", "2", "--concurrency", "2", "--prefetch", "2", "--grace", "20")
    wait_until(lambda: len(recorded_runs(broker)) >= 4, 60, message="both children to work")
    children = children_of(group.pid)
    assert len(children) == 2
    assert group.terminate(timeout_s=60) == 0, group.log()
    assert not any(alive(pid) for pid in children), "no child left"

    started = runs_per_task(broker)
    assert all(count == 1 for count in started.values())
    assert {t.id for t in tasks if record_of(broker, t).status == "SUCCESSFUL"} == set(started)
    stats = broker.inspect.queue_stats("default")
    assert (stats.pending, stats.processing, stats.consumers) == (len(tasks) - len(started), 0, [])


def test_children_recycled_after_max_tasks_lose_nothing_and_run_nothing_twice(broker, consumer_process):
    tasks = producer.enqueue("test.record", kwargs={"sleep_s": 0.02}, count=24)
    group = consumer_process(
        "--processes", "1", "--max-tasks-per-child", "8", "--burst", "--concurrency", "2", "--prefetch", "2"
    )
    assert group.wait(120) == 0, group.log()
    assert statuses(broker, tasks) == ["SUCCESSFUL"] * len(tasks)
    assert runs_per_task(broker) == {task.id: 1 for task in tasks}
    pids = {run["pid"] for run in recorded_runs(broker)}
    assert len(pids) >= 3, "a new child after every eight tasks"
    assert "exited with status 75; replacing it" in group.log()


def test_the_retry_of_a_hung_run_starts_only_once_its_process_is_gone(broker, consumer_process):
    # Two children: the idle one would take the retry at once, while the stuck one still exits
    # (and its hung handler still runs). The retry is not due before that process is surely gone.
    TaskType.objects.create(name="hangs", handler="test.hang", timeout=1, max_attempts=2, retry_backoff=0.1)
    group = consumer_process(
        "--processes", "2", "--concurrency", "1", "--prefetch", "0", "--timeout-grace", "1", "--grace", "2"
    )
    wait_until(lambda: len(children_of(group.pid)) == 2, 30, message="the children to start")
    producer.enqueue("hangs", kwargs={"sleep_s": 60})
    wait_until(lambda: marks(broker), 30, message="the hanging handler to start")
    [first] = marks(broker)
    wait_until(lambda: len(marks(broker)) > 1 or not alive(first["pid"]), 60, message="the stuck process to exit")
    stuck_alive_at_retry = alive(first["pid"]) and len(marks(broker)) > 1
    wait_until(lambda: len(marks(broker)) > 1, 60, message="the retry to start")
    assert not stuck_alive_at_retry, "the retry started while the hung handler's process still ran"
    assert marks(broker)[1]["pid"] != first["pid"]
    assert group.terminate(timeout_s=60) == 0, group.log()


def test_a_handler_stuck_in_c_past_its_hard_limit_is_failed_and_its_process_replaced(broker, consumer_process):
    TaskType.objects.create(name="hangs", handler="test.hang", timeout=1, max_attempts=1)
    group = consumer_process("--processes", "1", "--concurrency", "4", "--prefetch", "0", "--timeout-grace", "1")
    wait_until(lambda: children_of(group.pid), 30, message="the child to start")
    others = producer.enqueue("test.record", kwargs={"sleep_s": 2.5}, count=3)
    wait_until(lambda: len(recorded_runs(broker)) == 3, 30, message="the other tasks to start")
    [hung] = producer.enqueue("hangs", kwargs={"sleep_s": 10})
    wait_until(lambda: marks(broker), 30, message="the hanging handler to start")
    started = time.monotonic()
    wait_until(lambda: record_of(broker, hung).is_finished, 10, message="the hung task to be failed")
    failed_after_s = time.monotonic() - started

    record = record_of(broker, hung)
    assert (record.status, record.attempts) == ("FAILED", 1)
    assert record.errors[-1]["exception_class_path"] == "tasks_app.exceptions.TaskTimeout"
    assert failed_after_s < 8, "failed at its hard limit, long before the sleep's end"
    [start] = marks(broker)
    wait_until(lambda: not alive(start["pid"]), 30, message="the stuck process to exit")
    assert [m["mark"] for m in marks(broker)] == ["start"], "its end never reached"
    wait_until(lambda: statuses(broker, others) == ["SUCCESSFUL"] * 3, 30, message="the others to finish")
    assert runs_per_task(broker) == {task.id: 1 for task in others}, "the others ran once"
    wait_until(lambda: children_of(group.pid) not in ([], [start["pid"]]), 30, message="a replacement")
    assert group.terminate(timeout_s=60) == 0, group.log()
    assert "exited with status 76; replacing it" in group.log()


def test_a_child_whose_supervisor_died_after_removing_its_beat_files_stops_by_itself(broker, tmp_path):
    # A supervisor that crashes removes its beat files on its way out; before, the child's beat
    # thread died on the missing file, so the orphan never noticed its supervisor was gone.
    beats = tmp_path / "beats"
    beats.mkdir()
    consumer = [sys.executable, str(PROJECT_DIR / "manage.py"), "runconsumer", "--consumer-id", "orphan"]
    consumer += ["--supervisor-beat", str(beats / "beat-0"), "--lease", "2"]
    supervisor = subprocess.Popen(
        ["sh", "-c", '"$@" & wait', "sh", *consumer], env=consumer_env(broker.keys.prefix), start_new_session=True
    )
    try:
        wait_until(lambda: (beats / "beat-0").exists() and children_of(supervisor.pid), 60, message="a beating child")
        [child] = children_of(supervisor.pid)
        shutil.rmtree(beats)
        supervisor.kill()
        supervisor.wait(10)
        wait_until(lambda: not alive(child), 30, message="the orphan to stop")
        assert broker.inspect.queue_stats("default").consumers == [], "it left cleanly"
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)


def test_a_child_waiting_for_redis_to_register_beats_so_its_supervisor_does_not_kill_it(consumer_process, tmp_path):
    # Before: the beat began only once registered, so a Redis outage at a child's start looked
    # like a wedged child to its supervisor, which SIGKILLed it every minute.
    beat = tmp_path / "beat-0"
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    child = consumer_process("--supervisor-beat", str(beat), "--lease", "2", REDIS_URL=unreachable)
    wait_until(lambda: "redis error during register" in child.log(), 60, message="the child to wait for Redis")
    wait_until(beat.exists, 10, message="the child's beat")
    assert child.terminate(timeout_s=20) == 0, child.log()


def test_a_supervisor_restarted_at_once_waits_for_the_orphans_still_running_under_its_ids(broker, consumer_process):
    # Before: the new child took id grp-0 while the orphan of the killed supervisor still ran a
    # task under it, recovered that task as its own earlier run's and ran it a second time.
    flags = ["--processes", "1", "--consumer-id", "grp", "--concurrency", "1", "--prefetch", "0", "--lease", "5"]
    [long] = producer.enqueue("test.record", kwargs={"hold_until": "orphan-may-finish"})
    short = producer.enqueue("test.record", count=3)
    first = consumer_process(*flags)
    wait_until(lambda: recorded_runs(broker), 60, message="the long task to start")
    [orphan] = children_of(first.pid)
    os.kill(first.pid, signal.SIGKILL)
    second = consumer_process(*flags)
    # The orphan's run goes on until the new group's child is seen waiting for it, however slow its start.
    wait_until(lambda: f"is held by a live process (pid {orphan}" in second.log(), 60, message="the new child to wait")
    broker.client.set(f"{broker.keys.prefix}:orphan-may-finish", 1)

    wait_until(lambda: statuses(broker, [long, *short]) == ["SUCCESSFUL"] * 4, 60, message="every task to succeed")
    assert runs_per_task(broker) == {task.id: 1 for task in [long, *short]}, second.log()
    wait_until(lambda: not alive(orphan), 30, message="the orphan to exit")
    assert second.terminate(timeout_s=60) == 0, second.log()


def test_children_over_the_memory_limit_from_the_start_still_each_run_a_task(broker, consumer_process):
    # Before: a child already above --max-memory-per-child left at its first beat, before
    # claiming anything, so its replacement did too: a storm of restarts that never ran a task.
    tasks = producer.enqueue("test.record", count=3)
    group = consumer_process(
        "--processes", "1", "--max-memory-per-child", "1", "--burst", "--concurrency", "1", "--prefetch", "0"
    )
    assert group.wait(60) == 0, group.log()
    assert runs_per_task(broker) == {task.id: 1 for task in tasks}
    assert statuses(broker, tasks) == ["SUCCESSFUL"] * len(tasks)


def test_a_child_whose_supervisor_was_killed_while_it_started_stops_by_itself(broker, consumer_process):
    # Before: a child took its supervisor to be whatever parent it had once it was up, so one
    # orphaned during its start-up (kill -9 of the supervisor then) took init for it and ran on.
    group = consumer_process("--processes", "1", "--consumer-id", "grp", "--lease", "2")
    [child] = wait_until(lambda: children_of(group.pid), 60, interval_s=0.01, message="the child to start")
    os.kill(group.pid, signal.SIGKILL)
    group.wait(10)
    try:
        wait_until(
            lambda: broker.inspect.queue_stats("default").consumers or not alive(child),
            60,
            message="the child to be up",
        )
        wait_until(lambda: not alive(child), 30, message="the orphan to stop")
        assert broker.inspect.queue_stats("default").consumers == [], "it left cleanly"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)


def test_ctrl_c_to_the_group_stops_each_child_once_however_late_the_supervisor_passes_it_on(broker, consumer_process):
    # Ctrl-C reaches every process of the group; the supervisor then passes it on as SIGTERM.
    # Before: a child took that SIGTERM, when it came a second or more after its own SIGINT (a
    # loaded machine), for a second signal and exited at once, cutting its running tasks short.
    [task] = producer.enqueue("test.record", kwargs={"sleep_s": 3.0})
    group = consumer_process("--processes", "1", "--grace", "20", "--lease", "2")
    wait_until(lambda: recorded_runs(broker), 60, message="the slow task to start")
    os.kill(group.pid, signal.SIGSTOP)  # a supervisor slow to act on the signal
    os.killpg(group.pid, signal.SIGINT)
    time.sleep(1.5)
    os.kill(group.pid, signal.SIGCONT)
    assert group.wait(60) == 0, group.log()
    assert statuses(broker, [task]) == ["SUCCESSFUL"], group.log()
    assert runs_per_task(broker) == {task.id: 1}


def test_children_of_a_killed_supervisor_return_what_they_hold_finish_their_runs_and_leave_no_files(
    broker, consumer_process, tmp_path
):
    # The orphans see their supervisor gone at once (their lifeline's EOF), not at a later beat;
    # before, a supervisor killed with SIGKILL also left its directory of beat files in TMPDIR.
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    tasks = producer.enqueue("test.record", kwargs={"hold_until": "orphans-may-finish"}, count=6)
    flags = ["--processes", "2", "--consumer-id", "grp", "--concurrency", "1", "--prefetch", "2", "--lease", "60"]
    group = consumer_process(*flags, "--grace", "30", TMPDIR=str(temp_dir))
    wait_until(lambda: len(recorded_runs(broker)) == 2, 60, message="one run in each child")
    wait_until(lambda: broker.inspect.queue_stats("default").processing == 6, 30, message="each child to prefetch two")
    orphans = children_of(group.pid)
    os.kill(group.pid, signal.SIGKILL)
    group.wait(10)
    try:
        # Long before the lease (60 s) could recover them: the orphans gave them back themselves.
        wait_until(
            lambda: broker.inspect.queue_stats("default").pending == 4, 30, message="the unstarted four returned"
        )
        assert all(alive(pid) for pid in orphans), "their runs go on"
        broker.client.set(f"{broker.keys.prefix}:orphans-may-finish", 1)
        wait_until(lambda: not any(alive(pid) for pid in orphans), 30, message="the orphans to exit")
        stats = broker.inspect.queue_stats("default")
        assert (stats.pending, stats.processing, stats.consumers) == (4, 0, [])
        started = runs_per_task(broker)
        assert all(count == 1 for count in started.values()) and len(started) == 2
        assert {t.id for t in tasks if record_of(broker, t).status == "SUCCESSFUL"} == set(started)
        assert list(temp_dir.iterdir()) == [], "nothing left on disk"
    finally:
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sighup_stops_the_group_gracefully_and_sigquit_kills_it_at_once(broker, consumer_process):
    # Before: both had their default action: the supervisor died at once and left its children running.
    [task] = producer.enqueue("test.record", kwargs={"sleep_s": 2.0})
    group = consumer_process("--processes", "1", "--grace", "20", "--lease", "2")
    wait_until(lambda: recorded_runs(broker), 60, message="the slow task to start")
    children = children_of(group.pid)
    group.signal(signal.SIGHUP)
    assert group.wait(60) == 0, group.log()
    assert statuses(broker, [task]) == ["SUCCESSFUL"] and not any(alive(pid) for pid in children)

    [held] = producer.enqueue("test.record", kwargs={"hold_until": "never"})
    quitting = consumer_process("--processes", "1", "--consumer-id", "quitting", "--lease", "2")
    wait_until(lambda: held.id in runs_per_task(broker), 60, message="the held task to start")
    children = children_of(quitting.pid)
    quitting.signal(signal.SIGQUIT)
    assert quitting.wait(30) == 1, quitting.log()
    assert "SIGQUIT: killing every consumer process" in quitting.log()
    assert not any(alive(pid) for pid in children), "no child left"


def test_a_group_serves_a_queue_whose_name_starts_with_a_dash(broker, consumer_process):
    # Before: each child was handed `--queue -urgent` as two words, refused them and was replaced, forever.
    [task] = producer.enqueue("test.record", queue="-urgent")
    group = consumer_process("--processes", "1", "--queue=-urgent", "--consumer-id=-grp", "--burst")
    assert group.wait(60) == 0, group.log()
    assert statuses(broker, [task]) == ["SUCCESSFUL"]
    assert [run["consumer"] for run in recorded_runs(broker)] == ["-grp-0"]
