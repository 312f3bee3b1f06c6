"""A consumer's HTTP endpoint: `/metrics` for Prometheus, `/healthz` for liveness and `/readyz` for readiness."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from tasks_app.collectors import QueueCollector
from tasks_app.consumer.health import Liveness

if TYPE_CHECKING:
    from tasks_app.consumer.lifecycle import Consumer

StartResponse = Callable[..., Any]
# Metrics and health are served to this host only unless an address is given.
METRICS_HOST = "127.0.0.1"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow scrape never blocks a health check."""

    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    """The same on IPv6; bound to `::`, it takes IPv4 connections too (whatever the system's default)."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        """Bind, accepting IPv4 as well where the system allows it."""
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Do not log every scrape."""


def make_app(liveness: Liveness | None, registry: CollectorRegistry = REGISTRY) -> Callable[..., Iterable[bytes]]:
    """Return a WSGI app serving `/healthz` and `/readyz` from `liveness` and metrics on every other path."""
    metrics_app: Callable[..., Iterable[bytes]] = make_wsgi_app(registry)
    checks: dict[str, Callable[[Liveness], bool]] = {"/healthz": Liveness.healthy, "/readyz": Liveness.ready}

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        check = checks.get(environ.get("PATH_INFO", ""))
        if check is not None:
            healthy = liveness is None or check(liveness)
            body = liveness.report() if liveness is not None else b'{"status": "ok"}'
            start_response(
                "200 OK" if healthy else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return metrics_app(environ, start_response)

    return app


def serve(
    port: int, liveness: Liveness | None, addr: str = METRICS_HOST, registry: CollectorRegistry = REGISTRY
) -> WSGIServer:
    """Serve metrics and health on `addr:port` (an IPv4 or IPv6 address, or a host name) from a daemon thread."""
    addr = addr.removeprefix("[").removesuffix("]")  # [::1] as in a URL
    server_class = _ThreadingServer6 if ":" in addr else _ThreadingServer
    server = make_server(addr, port, make_app(liveness, registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def serve_consumer_metrics(consumer: Consumer, port: int, addr: str = METRICS_HOST) -> WSGIServer:
    """Export the queue depths of `consumer`'s Redis and serve metrics and its liveness on `port`."""
    server = serve(port, consumer.liveness, addr)  # first: a port it cannot bind leaves nothing registered
    REGISTRY.register(QueueCollector(lambda: consumer.broker, consumer.options.queues))
    return server
