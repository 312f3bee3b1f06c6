"""Free loopback ports for the servers the tests start: redis-server, cluster nodes, metrics, gunicorn.

Each pytest-xdist worker takes ports from a block of its own below the kernel's ephemeral range
(32768 and up on Linux), walking it from a random point: neither another worker, nor an earlier
pick of this one, nor an outgoing connection takes a port between its pick and the server's bind.
A Redis Cluster node also needs its bus port (port + 10000) free: the blocks lie in 10000-19999,
their bus ports in 20000-29999.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

FIRST_PORT = 10_000
BLOCK_SIZE = 1_000
BLOCKS = 10  # a worker past the tenth shares a block with another
CLUSTER_BUS_OFFSET = 10_000

_picks = itertools.count(random.randrange(BLOCK_SIZE))


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # set in each worker by pytest-xdist
    return FIRST_PORT + int(worker.removeprefix("gw") or 0) % BLOCKS * BLOCK_SIZE


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A port of this worker's block that nothing listens on (and, for a cluster node, whose bus port is free)."""
    start = _block_start()
    for _ in range(BLOCK_SIZE):
        port = start + next(_picks) % BLOCK_SIZE
        if _bindable(port) and (not cluster_bus or _bindable(port + CLUSTER_BUS_OFFSET)):
            return port
    raise RuntimeError(f"no free port in {start}-{start + BLOCK_SIZE - 1}")
