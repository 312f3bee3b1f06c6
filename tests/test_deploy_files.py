"""Deployment files: Dockerfile, docker-compose.yml, prometheus.yml, alert rules and the dashboard.

Docker cannot run here, so these files are checked by parsing them; the alert rules also go
through `promtool` when it is installed (Debian package `prometheus`).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from django.core.management import load_command_class

from tests.support.scrape import METRIC_NAME, exported_names

ROOT = Path(__file__).resolve().parent.parent


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            pairs.append((instruction.upper(), rest.strip()))
    return pairs


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


# --- Dockerfile -----------------------------------------------------------------------------
def test_dockerfile_is_multi_stage_slim_and_runs_as_non_root():
    instructions = dockerfile_instructions()
    stages = [args for name, args in instructions if name == "FROM"]
    assert len(stages) >= 2 and all(stage.startswith("python:3.12-slim") for stage in stages)
    final_stage = instructions[max(i for i, (name, _) in enumerate(instructions) if name == "FROM") :]
    users = [args for name, args in final_stage if name == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert any(name == "RUN" and "collectstatic" in args for name, args in final_stage)
    assert any(name == "RUN" and "pip install -r requirements" in args for name, args in instructions)
    assert any(name == "HEALTHCHECK" and "/healthz" in args for name, args in final_stage)
    [cmd] = [json.loads(args) for name, args in final_stage if name == "CMD"]
    assert cmd == ["gunicorn", "scheduler_site.wsgi"]


def test_every_dockerfile_copy_source_exists_and_is_not_ignored():
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for name, args in dockerfile_instructions():
        if name != "COPY" or args.startswith("--from"):
            continue
        *sources, _destination = shlex.split(args)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} does not exist"
            assert source.rstrip("/") not in ignored, f"COPY source {source} is excluded by .dockerignore"


def test_requirements_are_pinned():
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[^=\s]+", line.strip()), line


# --- docker-compose.yml ---------------------------------------------------------------------
def test_compose_runs_redis_postgres_web_two_consumers_and_prometheus():
    services = compose()["services"]
    redis_command = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_command and "--maxmemory-policy noeviction" in redis_command
    assert services["postgres"]["image"].startswith("postgres")
    assert services["web"]["command"] == ["gunicorn", "scheduler_site.wsgi"]
    assert "8000:8000" in services["web"]["ports"]
    assert "PROMETHEUS_MULTIPROC_DIR" in services["web"]["environment"]
    consumers = [name for name, service in services.items() if "runconsumer" in service.get("command", [])]
    assert len(consumers) == 2
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    for name in consumers:
        command = services[name]["command"]
        assert command[:3] == ["python", "manage.py", "runconsumer"]
        options = parser.parse_args(command[3:])  # the flags are the command's real ones
        assert options.metrics_port and options.health_file
        assert options.metrics_host == "0.0.0.0"  # Prometheus scrapes from another container
        assert options.health_file in " ".join(services[name]["healthcheck"]["test"])
    for mount in services["prometheus"]["volumes"]:
        assert (ROOT / mount.split(":")[0]).exists()


def test_compose_requires_a_secret_key_and_passes_the_https_settings():
    text = (ROOT / "docker-compose.yml").read_text()
    assert "change-me" not in text
    env = compose()["x-env"]
    assert re.fullmatch(r"\$\{DJANGO_SECRET_KEY:\?.+\}", env["DJANGO_SECRET_KEY"])
    for name in ("DJANGO_SESSION_COOKIE_SECURE", "DJANGO_CSRF_COOKIE_SECURE", "DJANGO_SECURE_PROXY_SSL_HEADER"):
        assert env[name].startswith(f"${{{name}:-")


def test_a_consumer_metrics_port_binds_this_host_only_by_default():
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    assert parser.parse_args(["--metrics-port", "9100"]).metrics_host == "127.0.0.1"


def test_prometheus_scrapes_the_ports_compose_serves():
    services = compose()["services"]
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    targets = {target for job in config["scrape_configs"] for sc in job["static_configs"] for target in sc["targets"]}
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    expected = {"web:8000"} | {
        f"{name}:{parser.parse_args(service['command'][3:]).metrics_port}"
        for name, service in services.items()
        if "runconsumer" in service.get("command", [])
    }
    assert targets == expected
    for rule_file in config["rule_files"]:
        assert (ROOT / rule_file).exists()


# --- alerts and dashboard -------------------------------------------------------------------
def test_alert_rules_have_the_expected_shape():
    groups = yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    for rule in rules:
        assert rule["alert"] and rule["expr"].strip()
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
    expressions = " ".join(rule["expr"] for rule in rules)
    for metric in (
        "taskqueue_queue_tasks",
        "taskqueue_tasks_dead_lettered_total",
        "taskqueue_consumers_live",
        "taskqueue_leases_lost_total",
        "taskqueue_redis_errors_total",
        "taskqueue_periodic_late_seconds",
        "taskqueue_consumer_task_types_age_seconds",
    ):
        assert metric in expressions


def test_the_dashboard_panel_ids_are_unique():
    dashboard = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_rules_and_the_config():
    for args in (["check", "rules", "deploy/alerts.yml"], ["check", "config", "prometheus.yml"]):
        result = subprocess.run(["promtool", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.django_db
def test_alerts_and_dashboard_name_only_exported_metrics(broker):
    exported = exported_names(broker)
    dashboard = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(expressions) >= 10
    groups = yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())["groups"]
    expressions += [rule["expr"] for group in groups for rule in group["rules"]]
    for expression in expressions:
        names = METRIC_NAME.findall(expression)
        assert names or "up{" in expression, expression  # `up` comes from Prometheus itself
        for name in names:
            assert name in exported, f"{name} (in {expression!r}) is not exported"
