"""Validation of a periodic task's fields, with errors keyed by the field to blame (for the admin and commands)."""

from __future__ import annotations

from typing import Any

from tasks_app.periodic.schedule import InvalidSchedule, cron_error, zone


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
    if row.start_at and row.end_at and row.end_at <= row.start_at:
        errors["end_at"] = "The end must be after the start."
    errors.update(argument_errors(row.args, row.kwargs))
    return errors


def argument_errors(args: Any, kwargs: Any) -> dict[str, str]:
    """Field name -> what is wrong with a schedule's arguments; empty if `args` is a list and `kwargs` a dict."""
    errors: dict[str, str] = {}
    if not isinstance(args, list):
        errors["args"] = 'Arguments must be a JSON array, e.g. [1, "a"].'
    if not isinstance(kwargs, dict):
        errors["kwargs"] = 'Keyword arguments must be a JSON object, e.g. {"days": 7}.'
    return errors
