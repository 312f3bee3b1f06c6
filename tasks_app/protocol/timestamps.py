"""Epoch milliseconds, as Redis scores and records hold them (µs in the fraction), to and from datetimes."""

import math
import time
from datetime import UTC, datetime, timedelta


def datetime_of_ms(ms: float) -> datetime | None:
    """Return epoch ms as a UTC datetime to the µs; None beyond the calendar (a producer's nanosecond score)."""
    try:
        whole_ms = math.floor(ms)
        moment = datetime.fromtimestamp(whole_ms // 1000, tz=UTC)
        return moment + timedelta(milliseconds=whole_ms % 1000, microseconds=round((ms - whole_ms) * 1000))
    except (OverflowError, OSError, ValueError):
        return None


# The largest whole ms a score is read as: +inf from a producer's record must not overflow int().
MAX_SCORE_MS = 2**63 - 1


def ms_of_score(score: float) -> int:
    """A sorted-set score read as whole epoch ms, an infinite one as the end of the range (never an error)."""
    if math.isfinite(score):
        return int(score)
    return MAX_SCORE_MS if score > 0 else -MAX_SCORE_MS


def ms_of_datetime(moment: datetime) -> int:
    """Return a timezone-aware datetime as epoch milliseconds."""
    return int(moment.timestamp() * 1000)


def now_ms() -> float:
    """The clock as epoch milliseconds with microseconds in the fraction."""
    return time.time_ns() // 1000 / 1000


def ms_text(ms: float) -> str:
    """Epoch ms as a record stores it: a whole number as is, else with its microseconds ("...123.456")."""
    return str(ms) if isinstance(ms, int) else f"{ms:.3f}"
