"""Slot arithmetic (tasks_app.periodic.schedule): intervals anchored for every consumer alike, cron across DST."""

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from tasks_app.periodic.schedule import InvalidSchedule, Schedule

BERLIN = ZoneInfo("Europe/Berlin")


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def local(slot_ms: int) -> str:
    return datetime.fromtimestamp(slot_ms / 1000, UTC).astimezone(BERLIN).isoformat()


def following(schedule: Schedule, start: datetime, count: int) -> list[str]:
    slots, at_ms = [], ms(start)
    for _ in range(count):
        at_ms = schedule.next_after(at_ms)
        slots.append(local(at_ms))
    return slots


def test_a_daily_berlin_job_runs_once_when_clocks_go_back_and_once_when_they_go_forward():
    daily = Schedule(cron="30 2 * * *", timezone="Europe/Berlin")
    # 2026-10-25 03:00 CEST -> 02:00 CET: 02:30 happens twice, the job runs at the first.
    assert following(daily, datetime(2026, 10, 24, 12, tzinfo=BERLIN), 3) == [
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:30:00+01:00",
        "2026-10-27T02:30:00+01:00",
    ]
    # 2026-03-29 02:00 CET -> 03:00 CEST: 02:30 does not exist, the job runs right after the jump.
    assert following(daily, datetime(2026, 3, 28, 12, tzinfo=BERLIN), 2) == [
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
    ]


@pytest.mark.parametrize(("cron", "second"), [("30 2 * * *", "00"), ("0 30 2 * * *", "00"), ("45 30 2 * * *", "45")])
def test_a_job_at_a_fixed_local_time_runs_once_on_both_change_days_with_5_fields_or_6(cron, second):
    daily = Schedule(cron=cron, timezone="Europe/Berlin")
    # Skipped when clocks go forward: it runs as they do; shown twice when they go back: at the first.
    assert following(daily, datetime(2026, 3, 28, 12, tzinfo=BERLIN), 2) == [
        "2026-03-29T03:00:00+02:00",
        f"2026-03-30T02:30:{second}+02:00",
    ]
    assert following(daily, datetime(2026, 10, 24, 12, tzinfo=BERLIN), 2) == [
        f"2026-10-25T02:30:{second}+02:00",
        f"2026-10-26T02:30:{second}+01:00",
    ]


@pytest.mark.parametrize(
    "cron", ["30 2 * * *", "45 1 * * *", "0 30 2 * * *", "*/20 30 2 * * *", "0 0,30 1-3 * * *", "0 * * * *"]
)
@pytest.mark.parametrize(
    ("zone_name", "night"),
    [
        ("Europe/Berlin", datetime(2026, 3, 29)),
        ("Europe/Berlin", datetime(2026, 10, 25)),
        ("Australia/Lord_Howe", datetime(2026, 4, 5)),  # clocks go back 30 minutes
        ("Australia/Lord_Howe", datetime(2026, 10, 4)),
    ],
)
def test_around_a_dst_change_the_latest_slot_is_not_ahead_and_the_next_is_ahead_with_none_between(
    cron, zone_name, night
):
    schedule = Schedule(cron=cron, timezone=zone_name)
    start_ms = ms(night.replace(tzinfo=ZoneInfo(zone_name)))
    for at_ms in range(start_ms, start_ms + 5 * 3_600_000, 97_000):
        latest_ms, next_ms = schedule.latest_at_or_before(at_ms), schedule.next_after(at_ms)
        assert latest_ms is not None and next_ms is not None
        assert latest_ms <= at_ms < next_ms, (local(at_ms), local(latest_ms), local(next_ms))
        assert schedule.next_after(latest_ms) == next_ms
        assert schedule.previous_before(next_ms) == latest_ms


def test_an_hourly_berlin_job_runs_every_real_hour_across_both_changes():
    hourly = Schedule(cron="0 * * * *", timezone="Europe/Berlin")
    back = following(hourly, datetime(2026, 10, 25, 0, 30, tzinfo=BERLIN), 4)
    assert back == [
        "2026-10-25T01:00:00+02:00",
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:00:00+01:00",
        "2026-10-25T03:00:00+01:00",
    ]
    forward = following(hourly, datetime(2026, 3, 29, 0, 30, tzinfo=BERLIN), 3)
    assert forward == ["2026-03-29T01:00:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-29T04:00:00+02:00"]


