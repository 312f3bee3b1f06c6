"""The thin management commands: enqueue, queuestats, runconsumer's argument checks."""

import json
import os
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command, load_command_class
from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError

from tasks_app.consumer.options import ConsumerOptions
from tasks_app.management.commands.enqueue import CHUNK_TASKS
from tasks_app.protocol.enqueue import Enqueuer
from tasks_app.protocol.inspection import Inspection
from tests.support.enqueued import enqueued_keys
from tests.support.processes import PROJECT_DIR, consumer_env


@pytest.mark.django_db
def test_enqueue_prints_one_id_per_line(broker):
    out = StringIO()
    call_command("enqueue", "demo.echo", "--args", "[1]", "--count", "3", stdout=out)
    lines = out.getvalue().split()
    assert len(lines) == 3
    assert all(broker.records.get_result(task_id)["status"] == "READY" for task_id in lines)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no.such.type"], "unknown task type"),
        (["demo.echo", "--args", '{"a": 1}'], "args must be a JSON array"),
        (["demo.echo", "--delay", "-1"], "delay must be a non-negative"),
        (["demo.echo", "--priority", "500"], "priority"),
        (["demo.echo", "--count", "0"], "count"),
        (["demo.echo", "--kwargs", "[]"], "kwargs must be a JSON object"),
        (["demo.echo", "--queue", ""], "invalid queue ''"),  # `--queue "$UNSET"`: not the type's queue
        (["demo.echo", "--queue", "a b"], "invalid queue 'a b'"),
        (["demo.echo", "--args", "[" * 65 + "]" * 65], "nested too deeply"),
        (["demo.echo", "--args", "[" * 100_000 + "]" * 100_000], "nested too deeply"),
    ],
)
def test_enqueue_rejects_bad_input_with_a_command_error(broker, argv, message):
    with pytest.raises(CommandError, match=message):
        call_command("enqueue", *argv, stdout=StringIO())
    assert enqueued_keys(broker) == []


@pytest.mark.parametrize("value", ["0", "-1", "1000001", str(10**15)])
def test_enqueue_bounds_its_count(value):
    # Before: any count was taken, and --count 10**15 pushed chunk after chunk until Redis ran out of memory.
    parser = load_command_class("tasks_app", "enqueue").create_parser("manage.py", "enqueue")
    with pytest.raises(CommandError, match=r"--count: must be from 1 to 1000000, got"):
        parser.parse_args(["demo.echo", "--count", value])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "argv",
    [
        ["demo.echo", "--count", "1000001"],
        ["no.such.type"],
        ["demo.echo", "--args", "[1"],
        ["demo.echo", "--args", "{}"],
        ["demo.echo", "--delay", "-5"],
        ["demo.echo", "--priority", "1.5"],  # refused by argparse: no usage text around it
        [],
    ],
)
def test_enqueue_cli_fails_with_one_line_on_stderr_and_enqueues_nothing(broker, key_prefix, argv):
    result = subprocess.run(
        [sys.executable, str(PROJECT_DIR / "manage.py"), "enqueue", *argv],
        env=consumer_env(key_prefix),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(("CommandError:", "manage.py enqueue: error:"))
    assert enqueued_keys(broker) == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["queue", "pause"], "manage.py queue: error: the following arguments are required: queue (see --help)"),
        (["periodic", "run"], "manage.py periodic run: error: the following arguments are required: name (see --help)"),
        (
            ["runconsumer", "--concurrency", "0"],
            "manage.py runconsumer: error: argument --concurrency: must be at least",
        ),
        # Before: a traceback ("encoding of hostname failed") from bind(), in every child of a group, forever.
        (
            ["runconsumer", "--metrics-port", "0", "--metrics-host", os.fsdecode(b"\xff")],
            "manage.py runconsumer: error: argument --metrics-host: is not a host name or address",
        ),
    ],
)
def test_every_command_and_subcommand_refuses_bad_arguments_in_one_line(key_prefix, argv, expected):
    result = subprocess.run(
        [sys.executable, str(PROJECT_DIR / "manage.py"), *argv],
        env=consumer_env(key_prefix),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(expected)


@pytest.mark.django_db
def test_queuestats_json_lists_every_queue(broker):
    call_command("enqueue", "demo.echo", "--queue", "mail", "--count", "2", stdout=StringIO())
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    [queue] = json.loads(out.getvalue())["queues"]
    assert (queue["queue"], queue["pending"], queue["processing"], queue["consumers"]) == ("mail", 2, 0, [])


@pytest.mark.django_db
def test_queuestats_table(broker):
    call_command("enqueue", "demo.echo", stdout=StringIO())
    out = StringIO()
    call_command("queuestats", stdout=out)
    header, row = out.getvalue().splitlines()[:2]
    assert header.split() == ["queue", "pending", "processing", "delayed", "dead", "consumers", "state"]
    assert row.split() == ["default", "1", "0", "0", "0", "0", "running"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "0"],
        ["--prefetch", "-1"],
        ["--lease", "abc"],
        # Each would crash the consumer (an overflow in a thread's join), at start or in its graceful stop.
        ["--lease", "inf"],
        ["--grace", "inf"],
        ["--grace", "1e300"],
        ["--timeout-grace", "nan"],
        # Before: a traceback from bind(), in the consumer or in every child of the group, forever.
        ["--metrics-port", "65536"],
        ["--processes", "3", "--metrics-port", "65534"],
        # Before: valid as given, but each child's `<id>-<n>` was too long: every child failed, forever.
        ["--processes", "2", "--consumer-id", "c" * 100],
        # Before: `--metrics-host "$UNSET"` served metrics on every address instead of this host only.
        ["--metrics-port", "0", "--metrics-host", ""],
        ["--metrics-port", "0", "--metrics-host", "[]"],
        # A weight must name a queue of the consumer, with a weight from 1 to 1000.
        ["--queue", "a", "--weight", "b=2"],
        ["--queue", "a", "--weight", "a=0"],
        ["--queue", "a", "--weight", "a=1001"],
        ["--queue", "a", "--weight", "a"],
        ["--queue", "a", "--weight", "a=x"],
    ],
)
@pytest.mark.django_db
def test_runconsumer_rejects_bad_options(broker, argv):
    with pytest.raises(CommandError):
        call_command("runconsumer", *argv, "--burst")


