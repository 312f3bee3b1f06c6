"""Django settings, read from the environment (12-factor); the only module that reads it."""

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def _env_bool(name: str, default: bool) -> bool:
    """Read a boolean environment variable ("1", "true", "yes", "on" are true)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _env_list(name: str, default: str = "") -> list[str]:
    """Read a comma-separated environment variable as a list of non-empty items."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


DEBUG = _env_bool("DJANGO_DEBUG", False)
# A public default key would let anyone forge sessions: only a DEBUG (development) run may use it.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY is not set: set it to a long random secret (or DJANGO_DEBUG=1 for local development)"
        )
    SECRET_KEY = "django-insecure-local-development-only"
ALLOWED_HOSTS = _env_list("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
# Served over HTTPS: send the session and CSRF cookies only over HTTPS.
SESSION_COOKIE_SECURE = _env_bool("DJANGO_SESSION_COOKIE_SECURE", False)
CSRF_COOKIE_SECURE = _env_bool("DJANGO_CSRF_COOKIE_SECURE", False)
# Behind a proxy that terminates TLS and sets X-Forwarded-Proto (and strips it from clients).
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if _env_bool("DJANGO_SECURE_PROXY_SSL_HEADER", False) else None
)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_prometheus",
    "tasks_app",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Serves /static/ under gunicorn too, so the admin is styled without a separate web server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "scheduler_site.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "scheduler_site.wsgi.application"
ASGI_APPLICATION = "scheduler_site.asgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}",
        conn_max_age=60,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Consumers and the web app share the file: wait for locks instead of failing at once. A
    # transaction takes the write lock when it begins (a read that later writes would otherwise
    # fail at once when another process writes), and WAL lets readers go on beside a writer.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# Also serve files straight from the apps, so `make run` needs no collectstatic step.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "admin:login"

# --- The task queue ---------------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_CLUSTER = _env_bool("REDIS_CLUSTER", False)
TASKS_KEY_PREFIX = os.environ.get("TASKS_KEY_PREFIX", "ts")
TASK_HANDLER_MODULES = _env_list("TASK_HANDLER_MODULES")
TASKS_RESULT_TTL = int(os.environ.get("TASKS_RESULT_TTL", str(7 * 24 * 3600)))
TASKS_MAX_PAYLOAD_BYTES = int(os.environ.get("TASKS_MAX_PAYLOAD_BYTES", str(1024 * 1024)))
# Largest return value (as JSON) a consumer stores; tracebacks are cut to it.
TASKS_MAX_RESULT_BYTES = int(os.environ.get("TASKS_MAX_RESULT_BYTES", str(1024 * 1024)))
TASKS_CONFIG_REFRESH_S = float(os.environ.get("TASKS_CONFIG_REFRESH_S", "2"))

# Django's tasks framework: `@task` functions' .enqueue() goes through this queue and
# `runconsumer` runs them (ImmediateBackend would run them inline instead).
TASKS = {
    "default": {
        "BACKEND": "tasks_app.backends.RedisBackend",
        "QUEUES": [],  # empty: any valid queue name; list names to restrict them
        "OPTIONS": {"ENQUEUE_ON_COMMIT": True},
    }
}

# --- Logging ----------------------------------------------------------------------------
LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO").upper()
LOG_FORMAT = os.environ.get("LOG_FORMAT", "text").lower()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"()": "tasks_app.logging.TextFormatter", "format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "tasks_app.logging.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "tasks_app.logging.ConsoleHandler",
            "formatter": "json" if LOG_FORMAT == "json" else "text",
        }
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}

# --- Delays and dead letters --------------------------------------------------------------
# Longest delay a producer accepts (delay_s, run_after, the form and the API): one year.
TASKS_MAX_DELAY_S = int(os.environ.get("TASKS_MAX_DELAY_S", str(365 * 24 * 3600)))
# Dead letters kept per queue, and for how long (as Sidekiq: 10,000 and 6 months); the oldest go first.
TASKS_DEAD_LETTER_MAX = int(os.environ.get("TASKS_DEAD_LETTER_MAX", "10000"))
TASKS_DEAD_LETTER_MAX_AGE_S = int(os.environ.get("TASKS_DEAD_LETTER_MAX_AGE_S", str(180 * 24 * 3600)))

# --- Redis Cluster durability -------------------------------------------------------------
# Before acking, a consumer waits up to this long (ms) for a replica of each master that took the
# batch's results to have them; past it the tasks are acked anyway (and counted in a metric).
TASKS_CLUSTER_WAIT_MS = int(os.environ.get("TASKS_CLUSTER_WAIT_MS", "100"))

# --- Throttles ------------------------------------------------------------------------------
# A task waiting for a concurrency slot (max_running) is woken when one frees; it also looks
# again after about this long (0.5 - 1x, spread) in case that wake was lost.
TASKS_THROTTLE_RECHECK_S = float(os.environ.get("TASKS_THROTTLE_RECHECK_S", "5"))
# At most this many recent tasks per queue are kept in the history index behind the task browser.
TASKS_HISTORY_MAX = int(os.environ.get("TASKS_HISTORY_MAX", "100000"))

# --- Workflows ---------------------------------------------------------------------------------
# A workflow (chain, group, chord) holds at most this many tasks, nested at most this deep.
TASKS_WORKFLOW_MAX_TASKS = int(os.environ.get("TASKS_WORKFLOW_MAX_TASKS", "20000"))
TASKS_WORKFLOW_MAX_DEPTH = int(os.environ.get("TASKS_WORKFLOW_MAX_DEPTH", "10"))

# --- Periodic tasks ----------------------------------------------------------------------------
# Schedules declared in code, written to PeriodicTask rows (source "code") when consumers start:
# {"reports.nightly": {"task": "reports.build", "cron": "0 3 * * *", "timezone": "Europe/Berlin"}}.
TASKS_PERIODIC: dict[str, dict[str, object]] = {}
# A slot reached later than this (or than its period, if shorter) counts as missed: the catch-up
# policy decides whether it runs.
TASKS_PERIODIC_GRACE_S = float(os.environ.get("TASKS_PERIODIC_GRACE_S", "60"))

# --- Tracing (the `otel` extra) ----------------------------------------------------------------
# A run's `process` span is a "child" of its task's `send` span (one trace from the web request
# to every run), or a root span with a "link" to it (a trace per run).
TASKS_TRACE_PROPAGATION = os.environ.get("TASKS_TRACE_PROPAGATION", "child")
