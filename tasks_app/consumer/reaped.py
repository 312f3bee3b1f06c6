"""What a consumer does with the tasks its reaper dead-lettered: count, log and record each."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

from django.conf import settings

from tasks_app import metrics
from tasks_app.consumer.retrying import until_done
from tasks_app.consumer.settle_writes import holds_unique_until_finished
from tasks_app.protocol import results
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.codec import UndecodableTask, decode_task
from tasks_app.task_types import TaskTypeCache

# The consumer's own logger: these lines were always the consumer's.
logger = logging.getLogger("tasks_app.consumer.lifecycle")


def record_reaped(
    broker: Broker, task_types: TaskTypeCache, queue: str, dead: list[bytes], *, give_up: threading.Event
) -> None:
    """Count, log and record as failed the tasks of a dead consumer that the reaper dead-lettered.

    The tasks are already dead letters, so no later pass records them: a write is retried
    through an outage (until `give_up`), and one Redis refuses is logged without stopping the rest.
    They failed for good, so a unique one frees its key (unique_until = finished).
    """
    now_ms = int(time.time() * 1000)
    for raw in dead:
        try:
            task = decode_task(raw)
        except UndecodableTask:
            continue
        task.queue = queue  # a foreign envelope's empty or other queue: where it died wins, as for a run
        metrics.TASKS_DEAD_LETTERED.labels(task.type, queue).inc()
        logger.error(
            "task %s dead-lettered: %s",
            task.id,
            task.dead_reason,
            extra={"task_id": task.id, "type": task.type, "queue": queue, "outcome": "dead_lettered"},
        )
        error = results.error_record("ConsumerDied", task.dead_reason)
        update = results.attempt_failed(
            task, error, now_ms, settings.TASKS_RESULT_TTL, final=True, dead_reason=task.dead_reason
        )
        try:
            until_done(partial(broker.record_result, update), what="record_result", give_up=give_up)
        except Exception as exc:
            logger.error("could not record dead-lettered task %s as failed: %s", task.id, exc)
        # Whether or not its record could be written: the task is dead either way.
        if holds_unique_until_finished(task, task_types.get(task.type)):
            try:
                release = partial(broker.release_unique, queue, task.unique_digest, task.id)
                until_done(release, what="release_unique", give_up=give_up)
            except Exception as exc:
                logger.error("could not free the uniqueness key of dead-lettered task %s: %s", task.id, exc)
