"""Writes the results and acks of finished tasks from every worker thread in one round trip per flush.

Workers hand their writes to one flusher thread and move on to the next task. The flusher takes
whatever has queued up while its previous round trip was in flight (no deliberate wait, so an
idle consumer adds no latency), writes every result record first and then acks the tasks, one
script per processing list. A task keeps its consumer slot until its ack is written, so a crash
can only re-run tasks this consumer held: never more than concurrency + prefetch.
"""
from __future__ import annotations

import logging
import queue as queue_module
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .broker import Broker, ResultUpdate
from .retrying import GaveUp, until_done

logger = logging.getLogger(__name__)

MAX_BATCH = 512

AckDone = Callable[[bool | None], None]
"""Called once an ack was written: True if the task was still held, False if it was lost,
None if the consumer stopped before Redis could be reached (the lease recovers the task)."""


@dataclass(frozen=True)
class _Ack:
    queue: str
    consumer_id: str
    raw: bytes
    update: ResultUpdate | None
    done: AckDone


def merge_updates(updates: Sequence[ResultUpdate]) -> list[ResultUpdate]:
    """Fold successive updates of one task into one write where that changes nothing; keep order."""
    merged: list[ResultUpdate] = []
    last_of: dict[str, int] = {}
    for update in updates:
        index = last_of.get(update.task_id)
        if index is not None:
            earlier = merged[index]
            # One write can append one worker id and one error, and belongs to one run.
            if not (earlier.append_worker_id and update.append_worker_id) \
                    and not (earlier.append_error and update.append_error) \
                    and (earlier.run or update.run) == (update.run or earlier.run):
                merged[index] = replace(earlier, fields={**earlier.fields, **update.fields}, ttl_s=update.ttl_s,
                                        append_worker_id=earlier.append_worker_id or update.append_worker_id,
                                        append_error=earlier.append_error or update.append_error,
                                        run=earlier.run or update.run)
                continue
        last_of[update.task_id] = len(merged)
        merged.append(update)
    return merged


class AckBatcher:
    """A flusher thread that batches result writes and acks; `record`, `ack` and `barrier` feed it."""

    def __init__(self, broker: Broker, give_up: threading.Event, max_batch: int = MAX_BATCH) -> None:
        self.broker = broker
        self.give_up = give_up
        self.max_batch = max_batch
        self._entries: queue_module.SimpleQueue[ResultUpdate | _Ack | threading.Event | None] = \
            queue_module.SimpleQueue()
        self._thread: threading.Thread | None = None

    # --- producers (worker threads) --------------------------------------------------------
    def record(self, update: ResultUpdate) -> None:
        """Write a result update with the next flush (before anything submitted after it)."""
        self._entries.put(update)

    def ack(self, queue: str, consumer_id: str, raw: bytes, update: ResultUpdate | None, done: AckDone) -> None:
        """Write `update`, then ack the task, with the next flush; `done` is called afterwards."""
        self._entries.put(_Ack(queue, consumer_id, raw, update, done))

    def barrier(self) -> None:
        """Wait until everything submitted so far has been written."""
        if self._thread is None or not self._thread.is_alive():
            self.flush_once(block_s=0)
            return
        written = threading.Event()
        self._entries.put(written)
        while not written.wait(0.5):
            if not self._thread.is_alive():
                self.flush_once(block_s=0)
                return

    # --- the flusher -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the flusher thread."""
        self._thread = threading.Thread(target=self._run, name="ack-batcher", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush everything submitted so far and stop the flusher thread."""
        if self._thread is None:
            self.flush_once(block_s=0)
            return
        self._entries.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                if self.flush_once(block_s=1.0) is None:
                    return
            except Exception:  # a bug must not stop acknowledging; the entries' leases stay safe
                logger.exception("unexpected error flushing results and acks")

    def flush_once(self, block_s: float) -> int | None:
        """Write one batch; return how many entries it held, or None once asked to stop."""
        try:
            item = self._entries.get(timeout=block_s) if block_s > 0 else self._entries.get_nowait()
        except queue_module.Empty:
            return 0
        batch: list[ResultUpdate | _Ack | threading.Event] = []
        stopping = False
        while True:
            if item is None:
                stopping = True
            else:
                batch.append(item)
            if len(batch) >= self.max_batch:
                break
            try:
                item = self._entries.get_nowait()
            except queue_module.Empty:
                break
        self._write(batch)
        if stopping:
            while self.flush_once(block_s=0):  # whatever was submitted after the stop request
                pass
            return None
        return len(batch)

    def _write(self, batch: list[ResultUpdate | _Ack | threading.Event]) -> None:
        updates: list[ResultUpdate] = []
        acks: dict[tuple[str, str], list[_Ack]] = {}
        barriers: list[threading.Event] = []
        for item in batch:
            if isinstance(item, ResultUpdate):
                updates.append(item)
            elif isinstance(item, _Ack):
                if item.update is not None:
                    updates.append(item.update)
                acks.setdefault((item.queue, item.consumer_id), []).append(item)
            else:
                barriers.append(item)
        if updates or acks:
            raws = {owner: [a.raw for a in items] for owner, items in acks.items()}
            try:
                flags: dict[tuple[str, str], list[bool]] | None = until_done(
                    lambda: self.broker.ack_many(merge_updates(updates), raws), what="ack", give_up=self.give_up)
            except GaveUp:
                logger.error("gave up writing %d ack(s) while stopping; the lease will recover those tasks",
                             sum(len(items) for items in acks.values()))
                flags = None
            for owner, items in acks.items():
                for index, item in enumerate(items):
                    try:
                        item.done(None if flags is None else flags[owner][index])
                    except Exception:
                        logger.exception("unexpected error after acknowledging a task")
        for event in barriers:
            event.set()

