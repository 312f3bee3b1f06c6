"""Settings read from the environment: no public secret key with DEBUG off, HTTPS cookies and proxy on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_DIR = Path(__file__).resolve().parent.parent
SHOW = (
    "import json, django; from django.conf import settings; django.setup(); "
    "print(json.dumps([settings.DEBUG, settings.SECRET_KEY, settings.SESSION_COOKIE_SECURE, "
    "settings.CSRF_COOKIE_SECURE, settings.SECURE_PROXY_SSL_HEADER]))"
)


def load_settings(**env: str) -> subprocess.CompletedProcess[str]:
    """Import the site's settings in a fresh interpreter with only `env` set among the DJANGO_ variables."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    clean.update(env, DJANGO_SETTINGS_MODULE="scheduler_site.settings")
    return subprocess.run(
        [sys.executable, "-c", SHOW], cwd=PROJECT_DIR, env=clean, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("debug", [{}, {"DJANGO_DEBUG": "0"}])
def test_debug_off_without_a_secret_key_refuses_to_start(debug):
    run = load_settings(**debug)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "django.core.exceptions.ImproperlyConfigured: DJANGO_SECRET_KEY is not set: set it to a "
        "long random secret (or DJANGO_DEBUG=1 for local development)"
    )
    assert run.stdout == ""


def test_the_development_key_is_used_only_with_debug_on():
    run = load_settings(DJANGO_DEBUG="1")
    assert run.returncode == 0, run.stderr
    debug, key, *_ = json.loads(run.stdout)
    assert debug is True and key.startswith("django-insecure-")


def test_https_cookies_and_the_proxy_header_are_off_unless_asked_for():
    run = load_settings(DJANGO_SECRET_KEY="s3cret-for-this-test")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [False, "s3cret-for-this-test", False, False, None]

    run = load_settings(
        DJANGO_SECRET_KEY="k",
        DJANGO_SESSION_COOKIE_SECURE="1",
        DJANGO_CSRF_COOKIE_SECURE="yes",
        DJANGO_SECURE_PROXY_SSL_HEADER="true",
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)[2:] == [True, True, ["HTTP_X_FORWARDED_PROTO", "https"]]
