"""URL routes of the site."""

from django.contrib import admin
from django.urls import include, path

from scheduler_site.metrics import metrics
from tasks_app.web.health import healthz

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("tasks_app.urls")),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="prometheus-django-metrics"),
]
