"""A schedule's validity and slot arithmetic: pure functions of time, the same on every consumer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

MIN_INTERVAL_S = 1
# Names in the zone database that link to a host's own setting (/etc/localtime, zic's -p rules), not
# to a place: consumers on hosts set otherwise would compute other slots, each firing its own.
HOST_ZONES = frozenset({"localtime", "posixrules"})


class InvalidSchedule(ValueError):
    """A schedule that cannot produce slots: a bad cron, an unknown zone, both or neither of cron/interval."""


def cron_error(expression: str) -> str | None:
    """Why `expression` is not a cron expression cronsim accepts (5 fields, or 6 with seconds first); None if it is."""
    fields = len(expression.split())
    if fields not in (5, 6):
        return f"a cron expression has 5 fields (minute hour day month weekday), or 6 with seconds first; got {fields}"
    try:
        next(CronSim(expression, datetime.now(UTC)))
    except CronSimError as exc:
        return f"invalid cron expression {expression!r}: {exc}"
    except StopIteration:  # cronsim looks 50 years ahead: "day 1 and the fifth Monday" is never
        return f"cron expression {expression!r} never matches"
    return None


def zone(name: str) -> ZoneInfo:
    """Return the IANA time zone `name`; raise InvalidSchedule for an unknown one or a host's own setting."""
    if name in HOST_ZONES:
        raise InvalidSchedule(
            f"time zone {name!r} names each host's own setting, not a place, so consumers on other hosts "
            "could fire other slots: use an IANA name such as UTC or Europe/Berlin"
        )
    try:
        return ZoneInfo(name)
    # OSError: a name that is a folder of the zone database ("America") or too long for a file name.
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise InvalidSchedule(f"unknown time zone {name!r}: use an IANA name such as UTC or Europe/Berlin") from None


def schedule_errors(
    interval_s: int | None, cron: str, timezone: str, start_at: object, end_at: object
) -> dict[str, str]:
    """Field name ("__all__" for the whole row) -> what is wrong; empty if these fields make a valid schedule."""
    errors: dict[str, str] = {}
    if bool(cron) == (interval_s is not None):
        errors["__all__"] = "give either a cron expression or an interval in seconds (exactly one of the two)"
    if cron and (error := cron_error(cron)):
        errors["cron"] = error
    try:
        zone(timezone)
    except InvalidSchedule as exc:
        errors["timezone"] = str(exc)
    # Compared only as dates: a value full_clean refused (a number from TASKS_PERIODIC) stays as given.
    if isinstance(start_at, datetime) and isinstance(end_at, datetime) and end_at <= start_at:
        errors["end_at"] = "the end must be after the start"
    return errors


