"""A private `redis-server` on a free loopback port, for the benchmarks and the tests (standard library only).

Bench scripts and peer drivers import it as `private_redis` (bench/ is on their path; peer
drivers run in virtualenvs of their own, so nothing here imports a third-party package), the
tests as `bench.private_redis` (the repository root is on theirs).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

READY_TIMEOUT_S = 20.0


def free_port() -> int:
    """Return a TCP port on loopback that nothing listens on (and whose cluster bus port is free)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisServer:
    """One `redis-server` on a free loopback port (no snapshots), with its data in a directory of its own."""

    def __init__(self, directory: Path, *options: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.directory = directory / f"redis-{self.port}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.options = list(options)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server (again, on the same port and data) and wait until it answers, its data loaded."""
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        with open(self.directory / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                [*argv, "--save", "", "--daemonize", "no", *self.options], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._loaded():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{self.log()}")
            time.sleep(0.05)
        return self

    def _loaded(self) -> bool:
        """True once this server (not another one on its port) answers and has loaded its data."""
        try:
            info = subprocess.run(
                ["redis-cli", "-p", str(self.port), "INFO", "everything"], capture_output=True, text=True, timeout=5
            )
        except subprocess.TimeoutExpired:
            return False
        fields = dict(line.split(":", 1) for line in info.stdout.split() if ":" in line)
        if "process_id" in fields and self.process is not None and int(fields["process_id"]) != self.process.pid:
            raise RuntimeError(f"port {self.port} is another server's (pid {fields['process_id']}):\n{self.log()}")
        return fields.get("loading") == "0"

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed beyond what the fsync policy did)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def log(self) -> str:
        """The end of the server's log."""
        path = self.directory / "redis.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def remove(self) -> None:
        """Kill the server and delete its data."""
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)
