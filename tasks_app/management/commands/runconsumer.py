"""`manage.py runconsumer`: run a consumer until stopped."""

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.consumer.lifecycle import Consumer
from tasks_app.consumer.metrics_http import METRICS_HOST
from tasks_app.consumer.options import ConsumerOptions


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"cannot be negative, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


class Command(BaseCommand):
    help = "Claim and run tasks from the given queues until SIGTERM/SIGINT (or, with --burst, until idle)."

    def add_arguments(self, parser: CommandParser) -> None:
        _add_run_arguments(parser)
        _add_observability_arguments(parser)
        parser.add_argument(
            "--burst", action="store_true", help="Exit 0 once the queues have nothing pending, in flight or delayed."
        )
        parser.add_argument(
            "--no-scheduler", action="store_true", help="Do not fire periodic tasks from this consumer."
        )

    def handle(
        self,
        *args: Any,
        queues: list[str] | None,
        concurrency: int,
        prefetch: int,
        lease: float,
        grace: float,
        consumer_id: str | None,
        metrics_port: int | None,
        metrics_host: str,
        burst: bool,
        health_file: str | None,
        no_scheduler: bool,
        **options: Any,
    ) -> None:
        consumer_options = ConsumerOptions(
            queues=queues or ["default"],
            concurrency=concurrency,
            prefetch=prefetch,
            lease_s=lease,
            grace_s=grace,
            consumer_id=consumer_id,
            burst=burst,
            health_file=health_file,
            scheduler=not no_scheduler,
        )
        try:
            consumer = Consumer(consumer_options)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if metrics_port is not None:
            _serve_metrics(consumer, metrics_port, metrics_host)
        consumer.install_signal_handlers()
        exit_code = consumer.run()
        if exit_code:
            raise SystemExit(exit_code)


def _add_run_arguments(parser: CommandParser) -> None:
    parser.add_argument(
        "--queue",
        dest="queues",
        action="append",
        metavar="Q",
        help="Queue to consume (repeatable; default: default).",
    )
    parser.add_argument("--concurrency", type=positive_int, default=8, help="Worker threads (default 8).")
    parser.add_argument(
        "--prefetch", type=non_negative_int, default=8, help="Tasks claimed beyond the running ones (default 8)."
    )
    parser.add_argument(
        "--lease",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="Lease: how long after its last heartbeat a silent consumer is presumed dead.",
    )
    parser.add_argument(
        "--grace",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="On SIGTERM, how long running tasks may take to finish (default 30).",
    )
    parser.add_argument("--consumer-id", help="Identity of this consumer (default: host-pid-random).")


def _add_observability_arguments(parser: CommandParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=non_negative_int,
        metavar="P",
        help="Serve Prometheus metrics (/metrics) and liveness (/healthz) on this port.",
    )
    parser.add_argument(
        "--metrics-host",
        default=METRICS_HOST,
        metavar="ADDR",
        help=f"Address the metrics port binds (default {METRICS_HOST}: this host only; "
        "0.0.0.0 when the scraper runs in another container or host).",
    )
    parser.add_argument(
        "--health-file",
        metavar="PATH",
        help="Touch this file every few seconds while Redis answers (container liveness).",
    )


def _serve_metrics(consumer: Consumer, port: int, host: str) -> None:
    from tasks_app.consumer.metrics_http import serve_consumer_metrics

    try:
        serve_consumer_metrics(consumer, port, host)
    except OSError as exc:
        raise CommandError(f"cannot serve metrics on port {port} of {host}: {exc.strerror or exc}") from None
