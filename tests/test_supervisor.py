"""Process mode's pure parts: a child's command line, exit descriptions, recycling and hard-limit decisions."""

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from django.core.management import load_command_class

from tasks_app.consumer import supervisor as process_mode, supervisor as supervisor_module
from tasks_app.consumer.options import ConsumerOptions
from tasks_app.consumer.supervisor import (
    EXIT_HARD_LIMIT,
    EXIT_MARGIN_S,
    EXIT_RECYCLE,
    ProcessGuard,
    Supervisor,
    describe_exit,
    graceful_signals,
)
from tasks_app.consumer.time_limits import RunClock
from tasks_app.management.commands.runconsumer import child_command
from tests.support.processes import wait_until


def child_argv(*argv: str) -> list[str]:
    command = load_command_class("tasks_app", "runconsumer")
    parser = command.create_parser("manage.py", "runconsumer")
    options = vars(parser.parse_args(list(argv)))
    return child_command(parser, options, options["metrics_port"], 1, Path("/tmp/beat-1"), 7)


def test_a_child_gets_the_supervisors_flags_and_its_own_identity_port_and_beat():
    argv = child_argv(
        "--processes", "2", "--queue", "a", "--queue", "b", "--concurrency", "3", "--burst",
        "--consumer-id", "grp", "--metrics-port", "9100", "--max-tasks-per-child", "50",
    )  # fmt: skip
    joined = " ".join(argv)
    assert "--consumer-id=grp-1" in argv and "--metrics-port=9101" in argv
    assert "--supervisor-beat=/tmp/beat-1" in argv and "--skip-checks" in argv
    assert "--supervisor-lifeline=7" in argv
    assert f"--supervisor-pid={os.getpid()}" in argv, "a child orphaned as it starts knows its parent is gone"
    assert "--queue=a --queue=b" in joined and "--concurrency=3" in argv and "--burst" in argv
    assert "--max-tasks-per-child=50" in argv
    assert not any(arg.startswith(("--processes", "--prefetch")) for arg in argv), "defaults are not repeated"


def test_a_child_parses_back_the_supervisors_values_even_those_that_start_with_a_dash():
    # Before: `--queue -urgent` (a valid name) reached the child as two words, which its parser
    # refused ("expected one argument"): every child exited 2 and was replaced, forever.
    flags = ["--processes", "2", "--queue=-urgent", "--queue=b", "--consumer-id=-grp", "--health-file=-alive"]
    argv = child_argv(*flags, "--metrics-host=-x", "--grace", "5")
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    child = vars(parser.parse_args(argv[argv.index("runconsumer") + 1 :]))
    assert (child["queues"], child["consumer_id"], child["health_file"]) == (["-urgent", "b"], "-grp-1", "-alive.1")
    assert (child["metrics_host"], child["grace_s"], child["supervisor_lifeline"]) == ("-x", 5.0, 7)


def test_a_child_gets_the_queue_weights_as_typed():
    argv = child_argv("--processes", "2", "--queue", "a:b", "--queue", "c", "--weight", "a:b=3")
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    child = vars(parser.parse_args(argv[argv.index("runconsumer") + 1 :]))
    assert child["weights"] == ["a:b=3"]


def test_children_of_a_group_asked_for_any_free_metrics_port_each_take_one():
    # Before: child n was given port 0 + n, a privileged port it could not bind (or, as root, took).
    argv = child_argv("--processes", "2", "--metrics-port", "0")
    assert "--metrics-port=0" in argv


def test_exits_are_described_by_status_or_signal():
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by signal 9 (SIGKILL)"


def test_a_child_leaves_to_be_recycled_once_it_ran_its_tasks():
    left: list[int] = []
    guard = ProcessGuard(ConsumerOptions(max_tasks=2), lambda *limits: 0, lambda code, reason: left.append(code))
    guard.ran_one()
    assert left == []
    guard.ran_one()
    guard.ran_one()
    assert left == [EXIT_RECYCLE], "once"


