"""Writes the results and acks of finished tasks from every worker thread in one round trip per flush.

The flusher takes whatever queued up during its previous round trip, writes every result record
first, then the acks (on Redis Cluster, once a replica holds the results). A task keeps its room
until its ack is written, so a crash re-runs at most concurrency + prefetch tasks. A batch Redis
refuses is written again entry by entry, a refused result replaced by a record saying why.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queue_module
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from tasks_app import metrics
from tasks_app.consumer.loops import REFUSED_AFTER, GaveUp, until_done
from tasks_app.logging import held_lines
from tasks_app.problem_log import ProblemLog
from tasks_app.protocol import records
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import is_utf8_encodable
from tasks_app.protocol.queue import AckReport, UniqueRelease
from tasks_app.protocol.records import ResultUpdate

logger = logging.getLogger(__name__)

MAX_BATCH = 512

# Called once an ack was written: True if the task was still held, False if lost, None if unknown (stopping).
AckDone = Callable[[bool | None], None]


@dataclass(slots=True)  # not frozen: one per task, and frozen costs four times as much to build
class _Ack:
    queue: str
    consumer_id: str
    raw: bytes
    update: ResultUpdate | None
    done: AckDone
    log: Callable[[], None] | None = None  # called after every `done` of its batch
    release: UniqueRelease | None = None  # the uniqueness key its ack frees, if the task is still held


@dataclass(frozen=True)
class _Start:
    """A run's first write, whose reply its worker waits for: 2 means the task was cancelled."""

    update: ResultUpdate
    written: threading.Event = field(default_factory=threading.Event)
    reply: list[Any] = field(default_factory=list)


Entry = ResultUpdate | _Ack | _Start


def through_outages[T](broker: Broker, give_up: threading.Event, call: Callable[[], T], what: str) -> T:
    """`call()` retried through outages; WriteRefused once Redis keeps refusing it while answering."""
    return until_done(
        call, what=what, give_up=give_up, refused_after=REFUSED_AFTER, redis_answers=broker.inspect.answers
    )