def test_latest_and_previous_slots_agree_with_next_across_dst():
    daily = Schedule(cron="30 2 * * *", timezone="Europe/Berlin")
    at_ms = ms(datetime(2026, 10, 20, tzinfo=BERLIN))
    for _ in range(10):
        slot_ms = daily.next_after(at_ms)
        assert daily.latest_at_or_before(slot_ms) == slot_ms
        assert daily.latest_at_or_before(slot_ms - 1) == daily.previous_before(slot_ms)
        assert daily.next_after(daily.previous_before(slot_ms)) == slot_ms
        at_ms = slot_ms


def test_a_sixth_field_is_seconds_first():
    every_20_s = Schedule(cron="*/20 * * * * *")
    start = datetime(2026, 1, 1, tzinfo=UTC)
    assert [s - ms(start) for s in (every_20_s.next_after(ms(start)), every_20_s.next_after(ms(start) + 20_000))] == [
        20_000,
        40_000,
    ]


def test_interval_slots_are_anchored_at_start_at_or_the_epoch():
    start = datetime(2026, 1, 1, 0, 0, 0, 300_000, tzinfo=UTC)
    anchored = Schedule(interval_s=7, start_at=start)
    assert anchored.next_after(0) == ms(start)
    assert anchored.latest_at_or_before(ms(start) + 20_000) == ms(start) + 14_000
    assert anchored.latest_at_or_before(ms(start) - 1) is None
    assert Schedule(interval_s=60).latest_at_or_before(90_500) == 60_000


def test_the_first_slot_has_no_slot_before_it_whether_by_interval_or_cron():
    start = datetime(2026, 3, 2, tzinfo=UTC)  # a Monday
    for schedule in (Schedule(cron="0 3 * * *", start_at=start), Schedule(interval_s=3600, start_at=start)):
        first_ms = schedule.next_after(ms(start) - 1)
        assert schedule.previous_before(first_ms) is None
        assert schedule.previous_before(schedule.next_after(first_ms)) == first_ms


def test_no_slot_after_end_at():
    end = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    ending = Schedule(interval_s=30, end_at=end)
    assert ending.next_after(ms(end) - 1) == ms(end)
    assert ending.next_after(ms(end)) is None
    assert ending.latest_at_or_before(ms(end + timedelta(hours=1))) == ms(end)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cron": "61 * * * *"}, "Bad minute"),
        ({"cron": "* * *"}, "5 fields"),
        ({"cron": "0 0 */32 * 1#5"}, "never matches"),  # day 1 and the fifth Monday: cronsim gives up
        ({"cron": "1 1 */60 1,2,3 0L"}, "never matches"),
        ({}, "either a cron expression or an interval"),
        ({"cron": "* * * * *", "interval_s": 5}, "either a cron expression or an interval"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"cron": "* * * * *", "timezone": "America"}, "unknown time zone"),  # a folder of the zone database
        ({"cron": "* * * * *", "timezone": "x" * 300}, "unknown time zone"),  # too long for a file name
        # Links to each host's own setting: consumers on hosts set otherwise would fire other slots.
        ({"cron": "0 3 * * *", "timezone": "localtime"}, "names each host's own setting"),
        ({"cron": "0 3 * * *", "timezone": "posixrules"}, "names each host's own setting"),
        ({"interval_s": 0}, "at least 1 second"),
    ],
)
def test_invalid_schedules_say_why(fields, message):
    with pytest.raises(InvalidSchedule, match=message):
        Schedule(**fields)


def test_a_start_parked_at_the_end_of_the_calendar_has_no_next_slot():
    parked = Schedule(cron="0 3 * * *", start_at=datetime(9999, 12, 31, 4, tzinfo=UTC))  # the next 03:00 is in 10000
    now_ms = ms(datetime(2026, 1, 1, tzinfo=UTC))
    assert (parked.latest_at_or_before(now_ms), parked.next_after(now_ms)) == (None, None)


def test_a_never_matching_cron_saved_before_it_was_refused_has_no_slots():
    from tasks_app.periodic.schedule import _cron_next

    never = "0 0 */32 * 1#5"
    assert _cron_next(never, datetime.now(UTC)) is None
    assert _cron_next(never, datetime.now(UTC), reverse=True) is None