def test_hard_limits_apply_in_process_mode_only():
    left: list[int] = []
    asked: list[tuple[float, float]] = []

    def fail_hung(grace_s: float, exit_within_s: float) -> int:
        asked.append((grace_s, exit_within_s))
        return 1

    options = ConsumerOptions(hard_limit_grace_s=0.5, grace_s=3.0, block_s=1.0)
    assert ProcessGuard(options, fail_hung, lambda code, reason: left.append(code)).enforce_hard_limits() == 1
    assert left == [EXIT_HARD_LIMIT]
    # Retries of what it gave up on wait out the claimers, the running tasks and the last acks.
    assert asked == [(0.5, 1.0 + 1 + 3.0 + 3.0 + 5 + EXIT_MARGIN_S)]
    assert ProcessGuard(ConsumerOptions(), fail_hung, lambda code, reason: None).enforce_hard_limits() == 0


def test_a_run_is_abandoned_only_past_its_timeout_plus_grace_and_only_once():
    clock = RunClock(1.0, thread_id=0)
    start = clock.started_monotonic
    assert not clock.abandon(0.5, start + 2), "never interrupted: not past its soft limit yet"
    clock.timeout_error = TimeoutError()  # type: ignore[assignment]
    assert not clock.abandon(0.5, start + 1.2)
    assert clock.abandon(0.5, start + 1.6) and not clock.abandon(0.5, start + 2)


def test_a_run_that_returned_is_never_abandoned():
    clock = RunClock(1.0, thread_id=0)
    clock.timeout_error = TimeoutError()  # type: ignore[assignment]
    clock.returned = True
    assert not clock.abandon(0.0, clock.started_monotonic + 10)