class AckBatcher:
    """A flusher thread that batches result writes and acks; `record`, `ack` and `barrier` feed it."""

    def __init__(
        self,
        broker: Broker,
        give_up: threading.Event,
        max_batch: int = MAX_BATCH,
        together: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.broker = broker
        self.give_up = give_up
        self.max_batch = max_batch
        self._together = together  # the block the `done`s of a flush are called in (their room freed at once)
        self.lines = OutcomeLines()
        self._entries: queue_module.SimpleQueue[Entry | threading.Event | None] = queue_module.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._in_place = threading.Lock()  # one thread at a time writes batches when no flusher runs

    def record(self, update: ResultUpdate) -> None:
        """Write a result update with the next flush (before anything submitted after it)."""
        if storable(update):
            self._entries.put(update)
        else:  # a later outcome of the same run follows; this one is not worth failing the task
            logger.error("dropped a result update of task %a that cannot be encoded as UTF-8", update.task_id)

    def ack(
        self,
        queue: str,
        consumer_id: str,
        raw: bytes,
        update: ResultUpdate | None,
        done: AckDone,
        log: Callable[[], None] | None = None,
        release: UniqueRelease | None = None,
    ) -> None:
        """Write `update`, then ack the task (freeing `release`), with the next flush; then call `done`, then `log`."""
        if update is not None:  # written with the ack, held by its task (the update is this ack's alone)
            update.held_by = ((queue, consumer_id), raw)
        if update is not None and not storable(update):
            update = unstored_result(update, "it holds text that is not valid Unicode (a lone surrogate)")
        self._entries.put(_Ack(queue, consumer_id, raw, update, done, log, release))

    def record_start(self, update: ResultUpdate) -> Any:
        """Write a run's first update with the next flush and wait: Redis's reply (2: cancelled), None if unwritten."""
        if not storable(update):
            return None
        entry = _Start(update)
        self._entries.put(entry)
        self._wait(entry.written)
        return entry.reply[0] if entry.reply else None

    def barrier(self) -> None:
        """Wait until everything submitted so far has been written."""
        written = threading.Event()
        self._entries.put(written)
        self._wait(written)

    def _wait(self, written: threading.Event) -> None:
        """Wait for `written`; with no flusher thread, write batches from this thread until it opens (in order)."""
        while self._thread is not None and self._thread.is_alive():
            if written.wait(0.5):
                return
        with self._in_place:
            while not written.is_set() and self.flush_once(block_s=0):
                pass

    def start(self) -> None:
        """Start the flusher thread (and the one writing the acks' log lines)."""
        self.lines.start()
        self._thread = threading.Thread(target=self._run, name="ack-batcher", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Flush everything submitted so far, write its log lines and stop the threads."""
        if self._thread is None:
            self.flush_once(block_s=0)
        else:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            self._entries.put(None)
            self._thread.join(timeout_s)
            timeout_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.lines.close(timeout_s)

    def _run(self) -> None:
        bugs: ProblemLog[str] = ProblemLog(logger)  # a bug met at every flush is said once
        while True:
            try:
                flushed = self.flush_once(block_s=1.0)
            except Exception as exc:  # a bug must not stop acknowledging; the entries' leases stay safe
                bugs.failed("flush", repr(exc), "unexpected error flushing results and acks", exc_info=True)
                continue
            if flushed is None:
                return
            if flushed:
                bugs.recovered("flush", "results and acks flushed again")

    def flush_once(self, block_s: float) -> int | None:
        """Write one batch; return how many entries it held, or None once asked to stop."""
        try:
            item = self._entries.get(timeout=block_s) if block_s > 0 else self._entries.get_nowait()
        except queue_module.Empty:
            return 0
        batch: list[Entry | threading.Event] = []
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

    def _write(self, batch: list[Entry | threading.Event]) -> None:
        starts: list[Entry | threading.Event] = [item for item in batch if isinstance(item, _Start)]
        if starts and len(starts) < len(batch):  # handlers wait for their start: no ack's replica WAIT before it
            self._write(starts)
            batch = [item for item in batch if not isinstance(item, _Start)]
        entries = [item for item in batch if not isinstance(item, threading.Event)]
        acks = [item for item in entries if isinstance(item, _Ack)]
        flags: dict[int, bool | None] = {}
        try:
            if entries:
                flags = self._write_batch(entries)
        finally:  # whatever happened, every task's room comes back and every barrier opens
            with self._together():
                for ack in acks:
                    try:
                        ack.done(flags.get(id(ack)))
                    except Exception:
                        logger.exception("unexpected error after acknowledging a task")
            for item in batch:
                if isinstance(item, threading.Event):
                    item.set()
                elif isinstance(item, _Start):
                    item.written.set()
            self.lines.add([ack.log for ack in acks if ack.log is not None])

    def _write_batch(self, entries: list[Entry]) -> dict[int, bool | None]:
        """Write a batch in one round trip; if it fails as a whole, write its entries one by one."""
        acks = [item for item in entries if isinstance(item, _Ack)]
        starts = [item for item in entries if isinstance(item, _Start)]
        in_order = [item if isinstance(item, ResultUpdate) else item.update for item in entries]
        try:
            return self._send([update for update in in_order if update is not None], acks, starts)
        except GaveUp:
            logger.error("gave up writing %d ack(s) while stopping; the lease will recover those tasks", len(acks))
            return {}
        except Exception as exc:  # a write that keeps failing on the wire while Redis answers, or a bug
            logger.warning("a batch of %d result(s) and ack(s) failed (%s); writing them one by one", len(entries), exc)
        flags: dict[int, bool | None] = {}
        for entry in entries:
            flags.update(self._write_alone(entry))
        return flags

    def _write_alone(self, entry: Entry) -> dict[int, bool | None]:
        """Write one entry; an outcome that cannot be written is replaced by a FAILED record, at worst dropped."""
        if isinstance(entry, ResultUpdate):
            self._try_send([entry], [])
            return {}
        if isinstance(entry, _Start):
            self._try_send([entry.update], [], [entry])
            return {}
        plans: list[list[ResultUpdate]] = [[entry.update] if entry.update else []]
        if entry.update is not None:  # then its failure, then at worst the ack alone
            plans += [[unstored_result(entry.update, "Redis refused the write")], []]
        for updates in plans:  # the failed batch may have been applied: a task gone is not known lost
            flags = self._try_send(updates, [entry], resent=True)
            if flags is not None:
                # Acked without its result (Redis refused the two together, a large task's twice): written now.
                acked_alone = entry.update is not None and not updates and flags.get(id(entry)) is True
                if acked_alone and entry.update and (problem := self._write_unheld(entry.update)) is not None:
                    self._record_unstored(entry.update, problem)
                return flags
        return {}

    def _write_unheld(self, update: ResultUpdate) -> Exception | None:
        """Write one result held by nothing, retried through outages; the error it was refused with, or None."""
        try:
            unheld = [replace(update, held_by=None)]
            refused = through_outages(
                self.broker,
                self.give_up,
                lambda: self.broker.queue.ack_many_reporting(unheld, {}).refused,
                "record_result",
            )
        except GaveUp:
            return None  # stopping: nothing more can be written
        except Exception as exc:
            return exc
        return refused.get(0)

    def _try_send(
        self, updates: list[ResultUpdate], acks: list[_Ack], starts: Sequence[_Start] = (), *, resent: bool = False
    ) -> dict[int, bool | None] | None:
        try:
            return self._send(updates, acks, starts, resent=resent)
        except GaveUp:  # the lease recovers the tasks
            return {}
        except Exception as exc:
            logger.error("Redis refused a write of %d result(s) and %d ack(s): %s", len(updates), len(acks), exc)
            return None

    def _send(
        self, updates: list[ResultUpdate], acks: list[_Ack], starts: Sequence[_Start] = (), *, resent: bool = False
    ) -> dict[int, bool | None]:
        """One round trip (through outages); each ack's flag by its id() (`resent`: a task gone may be acked)."""
        by_owner: dict[tuple[str, str], list[_Ack]] = {}
        for item in acks:
            by_owner.setdefault((item.queue, item.consumer_id), []).append(item)
        raws = {owner: [item.raw for item in items] for owner, items in by_owner.items()}
        releases = {owner: [item.release for item in items] for owner, items in by_owner.items()}
        merged = merge_updates(updates)
        sends = 0

        def send() -> AckReport:
            nonlocal sends
            sends += 1
            return self.broker.queue.ack_many_reporting(merged, raws, releases=releases)

        flags, refused, unreplicated, written = through_outages(self.broker, self.give_up, send, "ack")
        if unreplicated:  # acked anyway: a lagging replica must not hold acks back
            metrics.RESULT_REPLICATION_TIMEOUTS.inc(unreplicated)
            logger.warning(
                "%d master(s) did not confirm results on a replica within the wait; acked anyway", unreplicated
            )
        replies = {update.task_id: reply for update, reply in zip(merged, written, strict=False)}
        for start in starts:
            start.reply.append(replies.get(start.update.task_id))
        refused_of = {merged[index].task_id: exc for index, exc in refused.items()}
        for item in acks:
            if item.update is not None and item.update.task_id in refused_of:
                self._record_unstored(item.update, refused_of.pop(item.update.task_id))
        for task_id, exc in refused_of.items():
            logger.error("dropped a result update of task %a that Redis refused: %s", task_id, exc)
        by_ack: dict[int, bool | None] = {
            id(item): flag for owner, items in by_owner.items() for item, flag in zip(items, flags[owner], strict=True)
        }
        if (resent or sends > 1) and not all(by_ack.values()):
            gone = sum(1 for flag in by_ack.values() if not flag)
            logger.info("%d task(s) of a batch sent again after a failed send were acked by it or recovered", gone)
            return {key: flag or None for key, flag in by_ack.items()}
        return by_ack

    def _record_unstored(self, update: ResultUpdate, problem: Exception) -> None:
        logger.error("the result of task %a could not be stored (%s); recording it as failed", update.task_id, problem)
        # After the ack: held by nothing, as the task left the list.
        if (again := self._write_unheld(unstored_result(update, str(problem)))) is not None:
            logger.error("could not record the failure of task %a either: %s", update.task_id, again)


# Cap of the reason stored when a result could not be written.
MAX_REASON_BYTES = 4096


def merge_updates(updates: Sequence[ResultUpdate]) -> list[ResultUpdate]:
    """Fold successive updates of one task into one write where that changes nothing; keep order."""
    merged: list[ResultUpdate] = []
    last_of: dict[str, int] = {}
    for update in updates:
        index = last_of.get(update.task_id)
        if index is not None:
            earlier = merged[index]
            # One write can append one worker id and one error, and belongs to one run.
            if (
                not (earlier.append_worker_id and update.append_worker_id)
                and not (earlier.append_error and update.append_error)
                and (earlier.fence or update.fence) == (update.fence or earlier.fence)
            ):
                merged[index] = ResultUpdate(  # not dataclasses.replace: per task, and replace costs twice as much
                    earlier.task_id,
                    {**earlier.fields, **update.fields},
                    update.ttl_s,
                    earlier.append_worker_id or update.append_worker_id,
                    earlier.append_error or update.append_error,
                    earlier.fence or update.fence,
                    earlier.queue or update.queue,  # where the history and the charts file it
                    earlier.task_type or update.task_type,
                    update.run_s if update.run_s is not None else earlier.run_s,
                    earlier.held_by or update.held_by,
                )
                continue
        last_of[update.task_id] = len(merged)
        merged.append(update)
    return merged


def storable(update: ResultUpdate) -> bool:
    """True if every text of `update` can be sent to Redis as UTF-8."""
    texts = [update.task_id, update.append_worker_id or "", *update.fields, *update.fields.values()]
    if update.append_error:
        texts += update.append_error.values()
    return is_utf8_encodable("".join(texts))  # one lone surrogate fails the whole text


def unstored_result(update: ResultUpdate, problem: str) -> ResultUpdate:
    """What to record instead of an outcome that could not be written: the task FAILED, and why."""
    reason = records.clean_text(f"the result of this run could not be stored: {problem}", MAX_REASON_BYTES)
    fields = {"status": records.FAILED, "dead_reason": reason}
    if "finished_at_ms" in update.fields:
        fields["finished_at_ms"] = update.fields["finished_at_ms"]
    error = records.error_record("tasks_app.ResultNotStored", reason)
    return ResultUpdate(
        records.clean_text(update.task_id, MAX_REASON_BYTES),
        fields,
        update.ttl_s,
        append_error=error,
        fence=update.fence,
        queue=update.queue,
        task_type=update.task_type,
        run_s=update.run_s,
        held_by=update.held_by,
    )


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
