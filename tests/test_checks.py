"""System checks of the task queue's settings: each error, the warning, and the all-clear."""

from __future__ import annotations

import math

import pytest
from django.core.checks import Error, Warning, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from tasks_app import checks
from tasks_app.registry import Registry


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A registry of this test's own, so recorded import errors do not leak into others."""
    registry = Registry()
    monkeypatch.setattr("tasks_app.registry.registry", registry)
    return registry


def ids(messages: list) -> list[str]:
    return [message.id for message in messages]


def test_default_settings_pass(fresh_registry):
    assert checks.check_task_settings() == []


@pytest.mark.parametrize("prefix", ["", "has space", "x" * 101, "a{b}", None])
def test_a_key_prefix_that_could_break_keys_is_an_error(settings, fresh_registry, prefix):
    settings.TASKS_KEY_PREFIX = prefix
    [problem] = checks.check_task_settings()
    assert isinstance(problem, Error) and problem.id == "tasks_app.E001"
    assert "TASKS_KEY_PREFIX" in problem.msg


@pytest.mark.parametrize("prefix", ["ts", "a.b:c-d_e", "x" * 100])
def test_valid_key_prefixes_pass(settings, fresh_registry, prefix):
    settings.TASKS_KEY_PREFIX = prefix
    assert checks.check_task_settings() == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "127.0.0.1:6379", ""])
def test_a_redis_url_of_another_scheme_is_an_error(settings, fresh_registry, url):
    settings.REDIS_URL = url
    assert ids(checks.check_task_settings()) == ["tasks_app.E002"]


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://h:1/0", "unix:///run/redis.sock"])
def test_redis_url_schemes_that_work_pass(settings, fresh_registry, url):
    settings.REDIS_URL = url
    assert checks.check_task_settings() == []


@pytest.mark.parametrize("ttl_s", [0, -1])
def test_a_result_ttl_that_is_not_positive_is_an_error(settings, fresh_registry, ttl_s):
    settings.TASKS_RESULT_TTL = ttl_s
    assert ids(checks.check_task_settings()) == ["tasks_app.E003"]


@pytest.mark.parametrize("limit", [0, -5])
def test_a_payload_limit_that_is_not_positive_is_an_error(settings, fresh_registry, limit):
    settings.TASKS_MAX_PAYLOAD_BYTES = limit
    assert ids(checks.check_task_settings()) == ["tasks_app.E004"]


def test_every_bad_setting_is_reported_at_once(settings, fresh_registry):
    settings.TASKS_KEY_PREFIX, settings.REDIS_URL = "bad prefix", "http://x"
    settings.TASKS_RESULT_TTL, settings.TASKS_MAX_PAYLOAD_BYTES = 0, 0
    assert ids(checks.check_task_settings()) == [f"tasks_app.E00{n}" for n in (1, 2, 3, 4)]


def test_a_handler_module_that_failed_to_import_is_a_warning_with_its_error(fresh_registry):
    fresh_registry.import_modules(["tests.support.broken_handlers"])
    [problem] = checks.check_task_settings()
    assert isinstance(problem, Warning) and problem.id == "tasks_app.W001"
    assert "tests.support.broken_handlers" in problem.msg
    assert "ImportError: simulated" in problem.msg
    assert "dead-lettered" in problem.hint


@pytest.mark.django_db  # the model checks ask the database whether it supports JSONField
def test_the_check_is_registered_and_stops_manage_py(settings, fresh_registry):
    settings.TASKS_RESULT_TTL = 0
    assert "tasks_app.E003" in ids(run_checks())
    with pytest.raises(SystemCheckError, match="TASKS_RESULT_TTL"):
        call_command("check")


@pytest.mark.parametrize("wait_ms", [0, -5, 10_001])
def test_a_cluster_wait_that_is_zero_or_too_long_is_an_error(settings, fresh_registry, wait_ms):
    settings.TASKS_CLUSTER_WAIT_MS = wait_ms  # WAIT 0 would block acks forever
    assert ids(checks.check_task_settings()) == ["tasks_app.E031"]


@pytest.mark.parametrize("recheck_s", [0, -1, 3601])
def test_a_throttle_recheck_out_of_range_is_an_error(settings, fresh_registry, recheck_s):
    settings.TASKS_THROTTLE_RECHECK_S = recheck_s
    assert ids(checks.check_task_settings()) == ["tasks_app.E040"]


@pytest.mark.parametrize("refresh_s", [0, -1, math.nan, 3601])
def test_a_config_refresh_period_out_of_range_is_an_error(settings, fresh_registry, refresh_s):
    settings.TASKS_CONFIG_REFRESH_S = refresh_s  # NaN: consumers would never see an admin edit
    assert ids(checks.check_task_settings()) == ["tasks_app.E005"]


@pytest.mark.parametrize(
    ("name", "value", "check_id"),
    [
        ("TASKS_KEY_PREFIX", 5, "tasks_app.E001"),
        ("REDIS_URL", None, "tasks_app.E002"),
        ("TASKS_RESULT_TTL", "3600", "tasks_app.E003"),
        ("TASKS_RESULT_TTL", math.nan, "tasks_app.E003"),
        ("TASKS_MAX_PAYLOAD_BYTES", math.inf, "tasks_app.E004"),
        ("TASKS_MAX_DELAY_S", math.nan, "tasks_app.E020"),
        ("TASKS_DEAD_LETTER_MAX", None, "tasks_app.E021"),
        ("TASKS_DEAD_LETTER_MAX_AGE_S", True, "tasks_app.E022"),
        ("TASKS_HISTORY_MAX", "100", "tasks_app.E060"),
        ("TASKS_CLUSTER_WAIT_MS", 10**400, "tasks_app.E031"),
    ],
)
def test_a_setting_of_the_wrong_type_or_nan_is_its_error_not_a_crash(settings, fresh_registry, name, value, check_id):
    # Before: a string or None raised a TypeError from the check itself; NaN passed, to fail at first use.
    setattr(settings, name, value)
    assert ids(checks.check_task_settings()) == [check_id]


@pytest.mark.parametrize("propagation", ["sideways", "", None, "CHILD"])
def test_an_unknown_trace_propagation_is_an_error(settings, fresh_registry, propagation):
    settings.TASKS_TRACE_PROPAGATION = propagation
    assert ids(checks.check_task_settings()) == ["tasks_app.E080"]


@pytest.mark.parametrize("propagation", ["child", "link"])
def test_both_trace_propagations_pass(settings, fresh_registry, propagation):
    settings.TASKS_TRACE_PROPAGATION = propagation
    assert checks.check_task_settings() == []
