"""deploy/kubernetes/: every manifest against the Kubernetes schemas (KEDA's ScaledObject against KEDA's CRD), and
against the code: the consumer's real flags, probe paths and stop time, the web app's routes, the exported metrics.

No cluster is needed: the Kubernetes schemas come with the `kubernetes-validate` package; KEDA's published
CustomResourceDefinition is kept in tests/schemas/.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from django.core.management import load_command_class
from django.urls import resolve

from tasks_app.collectors import SCALER_GAUGES
from tasks_app.consumer.loops import Liveness, make_app
from tasks_app.consumer.supervisor import exit_within_s
from tasks_app.management.commands.runconsumer import _consumer_options
from tests.support.scrape import METRIC_NAME, exported_names

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
KEDA_CRD = ROOT / "tests" / "schemas" / "keda.sh_scaledobjects.yaml"
# The release the manifests are checked against (the package holds the schemas of every release up to its own).
KUBERNETES_VERSION = "1.34.0"
TIMEOUT_ANNOTATION = "longest-task-timeout-seconds"


def manifest_files() -> list[Path]:
    return sorted(path for path in MANIFESTS.glob("*.yaml") if path.name != "kustomization.yaml")


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in manifest_files():
        for document in yaml.safe_load_all(path.read_text()):
            yield path, document


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [document for _, document in documents() if document["kind"] == kind]


def consumer_deployments() -> list[dict[str, Any]]:
    deployments = of_kind("Deployment")
    return [d for d in deployments if "runconsumer" in d["spec"]["template"]["spec"]["containers"][0]["command"]]


def runconsumer_options(deployment: dict[str, Any]) -> dict[str, Any]:
    """The options `runconsumer` parses from the container's command, as the real command's parser reads them."""
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "manage.py", "runconsumer"]
    parser = load_command_class("tasks_app", "runconsumer").create_parser("manage.py", "runconsumer")
    return vars(parser.parse_args(command[3:]))


def named_port(container: dict[str, Any], name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def probe_target(container: dict[str, Any], probe: str) -> tuple[str, int]:
    """The path and port number a container's HTTP probe asks."""
    get = container[probe]["httpGet"]
    port = get["port"] if isinstance(get["port"], int) else named_port(container, get["port"])
    return get["path"], port


def scaled_objects_by_target() -> dict[str, dict[str, Any]]:
    return {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind("ScaledObject")}


# --- schemas -----------------------------------------------------------------------------------
def test_the_kustomization_lists_every_manifest_and_the_image_they_use():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [path.name for path in manifest_files()]
    [image] = kustomization["images"]
    pods = [d["spec"]["template"]["spec"] for d in of_kind("Deployment") + of_kind("Job")]
    assert {c["image"] for pod in pods for c in pod["containers"]} == {image["name"]}


def test_every_kubernetes_object_validates_strictly_against_the_kubernetes_schemas():
    checked = 0
    for path, document in documents():
        if document["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {document['kind']} {document['metadata']['name']}: {exc.message}")
        checked += 1
    assert checked >= 8  # web (Deployment, Service, PDB), the job, the config, two consumer classes' pairs


def test_the_validator_refuses_a_field_kubernetes_does_not_know():
    [web] = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "taskqueue-web"]
    web["spec"]["template"]["spec"]["terminationGracePeriod"] = 60  # a typo of terminationGracePeriodSeconds
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(web, KUBERNETES_VERSION, strict=True)


def keda_schema(api_version: str) -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


