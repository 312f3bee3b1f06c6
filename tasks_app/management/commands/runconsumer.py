"""`manage.py runconsumer`: run a consumer until stopped."""

import argparse
import contextlib
import dataclasses
import gc
import logging
import math
import os
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app import tracing
from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.loops import METRICS_HOST, serve_consumer_metrics
from tasks_app.consumer.options import MAX_DURATION_S, MAX_PROCESSES, ConsumerOptions
from tasks_app.management.base import bounded_arg, with_one_line_errors
from tasks_app.protocol.keys import validate_name

MAX_PORT = 65535


positive_int = bounded_arg("positive_int", 1, math.inf, "must be at least 1, got {value}")
non_negative_int = bounded_arg("non_negative_int", 0, math.inf, "cannot be negative, got {value}")
processes_arg = bounded_arg("processes_arg", 1, MAX_PROCESSES, f"must be from 1 to {MAX_PROCESSES}, got {{value}}")
port_arg = bounded_arg("port_arg", 0, MAX_PORT, f"must be a port from 0 to {MAX_PORT} (0: any free one), got {{value}}")
duration_arg = bounded_arg(
    "duration_arg", 0, MAX_DURATION_S, f"must be a number of seconds from 0 to {MAX_DURATION_S}, got {{text}}", float
)


def host_arg(text: str) -> str:
    """An address to bind: never empty (`--metrics-host "$UNSET"` would bind every address), one a socket takes."""
    if not text.removeprefix("[").removesuffix("]").strip():
        raise argparse.ArgumentTypeError("cannot be empty (0.0.0.0 or :: binds every address)")
    try:
        text.encode("ascii" if text.isascii() else "idna")  # as the socket module encodes a host name
    except UnicodeError:
        raise argparse.ArgumentTypeError(f"is not a host name or address: {text!r}") from None
    return text


def prefetch_arg(text: str) -> int | None:
    return None if text == "auto" else non_negative_int(text)


def queue_weight(text: str) -> tuple[str, int]:
    """`Q=N` as (Q, N); the text is kept as typed, so a supervisor passes it on to its children as it is."""
    name, sep, weight = text.rpartition("=")
    if not sep or not name or not weight.isdigit():
        raise argparse.ArgumentTypeError(f"must be a queue and its weight, as high=3, got {text!r}")
    return name, int(weight)


def weight_arg(text: str) -> str:
    queue_weight(text)
    return text


class Command(BaseCommand):
    help = "Claim and run tasks from the given queues until SIGTERM/SIGINT/SIGHUP (or, with --burst, until idle)."

    def add_arguments(self, parser: CommandParser) -> None:
        for flag, help_text, options in FLAGS:
            parser.add_argument(flag, help=help_text, **options)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """Keep the parser: process mode passes the same flags on to its children."""
        self.parser = with_one_line_errors(super().create_parser(prog_name, subcommand, **kwargs))
        return self.parser

    def handle(self, *args: Any, processes: int | None, metrics_port: int | None, **options: Any) -> None:
        # Run from a command line (run_from_argv sets it): the process is the consumer's own.
        own_process = getattr(self, "_called_from_command_line", False)
        consumer_options = _consumer_options(options)
        try:
            consumer_options.validate()
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if processes is not None:
            exit_code = _run_group(self.parser, processes, metrics_port, options)
        else:
            consumer = Consumer(consumer_options)
            if metrics_port is not None:
                host, queues = options["metrics_host"], consumer.options.queues
                try:
                    serve_consumer_metrics(consumer.liveness, consumer.broker, queues, metrics_port, host)
                except OSError as exc:
                    why = exc.strerror or exc
                    raise CommandError(f"cannot serve metrics on port {metrics_port} of {host}: {why}") from None
            consumer.install_signal_handlers()
            if own_process:
                # What start-up built (Django, the handlers, the consumer) lives as long as the process:
                # kept out of the collector, a full collection takes milliseconds instead of tens of them.
                gc.freeze()
            exit_code = consumer.run()
        if own_process:
            _exit_now(exit_code)
        if exit_code:
            raise SystemExit(exit_code)


def _exit_now(exit_code: int) -> NoReturn:
    """End the process once the consumer has stopped, without joining threads its handlers left running."""
    # A thread a handler left running would keep the process alive beside the task's next run elsewhere.
    tracing.flush()  # os._exit skips the exit handlers that would export the spans still buffered
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a handler may have closed or replaced it: exit all the same
            stream.flush()
    os._exit(exit_code)


def _run_group(parser: CommandParser, processes: int, metrics_port: int | None, options: dict[str, Any]) -> int:
    """Run `processes` consumer processes under a supervisor; return its exit code."""
    from tasks_app.consumer.supervisor import Supervisor

    last = processes - 1
    if metrics_port and metrics_port + last > MAX_PORT:
        raise CommandError(f"--metrics-port {metrics_port} leaves no port for child {last} (P + n > {MAX_PORT})")
    try:  # the group's id was valid; its children's are longer
        validate_name(f"{group_id(options)}-{last}", "consumer id of a child")
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    command = partial(child_command, parser, options, metrics_port)
    return Supervisor(command, processes, burst=options["burst"], health_file=options["health_file"]).run()


def _consumer_options(options: dict[str, Any]) -> ConsumerOptions:
    """The consumer's options from the command's, whose flags are named (`dest`) for them."""
    chosen = {field.name: options[field.name] for field in dataclasses.fields(ConsumerOptions) if field.name in options}
    chosen["queues"] = options["queues"] or ["default"]
    chosen["weights"] = dict(map(queue_weight, options["weights"] or ()))
    if options["supervisor_beat"] is None:  # only a supervised consumer has hard time limits
        chosen["hard_limit_grace_s"] = None
    return ConsumerOptions(**chosen)


