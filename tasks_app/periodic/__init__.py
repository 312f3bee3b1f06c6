"""Periodic tasks: schedules (slot arithmetic), their rows as snapshots, code schedules, firing and status."""