@pytest.mark.parametrize("value", ["0", "257", "100000"])
def test_runconsumer_bounds_its_number_of_processes(value):
    # Before: any number was taken, and --processes 100000 forked until the machine gave out.
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    with pytest.raises(CommandError, match=r"--processes: must be from 1 to 256, got"):
        parser.parse_args(["--processes", value])


@pytest.mark.parametrize(
    ("field", "value"), [("concurrency", 1025), ("prefetch", 1001), ("async_concurrency", 100_001)]
)
def test_a_consumer_bounds_its_threads_prefetch_and_coroutines(field, value):
    # Before: --concurrency 100000 started threads until it could not, after registering.
    with pytest.raises(ValueError, match=f"{field.replace('_', ' ')} must be from"):
        ConsumerOptions(**{field: value}).validate()


@pytest.mark.django_db
def test_runconsumer_rejects_an_invalid_queue_name(broker):
    with pytest.raises(CommandError, match="invalid queue"):
        call_command("runconsumer", "--queue", "bad queue", "--burst")


@pytest.mark.django_db
def test_runconsumer_reports_a_busy_metrics_port_in_one_line(broker):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"cannot serve metrics on port {port}"):
            call_command("runconsumer", "--metrics-port", str(port), "--burst")


@pytest.mark.django_db
def test_enqueue_with_redis_away_fails_with_one_line(settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    with pytest.raises(CommandError, match="cannot enqueue"):
        call_command("enqueue", "demo.echo", stdout=StringIO())


@pytest.mark.django_db
@pytest.mark.parametrize(
    "argv", [["queuestats"], ["queuestats", "--json"], ["queue", "pause", "mail"], ["cancel", "some-id"]]
)
def test_commands_with_redis_away_fail_with_one_line(settings, argv):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # before: a redis ConnectionError traceback
    with pytest.raises(CommandError, match=r"^Redis unavailable: .*refused"):
        call_command(*argv, stdout=StringIO())


@pytest.mark.django_db(transaction=True)
def test_enqueue_with_the_database_away_fails_with_one_line_on_stderr(broker, key_prefix):
    result = subprocess.run(
        [sys.executable, str(PROJECT_DIR / "manage.py"), "enqueue", "demo.echo", "--skip-checks"],
        env=consumer_env(key_prefix, DATABASE_URL="postgres://u:p@127.0.0.1:1/db"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()  # before: a psycopg traceback
    assert line.startswith("CommandError: database unavailable:")
    assert enqueued_keys(broker) == []


def _spy_on_pushes(monkeypatch, fail_on_call: int = 0) -> list[int]:
    """Record how many tasks each enqueue script call carries; the call numbered `fail_on_call` fails."""
    sizes: list[int] = []
    real = Enqueuer.enqueue

    def enqueue(self, items, *args, **kwargs):
        sizes.append(len(items))
        if len(sizes) == fail_on_call:
            raise RedisConnectionError("simulated outage")
        return real(self, items, *args, **kwargs)

    monkeypatch.setattr(Enqueuer, "enqueue", enqueue)
    return sizes


@pytest.mark.django_db
def test_enqueue_a_large_count_pushes_it_in_chunks(broker, monkeypatch):
    sizes = _spy_on_pushes(monkeypatch)
    out = StringIO()
    call_command("enqueue", "demo.echo", "--count", str(2 * CHUNK_TASKS + 5), stdout=out)
    # Before: one script of every task, which held Redis (every client) for minutes at ten million.
    assert sizes == [CHUNK_TASKS, CHUNK_TASKS, 5]
    assert len(set(out.getvalue().split())) == 2 * CHUNK_TASKS + 5
    assert broker.inspect.queue_stats("default").pending == 2 * CHUNK_TASKS + 5


@pytest.mark.django_db
def test_enqueue_failing_midway_says_how_many_were_enqueued(broker, monkeypatch):
    _spy_on_pushes(monkeypatch, fail_on_call=2)
    out = StringIO()
    with pytest.raises(CommandError, match=f"simulated outage.*\\({CHUNK_TASKS} of {3 * CHUNK_TASKS} enqueued"):
        call_command("enqueue", "demo.echo", "--count", str(3 * CHUNK_TASKS), stdout=out)
    assert len(out.getvalue().split()) == broker.inspect.queue_stats("default").pending == CHUNK_TASKS


@pytest.mark.django_db
@pytest.mark.parametrize("reply", ["MASTERDOWN Link with MASTER is down", "LOADING Redis is loading", "TRYAGAIN"])
def test_queuestats_with_redis_passing_through_a_state_fails_as_unavailable(broker, monkeypatch, reply):
    call_command("enqueue", "demo.echo", stdout=StringIO())
    broker.client.sadd(broker.keys.queues(), "busy")
    real = Inspection.queue_stats

    def answer(
        self: Inspection, queue: str
    ):  # Redis answering one queue's read so, as a replica or a loading node does
        if queue == "busy":
            raise ResponseError(reply)
        return real(self, queue)

    monkeypatch.setattr(Inspection, "queue_stats", answer)
    with pytest.raises(CommandError, match=f"^Redis unavailable: {reply}"):
        call_command("queuestats", stdout=StringIO())


def _run_into_a_closed_pipe(key_prefix: str, *argv: str) -> tuple[int, str]:
    """Run manage.py with its stdout a pipe whose reader has already left (as `| head` leaves)."""
    process = subprocess.Popen(
        [sys.executable, str(PROJECT_DIR / "manage.py"), *argv],
        env=consumer_env(key_prefix, TASK_HANDLER_MODULES="examples.handlers"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read()
    return process.wait(timeout=60), stderr


@pytest.mark.django_db(transaction=True)
def test_enqueue_into_a_closed_pipe_stops_saying_how_many_were_enqueued(broker, key_prefix):
    returncode, stderr = _run_into_a_closed_pipe(key_prefix, "enqueue", "demo.echo", "--count", str(3 * CHUNK_TASKS))
    assert returncode == 1  # before: a BrokenPipeError traceback
    assert stderr.strip() == (
        f"CommandError: stdout closed by its reader after {CHUNK_TASKS} of {3 * CHUNK_TASKS} tasks were enqueued; "
        "the rest were not"
    )
    assert broker.inspect.queue_stats("default").pending == CHUNK_TASKS


@pytest.mark.django_db(transaction=True)
def test_queuestats_into_a_closed_pipe_exits_without_a_traceback(broker, key_prefix):
    returncode, stderr = _run_into_a_closed_pipe(key_prefix, "queuestats")
    assert (returncode, stderr) == (1, "")
