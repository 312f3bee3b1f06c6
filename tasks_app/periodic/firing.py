"""Firing a periodic task: its runs encoded as ordinary tasks (the producer's `prepare`), pushed by one script."""

from __future__ import annotations

import uuid

from tasks_app.periodic.config import PeriodicConfig
from tasks_app.producer import EnqueuedTask, TaskRequest, enqueue_many, prepare
from tasks_app.protocol.broker import Broker
from tasks_app.protocol.enqueue import UniqueEnqueueable
from tasks_app.protocol.periodic import ELSEWHERE, FireReply, SlotFiring
from tasks_app.protocol.records import PERIODIC_HEADER
from tasks_app.registry import Registry, registry as default_registry

# Headers of periodic runs: the schedule and its slot (ms); a catch-up or a manual run's mark.
SCHEDULE_HEADER = PERIODIC_HEADER
SLOT_HEADER = "periodic_slot_ms"
CATCH_UP_HEADER = "periodic_catch_up"
MANUAL_HEADER = "periodic_manual"

# Run ids derive from (schedule, slot, kind): a replay of a slot can only name the same task.
_RUN_IDS = uuid.UUID("5d1f4f0e-7c53-4a4e-9a43-7b0d3f6c9e21")


def run_id(schedule: str, slot_ms: int, kind: str = "run") -> str:
    """The task id of the run of `schedule` for `slot_ms` (`kind` "run" or "catch_up")."""
    return str(uuid.uuid5(_RUN_IDS, f"{schedule}\x00{slot_ms}\x00{kind}"))


def fire_slot(
    config: PeriodicConfig, firing: SlotFiring, broker: Broker, *, registry: Registry = default_registry
) -> FireReply:
    """Fire one slot of a schedule (and one catch-up run when its policy says so); raise EnqueueError if invalid."""
    reply = _fire_into(config.target_queue, config, firing, broker, registry)
    if reply.outcome == ELSEWHERE:
        reply = _fire_into(reply.queue, config, firing, broker, registry)
    return reply


def _fire_into(
    queue: str | None, config: PeriodicConfig, firing: SlotFiring, broker: Broker, registry: Registry
) -> FireReply:
    slot = {SLOT_HEADER: str(firing.slot_ms)}
    requests = [_request(config, queue, slot, run_id(config.name, firing.slot_ms, "run"))]
    if config.catch_up == "once":
        catch_up_id = run_id(config.name, firing.slot_ms, "catch_up")
        requests.append(_request(config, queue, {**slot, CATCH_UP_HEADER: "1"}, catch_up_id))
    batch = prepare(requests, registry=registry)
    runs = [task.item if isinstance(task, UniqueEnqueueable) else task for task in batch.tasks]
    try:
        reply = broker.periodic.fire_periodic(
            config.name, firing, runs[0], runs[1] if len(runs) > 1 else None, batch.result_ttl_s
        )
    except BaseException as exc:
        batch.sent(exc)
        raise
    if reply.pushed:
        batch.sent()
    else:  # another consumer fired the slot: this call's span sent nothing
        batch.sends.end([])
    return reply


def run_now(config: PeriodicConfig) -> EnqueuedTask:
    """Enqueue one run of a schedule now, outside its slots (its state in Redis is not touched)."""
    return enqueue_many([_request(config, config.target_queue, {MANUAL_HEADER: "1"})])[0]


def _request(
    config: PeriodicConfig, queue: str | None, headers: dict[str, str], task_id: str | None = None
) -> TaskRequest:
    return TaskRequest(
        type=config.task_type,
        args=config.args,
        kwargs=config.kwargs,
        queue=queue,
        priority=config.priority,
        headers={SCHEDULE_HEADER: config.name, **headers},
        task_id=task_id,
    )
