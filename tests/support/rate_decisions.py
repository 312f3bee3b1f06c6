"""The rate decisions Redis ran for one limiter, as MONITOR saw them (server clock)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import TimeoutError as RedisTimeoutError

from tasks_app.protocol.broker import Broker


@contextmanager
def rate_decisions(broker: Broker, task_type: str) -> Iterator[list[tuple[float, str]]]:
    """While open, collect (server ms, task id) of every `rate_limit` decision on `task_type`'s limiter, in order.

    A task's last decision is the one that admitted it: an admitted task starts, a denied one asks again.
    """
    decided: list[tuple[float, str]] = []
    rate_key, last = broker.keys.rate(task_type), f"ECHO {uuid.uuid4().hex}"
    sha = broker.scripts.shas["rate_limit"]
    monitor = broker.client.monitor()
    monitor.__enter__()  # MONITOR is on before the first decision

    def read() -> None:
        while True:
            try:
                command = monitor.next_command()
            except RedisTimeoutError:  # a quiet server: keep listening
                continue
            if command["command"] == last:  # every command before it has been read
                return
            words = command["command"].split(" ")
            # By its sha: the limiter's other scripts (rate_deferred, rate_followed...) take its key too.
            ours = command["client_type"] != "lua" and words[0].upper() == "EVALSHA" and words[1] == sha
            if ours and rate_key in words:
                task_id = words[words.index(rate_key) + 4]  # after the three keys and the algorithm
                if task_id:  # "" only brings the hash to new settings
                    decided.append((command["time"] * 1000, task_id))

    reader = threading.Thread(target=read, name="rate-decisions", daemon=True)
    reader.start()
    try:
        yield decided
    finally:
        broker.client.echo(last.split(" ")[1])  # the reader stops at it
        reader.join(10)
        monitor.__exit__()


def admissions_ms(decided: list[tuple[float, str]]) -> dict[str, float]:
    """Each task's admission: the time of its last decision."""
    return {task_id: at_ms for at_ms, task_id in decided}