def tend_until(supervisor: Supervisor, done, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the supervisor did not get there"
        for child in supervisor.children:
            supervisor._tend(child)
        time.sleep(0.02)


def test_a_child_that_stops_beating_is_killed_and_replaced_after_a_backoff(caplog, monkeypatch):
    monkeypatch.setattr(supervisor_module, "STALL_S", 0.3)
    supervisor = Supervisor(lambda index, beat, lifeline: ["sleep", "30"], 1)
    [child] = supervisor.children
    supervisor._tend(child)
    first = child.process
    child.beat.touch()  # one beat, then none
    tend_until(supervisor, lambda: child.process is None)
    assert first.returncode == -signal.SIGKILL
    assert child.start_at > time.monotonic(), "a crash is replaced after a backoff"
    assert "stopped beating" in caplog.text and "was killed by signal 9 (SIGKILL)" in caplog.text


# A child that beats every 0.1 s, its clock a minute behind the supervisor's (as after a clock step).
# A child that beats every 0.1 s, its beat's mtime `argv[2]` seconds off the supervisor's clock.
BEATING = """import os, sys, time
while True:
    try:
        open(sys.argv[1], "a").close()
        os.utime(sys.argv[1], (time.time() + float(sys.argv[2]),) * 2)
    except OSError:
        pass
    time.sleep(0.1)"""


def beating_child(offset_s: float) -> Supervisor:
    supervisor = Supervisor(lambda index, beat, lifeline: [sys.executable, "-c", BEATING, str(beat), str(offset_s)], 1)
    supervisor._tend(supervisor.children[0])
    return supervisor


def still_running_after(supervisor: Supervisor, seconds: float) -> bool:
    [child] = supervisor.children
    running = child.process
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        supervisor._tend(child)
        time.sleep(0.05)
    alive = child.process is running and running.poll() is None
    running.kill()
    running.wait()
    return alive


def test_a_child_that_beats_is_never_taken_for_wedged_whatever_the_wall_clock_says():
    # Before: the beat's age was its mtime against the wall clock, so a clock stepped forward
    # (NTP, a VM resumed) made every beating child look wedged, and all were SIGKILLed at once.
    assert still_running_after(beating_child(-60), 1.5), "not killed"


def test_a_beating_child_is_watched_through_a_file_with_no_name_a_killed_supervisor_cannot_leave(monkeypatch, tmp_path):
    # Before: the beat files lived in a directory of their own, left in /tmp by a supervisor
    # killed with SIGKILL (and SIGKILLed every child once a /tmp cleaner had removed it).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    supervisor = beating_child(0)
    [child] = supervisor.children
    wait_until(lambda: child.beat.stat().st_mtime > 0, 10, message="the first beat")
    assert list(tmp_path.iterdir()) == []
    assert still_running_after(supervisor, 1.5), "its beats are seen"


def test_a_recycled_child_is_replaced_at_once_and_a_burst_child_done_is_not():
    recycled = Supervisor(lambda index, beat, lifeline: ["sh", "-c", f"exit {EXIT_RECYCLE}"], 1)
    [child] = recycled.children
    recycled._tend(child)
    tend_until(recycled, lambda: child.process is None)
    assert child.start_at <= time.monotonic()
    burst = Supervisor(lambda index, beat, lifeline: ["true"], 1, burst=True)
    [done] = burst.children
    burst._tend(done)
    tend_until(burst, lambda: done.process is None)
    assert done.start_at < 0, "not replaced"


def test_a_child_that_cannot_be_started_is_tried_again_after_a_backoff(caplog, tmp_path):
    # Before: the fork's OSError (a process limit reached, say) ended the supervisor and its group.
    command = tmp_path / "consumer"
    supervisor = Supervisor(lambda index, beat, lifeline: [str(command)], 1)
    [child] = supervisor.children
    supervisor._tend(child)
    assert child.process is None and child.backoff_s > 0 and child.start_at > time.monotonic()
    assert "consumer process 0 could not start" in caplog.text
    command.write_text("#!/bin/sh\nsleep 30\n")
    command.chmod(0o755)
    child.start_at = time.monotonic()
    supervisor._tend(child)
    assert child.process is not None and child.process.poll() is None, "started once it can be"
    child.process.kill()
    child.process.wait()


def test_a_child_leaves_as_soon_as_its_supervisors_end_of_the_lifeline_closes(monkeypatch, tmp_path):
    # Before: an orphan noticed its supervisor gone only at a beat (its parent pid checked once a
    # second, later on a loaded machine); now at the lifeline's EOF, whenever the beat comes.
    monkeypatch.setattr(process_mode, "BEAT_EVERY_S", 3600.0)
    read_end, write_end = os.pipe()
    left: list[tuple[int, str]] = []
    options = ConsumerOptions(supervisor_beat=str(tmp_path / "beat"), supervisor_lifeline=read_end)
    guard = ProcessGuard(options, lambda *limits: 0, lambda code, reason: left.append((code, reason)))
    guard.start()
    wait_until((tmp_path / "beat").exists, 10, message="the first beat")
    assert left == []
    os.close(write_end)
    wait_until(lambda: left, 10, message="the guard to see the supervisor gone")
    assert left == [(0, "its supervisor is gone: stopping")]
    guard.stop()
    os.close(read_end)


def test_sighup_stops_gracefully_unless_ignored_from_the_start_as_under_nohup():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert signal.SIGHUP not in graceful_signals(), "nohup: it stays ignored"
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert graceful_signals() == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_group_health_file_that_cannot_be_written_is_said_once_and_never_ends_the_supervisor(tmp_path, caplog):
    # Before: the OSError ended the supervisor's loop with a traceback, and so the whole group.
    group_file = tmp_path / "alive"
    group_file.symlink_to(tmp_path / "no-such-dir" / "alive")
    (tmp_path / "alive.0").touch()  # its one child's file is fresh
    group = Supervisor(lambda index, beat, lifeline: ["true"], 1, health_file=str(group_file))
    for _ in range(2):
        group._health_at = 0.0  # due again
        group._refresh_health()
    [line] = [r.getMessage() for r in caplog.records if "health file" in r.getMessage()]
    assert line.startswith(f"cannot touch the group's health file {group_file}: [Errno 2]")
