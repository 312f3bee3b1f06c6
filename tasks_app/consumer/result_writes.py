"""What the ack batcher does to result updates before they are written: merging, and what cannot be stored."""

from __future__ import annotations

from collections.abc import Sequence

from tasks_app.protocol import results
from tasks_app.protocol.jsontext import is_utf8_encodable
from tasks_app.protocol.replies import ResultUpdate

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
    reason = results.clean_text(f"the result of this run could not be stored: {problem}", MAX_REASON_BYTES)
    fields = {"status": results.FAILED, "dead_reason": reason}
    if "finished_at_ms" in update.fields:
        fields["finished_at_ms"] = update.fields["finished_at_ms"]
    error = results.error_record("tasks_app.ResultNotStored", reason)
    return ResultUpdate(
        results.clean_text(update.task_id, MAX_REASON_BYTES),
        fields,
        update.ttl_s,
        append_error=error,
        fence=update.fence,
        queue=update.queue,
        task_type=update.task_type,
        run_s=update.run_s,
        held_by=update.held_by,
    )