# Flags a supervisor sets per child instead of passing its own on.
PER_CHILD_DESTS = {"help", "processes", "consumer_id", "metrics_port", "health_file", "skip_checks"}
PER_CHILD_DESTS |= {"supervisor_beat", "supervisor_pid", "supervisor_lifeline"}


def group_id(options: dict[str, Any]) -> str:
    """The id a supervisor's children are named after, `<id>-<n>`."""
    return options["consumer_id"] or f"{socket.gethostname()}-{os.getpid()}"


def child_command(
    parser: CommandParser, options: dict[str, Any], metrics_port: int | None, index: int, beat: Path, lifeline: int
) -> list[str]:
    """The argv of consumer process `index` of a supervisor started with `options`."""
    argv = [sys.executable, "-m", "django", "runconsumer", f"--consumer-id={group_id(options)}-{index}"]
    # Each flag and its value in one word, so a value that starts with a dash (`--queue=-urgent`) is not taken for
    # a flag; the supervisor ran the system checks already.
    argv += [f"--supervisor-beat={beat}", f"--supervisor-pid={os.getpid()}", f"--supervisor-lifeline={lifeline}"]
    argv += [f"--settings={settings.SETTINGS_MODULE}", "--skip-checks"]
    if metrics_port is not None:  # 0: each takes any free port
        argv += [f"--metrics-port={metrics_port + index if metrics_port else 0}"]
    if options["health_file"]:
        argv += [f"--health-file={options['health_file']}.{index}"]
    for action in parser._actions:
        if action.dest in PER_CHILD_DESTS or action.dest == "settings" or not action.option_strings:
            continue
        argv += _as_flags(action, options.get(action.dest, action.default))
    return argv


def _as_flags(action: argparse.Action, value: Any) -> list[str]:
    """The command-line flags that give `action` the value `value`."""
    flag = action.option_strings[-1]
    if value is None or value == action.default:
        return []
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return [flag]
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={element}" for element in value]
    return [f"{flag}={value}"]


# Every flag, its help and its other add_argument options; `dest` is the ConsumerOptions field it sets.
FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "--queue",
        "Queue to consume (repeatable; default: default).",
        {"dest": "queues", "action": "append", "metavar": "Q"},
    ),
    (
        "--weight",
        "Weighted order: each claim round takes queue Q first with odds proportional to N (repeatable; "
        "queues not named weigh 1). Without it, queues are taken strictly in the order given.",
        {"dest": "weights", "action": "append", "type": weight_arg, "metavar": "Q=N"},
    ),
    ("--concurrency", "Worker threads (default 8).", {"type": positive_int, "default": 8}),
    (
        "--prefetch",
        "Tasks claimed beyond the running ones: a fixed number, or auto (default): what the consumer "
        "starts in about 20 ms at its recent pace, up to 64.",
        {"type": prefetch_arg, "default": None, "metavar": "N|auto"},
    ),
    (
        "--lease",
        "Lease: how long after its last heartbeat a silent consumer is presumed dead.",
        {"dest": "lease_s", "type": duration_arg, "default": 30.0, "metavar": "SECONDS"},
    ),
    (
        "--grace",
        "On SIGTERM, how long running tasks may take to finish (default 30).",
        {"dest": "grace_s", "type": duration_arg, "default": 30.0, "metavar": "SECONDS"},
    ),
    ("--consumer-id", "Identity of this consumer (default: host-pid-random).", {}),
    (
        "--processes",
        "Process mode: run N consumer processes under a supervisor, with hard time limits (see README).",
        {"type": processes_arg, "metavar": "N"},
    ),
    (
        "--max-tasks-per-child",
        "Recycle a consumer process after N tasks.",
        {"dest": "max_tasks", "type": positive_int, "metavar": "N"},
    ),
    (
        "--max-memory-per-child",
        "Recycle a consumer process whose resident memory exceeds MB.",
        {"dest": "max_memory_mb", "type": positive_int, "metavar": "MB"},
    ),
    (
        "--timeout-grace",
        "Process mode: how long a handler may run past its timeout before its process is replaced (default 1).",
        {"dest": "hard_limit_grace_s", "type": duration_arg, "default": 1.0, "metavar": "SECONDS"},
    ),
    (
        "--async-concurrency",
        "async def handlers running at once on the consumer's event loop (default 100).",
        {"type": positive_int, "default": 100, "metavar": "N"},
    ),
    ("--supervisor-beat", argparse.SUPPRESS, {}),
    ("--supervisor-pid", argparse.SUPPRESS, {"type": positive_int}),
    ("--supervisor-lifeline", argparse.SUPPRESS, {"type": non_negative_int}),
    (
        "--metrics-port",
        "Serve /metrics, /healthz (liveness) and /readyz (readiness) on this port (0: any free one).",
        {"type": port_arg, "metavar": "P"},
    ),
    (
        "--metrics-host",
        f"Address the metrics port binds (default {METRICS_HOST}: this host only; 0.0.0.0 when the scraper runs "
        "in another container or host; IPv6 too: ::1, or :: for every address).",
        {"type": host_arg, "default": METRICS_HOST, "metavar": "ADDR"},
    ),
    (
        "--health-file",
        "Touch this file every few seconds while Redis answers (container liveness).",
        {"metavar": "PATH"},
    ),
    (
        "--burst",
        "Exit 0 once the queues have nothing pending, in flight or delayed (paused queues count as idle).",
        {"action": "store_true"},
    ),
    (
        "--no-scheduler",
        "Do not fire periodic tasks from this consumer.",
        {"dest": "scheduler", "action": "store_false"},
    ),
]
