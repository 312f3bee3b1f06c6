"""A consumer built by the test (its own brokers) running in a thread of this process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tasks_app.consumer.lifecycle import Consumer


@contextlib.contextmanager
def running(consumer: Consumer, exit_code: int = 0) -> Iterator[Consumer]:
    """Run `consumer` in a thread; stop it at exit and check it stopped cleanly (`exit_code`, no crash)."""
    exit_codes: list[int] = []
    crashes: list[BaseException] = []

    def run() -> None:
        try:
            exit_codes.append(consumer.run())
        except BaseException as exc:  # reported at exit: a consumer that crashed fails the test
            crashes.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield consumer
    finally:
        consumer.request_stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "consumer did not stop"
        if crashes:
            raise AssertionError(f"consumer crashed: {crashes[0]!r}") from crashes[0]
    assert exit_codes == [exit_code], f"consumer exited with {exit_codes}"