def unknown_fields(instance: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Fields of `instance` its structural schema does not declare (what the API server would prune silently)."""
    if isinstance(instance, list):
        return [f for i, item in enumerate(instance) for f in unknown_fields(item, schema.get("items", {}), where)]
    if not isinstance(instance, dict) or "properties" not in schema:
        return []
    found = []
    for key, value in instance.items():
        if key not in schema["properties"]:
            found.append(f"{where}.{key}")
        else:
            found += unknown_fields(value, schema["properties"][key], f"{where}.{key}")
    return found


def test_every_scaled_object_validates_against_kedas_crd_schema():
    scaled = of_kind("ScaledObject")
    assert len(scaled) == len(consumer_deployments())
    for document in scaled:
        schema = keda_schema(document["apiVersion"])
        jsonschema.validate(document, schema)  # types, required fields, enums and bounds
        unknown = unknown_fields({k: v for k, v in document.items() if k != "metadata"}, schema)
        assert not unknown, f"{document['metadata']['name']}: fields KEDA does not know: {unknown}"


def test_the_keda_schema_check_refuses_what_keda_would():
    [document, *_] = of_kind("ScaledObject")
    schema = keda_schema(document["apiVersion"])
    document["spec"]["minReplicaCount"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema)
    document["spec"]["minReplicaCount"] = 0
    document["spec"]["triggers"][0]["metadatas"] = {}
    assert unknown_fields(document, schema) == [".spec.triggers.metadatas"]


# --- consumers ---------------------------------------------------------------------------------
def test_each_consumer_class_stops_within_its_grace_period_and_lets_its_longest_task_finish():
    deployments = consumer_deployments()
    assert len(deployments) >= 2
    for deployment in deployments:
        options = runconsumer_options(deployment)
        timeout_s = float(deployment["metadata"]["annotations"][TIMEOUT_ANNOTATION])
        termination_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        name = deployment["metadata"]["name"]
        # A run started just before SIGTERM may take its whole timeout: the consumer waits that long for it.
        assert options["grace_s"] >= timeout_s, name
        # SIGKILL comes after the consumer's longest stop: its claimers, the grace, its last acks.
        assert termination_s >= exit_within_s(_consumer_options(options)), name
        assert termination_s > timeout_s + options["grace_s"], name


def test_consumer_probes_ask_the_paths_and_port_the_consumer_serves():
    liveness = Liveness(None, stale_after_s=60, task_types_age_s=lambda: 0.0)
    liveness.beat()
    app = make_app(liveness)
    for deployment in consumer_deployments():
        options = runconsumer_options(deployment)
        pod = deployment["spec"]["template"]
        [container] = pod["spec"]["containers"]
        assert options["metrics_host"] == "0.0.0.0"  # the kubelet and Prometheus reach the pod's IP
        assert named_port(container, "metrics") == options["metrics_port"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(options["metrics_port"])
        assert probe_target(container, "livenessProbe") == ("/healthz", options["metrics_port"])
        assert probe_target(container, "readinessProbe") == ("/readyz", options["metrics_port"])
        for probe in ("livenessProbe", "readinessProbe"):
            path, _ = probe_target(container, probe)
            answer: list[str] = []
            environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
            body = b"".join(app(environ, lambda s, h, answer=answer: answer.append(s)))
            assert answer == ["200 OK"] and b'"status"' in body, f"the consumer does not answer {path}"
        assert {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics"}.items() <= pod["metadata"][
            "annotations"
        ].items()


def test_each_consumer_class_has_a_disruption_budget_and_a_scaled_object():
    budgets = {tuple(p["spec"]["selector"]["matchLabels"].items()) for p in of_kind("PodDisruptionBudget")}
    scaled = scaled_objects_by_target()
    for deployment in consumer_deployments():
        assert tuple(deployment["spec"]["selector"]["matchLabels"].items()) in budgets
        assert deployment["metadata"]["name"] in scaled
        assert "replicas" not in deployment["spec"], "the ScaledObject owns the replica count"


def keda_query_terms(query: str) -> list[tuple[str, dict[str, str]]]:
    """Each metric of a query with its label matchers, as in `max(name{label="value"})`."""
    terms = re.findall(r"(\w+)\{([^}]*)\}", query)
    return [(name, dict(re.findall(r'(\w+)="([^"]*)"', matchers))) for name, matchers in terms]


@pytest.mark.django_db
def test_the_keda_trigger_is_the_documented_formula_on_metrics_the_code_exports(broker):
    exported = exported_names(broker)
    gauges = {field: f"taskqueue_{name}" for field, (name, _) in SCALER_GAUGES.items()}
    scaled = scaled_objects_by_target()
    for deployment in consumer_deployments():
        options = runconsumer_options(deployment)
        spec = scaled[deployment["metadata"]["name"]]["spec"]
        [trigger] = spec["triggers"]
        metadata = trigger["metadata"]
        assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
        names = METRIC_NAME.findall(metadata["query"])
        assert names and set(names) <= exported, f"not exported: {set(names) - exported}"
        # ceil((waiting + in flight) / workers of one replica): AverageValue divides by the threshold and rounds up.
        terms = keda_query_terms(metadata["query"])
        assert sorted(name for name, _ in terms) == sorted([gauges["waiting"], gauges["in_flight"]])
        [queue] = options["queues"]
        assert all(labels == {"queue": queue} for _, labels in terms)
        assert "+" in metadata["query"] and metadata["query"].count("max(") == 2  # every pod reports the gauges
        assert int(metadata["threshold"]) == options["concurrency"]
        # Zero replicas only when nothing waits or runs; no answer is an error, not a zero.
        assert spec["minReplicaCount"] == 0 and float(metadata["activationThreshold"]) == 0
        assert metadata["ignoreNullValues"] == "false"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_parses_every_keda_query(tmp_path):
    queries = [s["spec"]["triggers"][0]["metadata"]["query"] for s in of_kind("ScaledObject")]
    recorded = [{"record": f"keda:query{i}", "expr": query} for i, query in enumerate(queries)]
    rules = {"groups": [{"name": "keda", "rules": recorded}]}
    (tmp_path / "keda.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", "keda.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- web and migrations ------------------------------------------------------------------------
def test_the_web_app_is_gunicorn_ready_on_healthz_and_scraped_on_metrics():
    [web] = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "taskqueue-web"]
    pod = web["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["gunicorn", "scheduler_site.wsgi"]
    bind_port = int(re.search(r"GUNICORN_BIND=\S*:(\d+)", (ROOT / "Dockerfile").read_text())[1])
    assert named_port(container, "http") == bind_port
    assert probe_target(container, "readinessProbe") == ("/healthz", bind_port)
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(bind_port)
    assert resolve(annotations["prometheus.io/path"]).url_name == "prometheus-django-metrics"
    assert resolve("/healthz").url_name == "healthz"
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert "$(POD_IP)" in env["DJANGO_ALLOWED_HOSTS"], "probes and scrapes name the pod's IP as the host"
    assert list(env).index("POD_IP") < list(env).index("DJANGO_ALLOWED_HOSTS"), "a variable refers to earlier ones"


def test_the_migrate_job_runs_the_migrations_as_compose_does():
    [job] = of_kind("Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert container["command"] == compose["services"]["migrate"]["command"]


def test_every_pod_reads_the_config_and_secret_the_manifests_name():
    [config] = of_kind("ConfigMap")
    for document in of_kind("Deployment") + of_kind("Job"):
        for container in document["spec"]["template"]["spec"]["containers"]:
            sources = container["envFrom"]
            assert {"configMapRef": {"name": config["metadata"]["name"]}} in sources
            assert {"secretRef": {"name": "taskqueue"}} in sources
