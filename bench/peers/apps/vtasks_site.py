"""Django settings for the django-vtasks peer: its Valkey backend on the private Redis."""

import os

SECRET_KEY = "bench-only"
USE_TZ = True
INSTALLED_APPS = ["django_vtasks"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
TASKS = {
    "default": {
        "BACKEND": "django_vtasks.backends.valkey.ValkeyTaskBackend",
        "OPTIONS": {"BROKER_URL": os.environ["BENCH_REDIS_URL"]},
    }
}
VTASKS_QUEUES = ["default"]
VTASKS_CONCURRENCY = 8
