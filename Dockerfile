# syntax=docker/dockerfile:1
# Image of the task queue: the web app (default command) and consumers (`runconsumer`).
#   docker build -t taskqueue .
#   docker run -e DJANGO_SECRET_KEY=... taskqueue             # gunicorn on :8000
#   docker run -e DJANGO_SECRET_KEY=... taskqueue python manage.py runconsumer --metrics-port 9100 \
#       --metrics-host 0.0.0.0 --health-file /tmp/consumer-alive

# --- build: install the pinned runtime requirements into a virtualenv --------------------
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /build
COPY requirements.txt .
# Only the runtime section: everything from "# Tests and tooling" on stays out of the image.
RUN sed '/^# Tests and tooling/,$d' requirements.txt > requirements-runtime.txt \
    && pip install -r requirements-runtime.txt

# --- runtime: the code, collected static files, a non-root user ---------------------------
FROM python:3.12-slim AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    DJANGO_SETTINGS_MODULE=scheduler_site.settings \
    GUNICORN_BIND=0.0.0.0:8000
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /app --shell /usr/sbin/nologin app
WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY manage.py gunicorn.conf.py ./
COPY scheduler_site/ scheduler_site/
COPY tasks_app/ tasks_app/
COPY proto/ proto/
COPY lua/ lua/
RUN DJANGO_SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput -v 0 \
    && chown -R app:app /app/staticfiles
USER app
EXPOSE 8000 9100
# Web liveness: database and Redis reachable. Consumers override it (docker-compose.yml) with
# the age of their --health-file.
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=8).status != 200)"]
CMD ["gunicorn", "scheduler_site.wsgi"]
