"""Validation of a periodic task's fields, with errors keyed by the field to blame (for the admin and commands)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings

from tasks_app.periodic.schedule import InvalidSchedule, cron_error, zone
from tasks_app.protocol.codec import MAX_JSON_DEPTH, compact_json, depth, encode_arguments, payload_of


def schedule_errors(row: Any) -> dict[str, str]:
    """Field name ("__all__" for the whole row) -> what is wrong; empty if the row is a valid schedule."""
    errors: dict[str, str] = {}
    cron = (row.cron or "").strip()
    if bool(cron) == (row.interval_s is not None):
        errors["__all__"] = "Give either a cron expression or an interval in seconds (exactly one of the two)."
    if cron and (error := cron_error(cron)):
        errors["cron"] = error[0].upper() + error[1:] + "."
    try:
        zone(row.timezone or "")
    except InvalidSchedule as exc:
        errors["timezone"] = str(exc)[0].upper() + str(exc)[1:] + "."
    # Compared only as dates: a value full_clean refused (a number from TASKS_PERIODIC) stays as given.
    if isinstance(row.start_at, datetime) and isinstance(row.end_at, datetime) and row.end_at <= row.start_at:
        errors["end_at"] = "The end must be after the start."
    errors.update(argument_errors(row.args, row.kwargs))
    return errors


def argument_errors(args: Any, kwargs: Any) -> dict[str, str]:
    """Field name -> what is wrong with a schedule's arguments; empty if every run could carry them."""
    errors: dict[str, str] = {}
    if not isinstance(args, list):
        errors["args"] = 'Arguments must be a JSON array, e.g. [1, "a"].'
    if not isinstance(kwargs, dict):
        errors["kwargs"] = 'Keyword arguments must be a JSON object, e.g. {"days": 7}.'
    if errors:
        return errors
    # What the producer would refuse at every slot (NaN, a lone surrogate, too many bytes), said once
    # here; and nesting refused at enqueue from outside (which the database may not even store).
    sizes = {}
    for name, value in (("args", args), ("kwargs", kwargs)):
        if depth(value) > MAX_JSON_DEPTH:  # counted as the enqueue form and the API count it
            errors[name] = f"JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)."
            continue
        try:
            sizes[name] = len(compact_json(value, allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            errors[name] = f"Not JSON that a task can carry (no NaN or Infinity, no lone surrogates): {exc}."
    limit = settings.TASKS_MAX_PAYLOAD_BYTES
    if not errors and (size := len(payload_of(*encode_arguments(args, kwargs)))) > limit:
        largest = max(sizes, key=sizes.__getitem__)
        errors[largest] = f"The arguments take {size} bytes, over the limit of {limit} (TASKS_MAX_PAYLOAD_BYTES)."
    return errors
