"""The log lines of settled tasks, written by a thread of their own so the next flush of acks need not wait for them.

The ack batcher is the one thread that gives a drain's slots back: a line per task cost it as
much as packing the task's writes. It hands each flush's lines here instead and goes on; they
are written in order, a flush's lines at once (`held_lines`). `close` writes what is left, so a
consumer that stops leaves none unwritten (a process killed with kill -9 may lose the last ones).
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
from collections.abc import Callable, Sequence

from tasks_app.logging import held_lines

logger = logging.getLogger(__name__)

Line = Callable[[], None]


class OutcomeLines:
    """A thread that runs the line-logging callables it is given, in order; inline until it is started."""

    def __init__(self) -> None:
        self._batches: queue_module.SimpleQueue[Sequence[Line] | None] = queue_module.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Write the lines added from now on from a thread of their own."""
        self._thread = threading.Thread(target=self._run, name="outcome-lines", daemon=True)
        self._thread.start()

    def add(self, lines: Sequence[Line]) -> None:
        """Log `lines` after every batch added before them (at once, if no thread writes them)."""
        if not lines:
            return
        if self._thread is None or not self._thread.is_alive():
            self._write(lines)
        else:
            self._batches.put(lines)

    def close(self, timeout_s: float | None = None) -> None:
        """Write every line added so far and stop the thread."""
        if self._thread is not None:
            self._batches.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while (lines := self._batches.get()) is not None:
            batch = list(lines)
            while True:  # whatever queued up meanwhile goes out in the same write
                try:
                    more = self._batches.get_nowait()
                except queue_module.Empty:
                    break
                if more is None:
                    self._write(batch)
                    return
                batch.extend(more)
            self._write(batch)

    @staticmethod
    def _write(lines: Sequence[Line]) -> None:
        with held_lines():
            for line in lines:
                try:
                    line()
                except Exception:
                    logger.exception("unexpected error logging a task's outcome")