@dataclass(frozen=True)
class Schedule:
    """When a periodic task is due: every `interval_s` seconds or by `cron`, between start_at and end_at."""

    interval_s: int | None = None
    cron: str = ""
    timezone: str = "UTC"
    start_at: datetime | None = None
    end_at: datetime | None = None

    def __post_init__(self) -> None:
        if errors := schedule_errors(self.interval_s, self.cron, self.timezone, self.start_at, self.end_at):
            raise InvalidSchedule(" ".join(errors.values()))
        if self.interval_s is not None and self.interval_s < MIN_INTERVAL_S:  # the model's field refuses it
            raise InvalidSchedule(f"the interval must be at least {MIN_INTERVAL_S} second")

    def describe(self) -> str:
        """The schedule in a few words, e.g. ``every 60 s`` or ``cron 0 3 * * * (Europe/Berlin)``."""
        if self.interval_s is not None:
            return f"every {self.interval_s} s"
        return f"cron {self.cron} ({self.timezone})"

    def latest_at_or_before(self, now_ms: int) -> int | None:
        """The last slot at or before `now_ms` (not before start_at, not after end_at); None if there is none."""
        if self.end_at is not None:
            now_ms = min(now_ms, _ms(self.end_at))
        if self.interval_s is not None:
            interval_ms, anchor_ms = self.interval_s * 1000, self._anchor_ms()
            if now_ms < anchor_ms:
                return None
            return anchor_ms + (now_ms - anchor_ms) // interval_ms * interval_ms
        # Slots strictly before the next whole second are those at or before now (slots are whole seconds).
        slot_ms = _cron_next(self.cron, self._local(now_ms // 1000 * 1000 + 1000), reverse=True)
        return slot_ms if slot_ms is not None and slot_ms >= self._anchor_ms() else None

    def next_after(self, now_ms: int) -> int | None:
        """The first slot strictly after `now_ms` (not before start_at); None once end_at has passed or past 9999."""
        slot_ms: int | None
        if self.interval_s is not None:
            interval_ms, anchor_ms = self.interval_s * 1000, self._anchor_ms()
            slot_ms = (
                anchor_ms if now_ms < anchor_ms else anchor_ms + ((now_ms - anchor_ms) // interval_ms + 1) * interval_ms
            )
        else:
            start_ms = max(now_ms, _ms(self.start_at) - 1) if self.start_at else now_ms
            try:
                slot_ms = _cron_next(self.cron, self._local(start_ms))
            except OverflowError:  # the next match is after the year 9999 (a start parked at its end)
                return None
        if slot_ms is None or (self.end_at is not None and slot_ms > _ms(self.end_at)):
            return None
        return slot_ms

    def previous_before(self, slot_ms: int) -> int | None:
        """The slot before `slot_ms`; None if none is at or after start_at (one before the start was never due)."""
        if self.interval_s is not None:
            before_ms: int | None = slot_ms - self.interval_s * 1000
        else:  # the slot strictly before: from the last millisecond of the previous second backwards
            before_ms = _cron_next(self.cron, self._local(slot_ms - 1), reverse=True)
        return before_ms if before_ms is not None and before_ms >= self._anchor_ms() else None

    def _anchor_ms(self) -> int:
        return _ms(self.start_at) if self.start_at is not None else 0

    def _local(self, epoch_ms: int) -> datetime:
        return datetime.fromtimestamp(epoch_ms / 1000, UTC).astimezone(zone(self.timezone))


def _cron_next(cron: str, start: datetime, reverse: bool = False) -> int | None:
    """The match of `cron` after (or before) `start`, epoch ms; None if there is none within cronsim's 50 years."""
    fields = cron.split()
    at_local_time = not fields[-5].startswith("*") and not fields[-4].startswith("*")
    try:
        match = next(CronSim(cron, _wall_clock(start) if at_local_time else start, reverse=reverse))
    except StopIteration:  # a row saved before never-matching crons were refused
        return None
    return _ms(_first_shown(match, start.tzinfo) if at_local_time else match)


def _wall_clock(moment: datetime) -> datetime:
    """The wall time (naive) cron reads at `moment`: one shown again since clocks went back reads as the last before."""
    if moment.fold:
        back_s = _offset_change_s(moment.tzinfo, moment.replace(fold=0).timestamp(), moment.timestamp())
        moment = (datetime.fromtimestamp(back_s, UTC) - timedelta(microseconds=1)).astimezone(moment.tzinfo)
    return moment.replace(tzinfo=None)


def _first_shown(wall: datetime, tz: tzinfo | None) -> datetime:
    """When the clock in `tz` first shows `wall`; for a time skipped as clocks went forward, when they did."""
    moment = wall.replace(tzinfo=tz, fold=0)
    if moment.astimezone(UTC).astimezone(tz).replace(tzinfo=None) == wall:
        return moment
    # Skipped: read with the offset from after the change (fold=1) it falls before the change, with
    # the one from before it (fold=0) after the change (PEP 495).
    forward_s = _offset_change_s(tz, moment.replace(fold=1).timestamp(), moment.timestamp())
    return datetime.fromtimestamp(forward_s, UTC).astimezone(tz)


def _offset_change_s(tz: tzinfo | None, before_s: float, after_s: float) -> int:
    """The first whole second after `before_s` at which `tz` has the UTC offset it has at `after_s`."""
    offset = datetime.fromtimestamp(after_s, tz).utcoffset()
    low, high = math.floor(before_s), math.ceil(after_s)
    while high - low > 1:
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, tz).utcoffset() == offset:
            high = middle
        else:
            low = middle
    return high


def _ms(moment: datetime) -> int:
    return int((moment - _EPOCH) // timedelta(milliseconds=1))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
