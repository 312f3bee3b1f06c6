"""Epoch milliseconds, as Redis scores and records hold them, to and from datetimes."""

from datetime import UTC, datetime


def datetime_of_ms(ms: float) -> datetime | None:
    """Return epoch milliseconds as a UTC datetime; None beyond the calendar (e.g. a foreign nanosecond score)."""
    try:
        return datetime.fromtimestamp(ms / 1000, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return None


def ms_of_datetime(moment: datetime) -> int:
    """Return a timezone-aware datetime as epoch milliseconds."""
    return int(moment.timestamp() * 1000)
