"""Periodic schedules saved on a host whose clock is off: the save is stamped on the Redis server's clock."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from tasks_app.models import PeriodicTask, TaskType
from tests.support.periodic import pushed_runs
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

OUT = "periodic-out"  # no consumer of these tests serves it: the runs stay as they were pushed


@pytest.fixture
def host_clock(monkeypatch):
    """Set this host's clock off by a number of seconds (Django's now, what a save was stamped with)."""
    real_now = timezone.now

    def set_off(seconds: float) -> None:
        monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(seconds=seconds))

    return set_off


def runs(broker, name: str) -> list:
    return [run for run in pushed_runs(broker, OUT) if run.schedule == name]


def test_a_schedule_saved_on_a_host_an_hour_ahead_fires_from_its_next_slot(broker, consumer_in_thread, host_clock):
    record_type = TaskType.objects.create(name="test.record", handler="test.record", queue=OUT)
    host_clock(3600)
    PeriodicTask.objects.create(name="tick", task_type=record_type, interval_s=1)
    host_clock(0)
    with consumer_in_thread():
        wait_until(lambda: len(runs(broker, "tick")) >= 2, 20, message="runs within seconds, not in an hour")


def test_a_schedule_enabled_again_on_a_host_an_hour_behind_catches_up_nothing(broker, consumer_in_thread, host_clock):
    record_type = TaskType.objects.create(name="test.record", handler="test.record", queue=OUT)
    row = PeriodicTask.objects.create(
        name="tick", task_type=record_type, interval_s=1, catch_up=PeriodicTask.CatchUp.ONCE
    )
    with consumer_in_thread():
        wait_until(lambda: len(runs(broker, "tick")) >= 1, 20, message="the first run")
        row.enabled = False
        row.save()
        time.sleep(3)  # slots pass while it is off
        host_clock(-3600)
        row.enabled = True
        row.save()
        host_clock(0)
        before = len(runs(broker, "tick"))
        wait_until(lambda: len(runs(broker, "tick")) >= before + 2, 20, message="runs after it was enabled")
    assert not any(run.catch_up for run in runs(broker, "tick"))
