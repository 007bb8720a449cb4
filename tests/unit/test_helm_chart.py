"""The Helm chart: the static checks (yamllint, Chart.yaml, values against the schema, copies equal to their
sources, template conventions), then the chart rendered by Helm's own engine in-process (helm-python-sdk
bundles Helm v4 as a library: no binary, no cluster), linted, and every rendered object validated against
the Kubernetes OpenAPI schemas (kubernetes-validate) or, for ServiceMonitor and PrometheusRule, against the
prometheus-operator CRDs vendored in tests/fixtures/crd, with and without those CRDs' API installed."""

from __future__ import annotations

import copy
import datetime
import json
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helm_python import _native
from promtool import check_rules
from yamllint import linter
from yamllint.config import YamlLintConfig

from mcp_stream_exporter.auth import ToolPolicy
from mcp_stream_exporter.detector.settings import ServiceConfig, load

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "mcp-stream-exporter"
TEMPLATES = CHART / "templates"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CRDS = Path(__file__).resolve().parents[1] / "fixtures" / "crd"
MONITORING = "monitoring.coreos.com/v1"
# the oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest kubernetes-validate knows
KUBE_VERSIONS = (re.search(r">=\s*(\d+\.\d+)", yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])[1],
                 ".".join(kubernetes_validate.utils.latest_version().split(".")[:2]))
STANDARD_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                   "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
                   "helm.sh/chart"}
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
# chart-testing's lintconf, with room for the runbook links
YAMLLINT = YamlLintConfig("""
extends: default
rules:
  line-length: {max: 160}
  document-start: disable
  truthy: {check-keys: false}
  comments: {min-spaces-from-content: 1}
  indentation: {spaces: consistent, indent-sequences: whatever}
""")


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a values file over the chart's values.yaml."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _validator(schema: dict[str, Any]) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for ``name`` and its key, as PEM files in ``directory`` (what a kubernetes.io/tls Secret holds)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=36500))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(key, hashes.SHA256()))
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory / "tls.crt", directory / "tls.key"


def _crd_schema(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / name).read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("path", [CHART / "Chart.yaml", CHART / "values.yaml", *CI_VALUES,
                                  *sorted((ROOT / "helm" / "examples").glob("*.yaml")),
                                  *sorted((ROOT / "alerts").rglob("*.yaml"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_yamllint_is_clean(path):
    problems = [str(p) for p in linter.run(path.read_text(), YAMLLINT, str(path))]
    assert problems == []


def test_chart_yaml_is_a_v2_chart_named_after_its_folder_with_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["name"] == CHART.name and chart["type"] == "application"
    assert SEMVER.match(chart["version"]) and chart["appVersion"] == project["version"]


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "values.yaml")
def test_the_merged_values_satisfy_the_schema(values):
    merged = _merge(_values(), yaml.safe_load(values.read_text()) or {}) if values else _values()
    schema = json.loads((CHART / "values.schema.json").read_text())
    errors = [e.message for e in _validator(schema).iter_errors(merged)]
    assert errors == []


@pytest.mark.parametrize("override", [
    {"image": {"tag": "latest"}},
    {"serviceMonitor": {"interval": "five minutes"}},
    {"detector": {"maxSessions": 0}},
    {"detector": {"maxMemoryMb": 0}},
    {"service": {"grpcPort": 70000}},
    {"ingestToken": {"token": "typo for value"}},
    {"toolPolicy": {"tools": {"fetch": {"resources": ["not a uri"]}}}},
    {"toolPolicy": {"tools": {"fetch": {"resource": "https://mcp.example.com/tools/fetch#x"}}}},
    {"toolPolicy": {"tools": {"fetch": ["https://mcp.\u212aey.example/tools/fetch"]}}},
    {"toolPolicy": {"fetch": {"resources": ["https://mcp.example.com/tools/ fetch"]}}},
    {"probes": {"startup": {"failureThreshold": 0}}},
    {"probes": {"liveness": {"timeout": 5}}},
    {"detector": {"extraArgs": ["--api-token=s3cret"]}},
    {"detector": {"extraArgs": ["--metrics-password", "s3cret"]}},
    {"detector": {"extraArgs": ["--tls-cert=/tls/tls.crt"]}},
    {"metricsAuth": {"existingSecret": "Not A Name"}},
    {"serviceMonitor": {"tlsConfig": {"caFile": "/etc/prometheus/ca.crt"}}},
    {"prometheusRule": {"runbookBaseUrl": 'https://wiki.example.com/"runbooks"'}},
], ids=["latest-tag", "bad-duration", "zero-ledger", "zero-memory", "bad-port", "unknown-key", "bad-resource",
        "fragment-in-resource", "non-ascii-in-a-list", "space-in-a-bare-map",
        "zero-startup-budget", "unknown-probe-key", "secret-in-extra-args", "password-in-extra-args",
        "tls-in-extra-args", "bad-secret-name", "unsafe-tls-config", "quote-in-runbook-base"])
def test_the_schema_refuses_wrong_values(override):
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert list(_validator(schema).iter_errors(_merge(_values(), override)))


@pytest.mark.parametrize("resource", ["api://0f9c4e2a", "urn:example:mcp-server", "HTTPS://mcp.example.com/tools",
                                      "https://[::1]:8443/mcp?tenant=a", " https://mcp.example.com/tools/fetch ", ""])
def test_the_schema_takes_every_resource_indicator_the_policy_loader_takes(resource):
    """The loader takes any absolute URI of printable ASCII with no fragment (spaces around it, or an empty one,
    dropped): the chart refusing one of them would fail an upgrade of values that load."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    for policy in ({"tools": {"fetch": [resource]}}, {"tools": {"fetch": {"resource": resource}}},
                   {"fetch": {"resources": [resource]}}):
        assert not list(_validator(schema).iter_errors(_merge(_values(), {"toolPolicy": policy})))
        ToolPolicy.from_mapping(policy)


def test_the_memory_budget_defaults_agree_and_leave_half_the_pods_memory_limit_to_the_runtime():
    values = _values()
    limit = values["resources"]["limits"]["memory"]
    assert limit.endswith("Mi")
    assert values["detector"]["maxMemoryMb"] == ServiceConfig().max_memory_mb
    assert values["detector"]["maxMemoryMb"] <= int(limit[:-2]) // 2


def test_every_value_is_used_by_a_template():
    templates = "".join(p.read_text() for p in TEMPLATES.iterdir())

    def paths(node: dict[str, Any], prefix: str) -> list[str]:
        out = []
        for key, value in node.items():
            path = f"{prefix}.{key}"
            if isinstance(value, dict) and value and key not in {"resources", "podSecurityContext", "securityContext"}:
                out += paths(value, path)
            else:
                out.append(path)
        return out

    unused = [p for p in paths(_values(), ".Values") if p not in templates]
    assert unused == []


def test_the_chart_carries_exact_copies_of_the_alerts_and_dashboards():
    for source, copies in ((ROOT / "alerts", CHART / "files" / "alerts"),
                           (ROOT / "dashboards", CHART / "files" / "dashboards")):
        wanted = sorted(p.name for p in source.glob("*.json")) + sorted(p.name for p in source.glob("*.yaml"))
        assert sorted(p.name for p in copies.iterdir()) == sorted(wanted)
        for name in wanted:
            assert (copies / name).read_bytes() == (source / name).read_bytes(), f"copy {name} into {copies}"


def test_templates_follow_the_chart_conventions():
    for path in TEMPLATES.glob("*.yaml"):
        text = path.read_text()
        assert 'include "mcp-stream-exporter.labels"' in text, f"{path.name}: standard labels"
        assert ":latest" not in text
    for name in ("servicemonitor.yaml", "prometheusrule.yaml"):
        first = (TEMPLATES / name).read_text().splitlines()[0]
        assert '"mcp-stream-exporter.operatorObject"' in first and ".Capabilities" in first, name
    dashboards = (TEMPLATES / "grafana-dashboards-configmap.yaml").read_text()
    assert '.Files.Glob "files/dashboards/*.json"' in dashboards and ".Values.grafanaDashboards.label" in dashboards
    pod = (TEMPLATES / "_helpers.tpl").read_text()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe", "/healthz", "/readyz"):
        assert probe in pod
    security = _values()["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"] and _values()["podSecurityContext"]["runAsNonRoot"]


def test_the_prometheus_rule_payload_satisfies_the_crd_schema():
    spec = yaml.safe_load((CHART / "files" / "alerts" / "mcp-stream-exporter.yaml").read_text())
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "mcp-stream-exporter"}, "spec": spec}
    schema = _crd_schema("prometheusrules.yaml")
    assert [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(rule)] == []
    broken = copy.deepcopy(rule)
    broken["spec"]["groups"][1]["rules"][0]["for"] = "one minute"
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken)), "the CRD schema checks durations"


def test_the_collector_example_routes_sessions_to_the_charts_headless_service_over_grpc():
    config = yaml.safe_load((ROOT / "helm" / "examples" / "otel-collector-loadbalancing.yaml").read_text())
    exporter = config["exporters"]["load_balancing"]
    assert exporter["routing_key"] == "attributes" and exporter["routing_attributes"] == ["mcp.session.id"]
    assert "otlp" in exporter["protocol"]
    service, port = exporter["resolver"]["k8s"]["service"], exporter["resolver"]["k8s"]["ports"][0]
    assert service.split(".")[0] == f"{CHART.name}-headless" and port == _values()["service"]["grpcPort"]
    assert "-headless" in (TEMPLATES / "service-headless.yaml").read_text()
    pipelines = config["service"]["pipelines"]
    assert {name: pipeline["exporters"] for name, pipeline in pipelines.items()} == {
        "traces/sessions": ["load_balancing"], "traces/no-session": ["load_balancing"]}


def test_the_collector_example_keeps_spans_with_a_session_and_spans_without_in_pipelines_of_their_own():
    """The exporter routes a trace's share of a batch by its first span: a span without a session must never lead
    a session's spans (tests/integration/test_scale_out.py routes as it does)."""
    config = yaml.safe_load((ROOT / "helm" / "examples" / "otel-collector-loadbalancing.yaml").read_text())
    dropped = {name: config["processors"][name]["traces"]["span"] for name in config["processors"]
               if name.startswith("filter/")}
    pipelines = config["service"]["pipelines"]
    kept = {name: [dropped[p] for p in pipeline["processors"] if p in dropped] for name, pipeline in pipelines.items()}
    assert kept == {"traces/sessions": [['attributes["mcp.session.id"] == nil']],
                    "traces/no-session": [['attributes["mcp.session.id"] != nil']]}


def _manifests(chart: Path, values: dict[str, Any], api_versions: tuple[str, ...],
               kube: str = KUBE_VERSIONS[0]) -> dict[str, str]:
    """``helm template RELEASE CHART -f values --api-versions ... --kube-version ...``, in-process: each template's
    output (NOTES.txt included) by its path.

    helm-python-sdk's ``Chart.render`` does not pass capabilities through; its native render (Helm's
    ``engine.Render`` after ``ToRenderValues``, which also checks values.schema.json) takes them as the
    ``api_versions`` and ``kube_version`` options, and rejects an unknown option, so a wrapper that drops
    them fails here rather than rendering with the defaults."""
    options = {"name": "mcp-stream-exporter", "namespace": "monitoring", "api_versions": list(api_versions),
               "kube_version": f"v{kube}.0"}
    loaded = helm_python.Chart.load(chart)
    manifests: dict[str, str] = json.loads(
        _native.call_string("helm_render", loaded._raw(), json.dumps(values), json.dumps(options)))
    return manifests


def _render(chart: Path, values: dict[str, Any], api_versions: tuple[str, ...],
            kube: str = KUBE_VERSIONS[0]) -> list[dict[str, Any]]:
    """The objects ``helm template`` renders (see ``_manifests``)."""
    manifests = _manifests(chart, values, api_versions, kube)
    return [obj for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text) if obj]


def _notes(values: dict[str, Any], api_versions: tuple[str, ...]) -> str:
    """NOTES.txt as ``helm install`` prints it."""
    return _manifests(CHART, values, api_versions)[f"{CHART.name}/templates/NOTES.txt"]


def _validate(obj: dict[str, Any], kube: str = KUBE_VERSIONS[0]) -> list[str]:
    """Schema errors of one rendered object: the CRD's schema for the operator's kinds, Kubernetes' otherwise."""
    crds = {"ServiceMonitor": "servicemonitors.yaml", "PrometheusRule": "prometheusrules.yaml"}
    if obj["kind"] in crds:
        return [e.message for e in jsonschema.Draft7Validator(_crd_schema(crds[obj["kind"]])).iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, kube, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{obj['kind']}/{obj['metadata']['name']}: {error.message}"]
    return []


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_helm_lint_strict_is_clean(values):
    report = helm_python.lint(CHART, yaml.safe_load(values.read_text()) or {}, strict=True,
                              kube_version=f"v{KUBE_VERSIONS[0]}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["total_charts_linted"] == 1 and report["errors"] == [] and problems == []


@pytest.mark.parametrize("kube", KUBE_VERSIONS, ids=lambda v: f"kubernetes-{v}")
@pytest.mark.parametrize("monitoring", [True, False], ids=["with-monitoring-crds", "without-monitoring-crds"])
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_helm_renders_valid_kubernetes_objects(values, monitoring, kube, tmp_path):
    objects = _render(CHART, yaml.safe_load(values.read_text()) or {}, (MONITORING,) if monitoring else (), kube)
    kinds = {o["kind"] for o in objects}
    assert {"Service", "ConfigMap", "PodDisruptionBudget"} <= kinds and kinds & {"Deployment", "StatefulSet"}
    assert [error for obj in objects for error in _validate(obj, kube)] == []
    operator_kinds = {"ServiceMonitor", "PrometheusRule"}
    if not monitoring:
        assert not kinds & operator_kinds, "the operator's objects only where its API exists"
        return
    assert operator_kinds <= kinds
    (rules,) = [o["spec"] for o in objects if o["kind"] == "PrometheusRule"]
    check = check_rules(rules, tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("enabled", [True, False])
def test_the_operators_objects_enabled_explicitly_render_or_not_whatever_the_cluster_serves(enabled):
    """``auto`` (the default) follows the cluster's API; rendered offline (``helm template`` without --api-versions, a
    GitOps tool), it left them out without a word, so nothing scraped the detector and no alert existed."""
    values = {"serviceMonitor": {"enabled": enabled}, "prometheusRule": {"enabled": enabled}}
    for api_versions in ((), (MONITORING,)):
        kinds = {o["kind"] for o in _render(CHART, values, api_versions)}
        assert ({"ServiceMonitor", "PrometheusRule"} <= kinds) == enabled
        assert not enabled or {"ServiceMonitor", "PrometheusRule"} <= kinds
    assert not {"ServiceMonitor", "PrometheusRule"} & {o["kind"] for o in _render(CHART, {}, ())}  # auto


def test_a_rendered_object_that_breaks_its_schema_is_caught():
    objects = _render(CHART, {}, (MONITORING,))
    (deployment,) = [copy.deepcopy(o) for o in objects if o["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = "three"
    (monitor,) = [copy.deepcopy(o) for o in objects if o["kind"] == "ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = "five minutes"
    assert _validate(deployment) and _validate(monitor)


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_pods_carry_the_standard_labels_and_selectors_only_the_stable_ones(values):
    objects = _render(CHART, yaml.safe_load(values.read_text()) or {}, (MONITORING,))
    workloads = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    assert workloads
    for workload in workloads:
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert set(pod_labels) >= STANDARD_LABELS
        assert pod_labels["app.kubernetes.io/managed-by"] == "Helm"
        selector = workload["spec"]["selector"]["matchLabels"]
        assert set(selector) == {"app.kubernetes.io/name", "app.kubernetes.io/instance"}
        assert selector.items() <= pod_labels.items()
    for obj in objects:
        assert set(obj["metadata"]["labels"]) >= STANDARD_LABELS, f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_chart_works_as_a_subchart_with_global_values(tmp_path):
    parent = tmp_path / "platform"
    shutil.copytree(CHART, parent / "charts" / CHART.name)
    (parent / "Chart.yaml").write_text("apiVersion: v2\nname: platform\nversion: 1.0.0\n")
    (parent / "values.yaml").write_text("global:\n  imageRegistry: registry.example.com\n")
    objects = _render(parent, {CHART.name: {"replicaCount": 1}}, ())
    assert "Deployment" in {o["kind"] for o in objects}
    assert [error for obj in objects for error in _validate(obj)] == []


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_the_detectors_args_are_settings_serve_accepts_on_the_ports_the_service_exposes(values, tmp_path,
                                                                                         monkeypatch):
    for name in [n for n in os.environ if n.upper().startswith("MCP_STREAM_")]:
        monkeypatch.delenv(name)
    objects = _render(CHART, yaml.safe_load(values.read_text()) or {}, (MONITORING,))
    (workload,) = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    assert args.pop(0) == "serve"
    for policy in [o["data"]["policy.json"] for o in objects if o["metadata"]["name"].endswith("-policy")]:
        (tmp_path / "policy.json").write_text(policy)  # the ConfigMap the pod mounts, here
        args = [f"--policy={tmp_path / 'policy.json'}" if a.startswith("--policy=") else a for a in args]
    if any(a.startswith("--tls-cert=") for a in args):  # the Secret the pod mounts, here
        cert, key = _self_signed(tmp_path, "mcp-stream-exporter.monitoring.svc")
        args = [f"--tls-cert={cert}" if a.startswith("--tls-cert=") else
                f"--tls-key={key}" if a.startswith("--tls-key=") else a for a in args]
    for env in container.get("env", []):  # each Secret's key, as the kubelet would set it
        ref = env["valueFrom"]["secretKeyRef"]
        assert env["name"].removeprefix("MCP_STREAM_").lower() in ServiceConfig.model_fields, env["name"]
        monkeypatch.setenv(env["name"], f"{ref['name']}/{ref['key']}")
    config = load(args).config
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.port, "otlp-grpc": config.grpc_port, "otlp-http": config.otlp_http_port}
    (service,) = [o for o in objects if o["kind"] == "Service" and "clusterIP" not in o["spec"]]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (workload,) = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_the_startup_budget_and_the_liveness_timeout_come_from_probes_values():
    """The restore of a large snapshot can outlast the 60 s startup budget (the detector answers /healthz after it),
    and a busy detector may answer its liveness probe late: both are values the runbooks name."""
    container = _container(_render(CHART, {}, ()))
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] == 60
    assert container["livenessProbe"]["timeoutSeconds"] == 1
    values = {"probes": {"startup": {"periodSeconds": 5, "failureThreshold": 120}, "liveness": {"timeoutSeconds": 4}}}
    container = _container(_render(CHART, values, ()))
    assert (container["startupProbe"]["periodSeconds"], container["startupProbe"]["failureThreshold"]) == (5, 120)
    assert container["livenessProbe"]["timeoutSeconds"] == 4
    runbook = (ROOT / "docs" / "runbooks" / "MCPStreamExporterRestarting.md").read_text()
    for value in ("probes.startup.failureThreshold", "probes.liveness.timeoutSeconds"):
        assert f"`{value}`" in runbook


def test_a_new_ingest_token_from_values_rolls_the_pods_which_read_it_only_as_they_start():
    """The token reaches the detector as an environment variable from the chart's Secret: an upgrade that changed only
    the Secret left the pods on the old token, and every sender on the new one was refused (401)."""
    def template(token: str) -> dict[str, Any]:
        objects = _render(CHART, {"ingestToken": {"enabled": True, "value": token}}, ())
        (workload,) = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
        return dict(workload["spec"]["template"])

    assert template("old-token") != template("new-token")
    assert template("old-token") == template("old-token")


def test_the_chart_values_the_runbooks_name_exist():
    """A runbook told the on-call to raise "the probe's timeout" and to set `statefulSet: true`, neither of which the
    schema accepts. Every backticked dotted name (or `name: value`) led by a top-level value is a value here."""
    values = _values()
    not_values = {"service.name"}  # the OpenTelemetry resource attribute
    named = []
    for runbook in sorted((ROOT / "docs" / "runbooks").glob("*.md")):
        for path, value in re.findall(r"`([a-z][A-Za-z]*(?:\.[A-Za-z]+)*)(?:: ([^`]+))?`", runbook.read_text()):
            if path.split(".")[0] in values and path not in not_values:
                named.append((runbook.name, path, value))
    assert {path for _, path, _ in named} >= {"snapshot.enabled", "statefulSet.enabled", "replicaCount",
                                               "probes.startup.failureThreshold", "probes.liveness.timeoutSeconds"}
    for runbook, path, value in named:
        node: Any = values
        for key in path.split("."):
            assert isinstance(node, dict) and key in node, f"{runbook}: `{path}` is no chart value"
            node = node[key]
        assert not (value and isinstance(node, dict)), f"{runbook}: `{path}: {value}` sets a whole section"


def test_with_tls_the_detector_mounts_the_secret_and_its_probes_and_scrapes_speak_https():
    """Through extraArgs alone, the probes stayed on HTTP against an HTTPS server (the startup probe killed the pod)
    and the ServiceMonitor scraped http (up 0, MCPStreamExporterDown paged)."""
    tls_config = {"ca": {"secret": {"name": "detector-tls", "key": "ca.crt"}},
                  "serverName": "mcp-stream-exporter.monitoring.svc"}
    values = {"tls": {"secretName": "detector-tls"}, "serviceMonitor": {"tlsConfig": tls_config},
              "toolPolicy": {"tools": {"search": ["https://mcp.example.com/tools/search"]}}}
    objects = _render(CHART, values, (MONITORING,))
    container = _container(objects)
    (workload,) = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "detector-tls"
    assert {i["key"] for i in volumes["tls"]["secret"]["items"]} == {"tls.crt", "tls.key"}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    (policy,) = [m for m in container["volumeMounts"] if m["name"] == "policy"]
    assert mount["readOnly"] and not Path(mount["mountPath"]).is_relative_to(policy["mountPath"])
    assert {f"--tls-cert={mount['mountPath']}/tls.crt", f"--tls-key={mount['mountPath']}/tls.key"} <= set(
        container["args"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == tls_config
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    findings = [r["annotations"]["findings_url"] for g in rule["spec"]["groups"] for r in g["rules"]
                if "findings_url" in r.get("annotations", {})]
    assert findings and all(url.startswith("https://{{ $labels.instance }}/ui/") for url in findings)
    notes = _notes(values, (MONITORING,))
    assert "https://mcp-stream-exporter.monitoring.svc:4318/v1/traces" in notes and "http://" not in notes
    assert "tlsConfig is empty" not in notes


def test_without_tls_the_probes_and_scrapes_stay_on_http_and_a_tls_config_is_not_used():
    objects = _render(CHART, {"serviceMonitor": {"tlsConfig": {"insecureSkipVerify": True}}}, (MONITORING,))
    container = _container(objects)
    assert not [a for a in container["args"] if a.startswith("--tls-")]
    assert all(container[p]["httpGet"]["scheme"] == "HTTP" for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert "scheme" not in monitor["spec"]["endpoints"][0] and "tlsConfig" not in monitor["spec"]["endpoints"][0]


def test_tls_without_a_tls_config_for_the_scrape_is_warned_of():
    notes = _notes({"tls": {"secretName": "detector-tls"}}, (MONITORING,))
    assert "WARNING: serviceMonitor.tlsConfig is empty" in notes


def _env(container: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])}


def test_with_metrics_auth_the_detector_and_the_servicemonitor_read_the_same_secret_keys():
    values = {"metricsAuth": {"existingSecret": "scrape-auth", "usernameKey": "user", "passwordKey": "pass"}}
    objects = _render(CHART, values, (MONITORING,))
    env = _env(_container(objects))
    assert env["MCP_STREAM_METRICS_USER"] == {"name": "scrape-auth", "key": "user"}
    assert env["MCP_STREAM_METRICS_PASSWORD"] == {"name": "scrape-auth", "key": "pass"}
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    basic = monitor["spec"]["endpoints"][0]["basicAuth"]
    assert basic == {"username": env["MCP_STREAM_METRICS_USER"], "password": env["MCP_STREAM_METRICS_PASSWORD"]}
    (plain,) = [o for o in _render(CHART, {}, (MONITORING,)) if o["kind"] == "ServiceMonitor"]
    assert "basicAuth" not in plain["spec"]["endpoints"][0]
    assert "basic auth" in _notes(values, ()) and "scrape-auth" in _notes(values, ())


def test_with_an_api_token_the_detector_reads_it_from_its_secret_and_notes_send_it_as_a_bearer():
    values = {"apiToken": {"existingSecret": "detector-api", "secretKey": "token"}}
    assert _env(_container(_render(CHART, values, ()))) == {
        "MCP_STREAM_API_TOKEN": {"name": "detector-api", "key": "token"}}
    notes = _notes(values, ())
    assert "get secret detector-api -o jsonpath='{.data.token}'" in notes
    assert 'curl -H "Authorization: Bearer $TOKEN" http://127.0.0.1:9464/api/findings' in notes
    assert "Bearer" not in _notes({}, ())


def test_no_secret_value_is_ever_in_the_pods_args_or_plain_env():
    """Through extraArgs, the tokens and the metrics password were in the pod's args: in plain text for whoever may
    read the Deployment. Every secret now comes from a Secret by reference; the chart holds no value but the
    ingest token it was asked to create a Secret for."""
    values = _merge(yaml.safe_load((CHART / "ci" / "secured-values.yaml").read_text()),
                    {"ingestToken": {"existingSecret": "", "value": "ingest-s3cret"}})
    objects = _render(CHART, values, (MONITORING,))
    container = _container(objects)
    secret_flags = ("--ingest-token", "--api-token", "--metrics-user", "--metrics-password")
    assert not [a for a in container["args"] if a.startswith(secret_flags)]
    assert all(set(e) == {"name", "valueFrom"} for e in container["env"])
    assert set(_env(container)) == {"MCP_STREAM_INGEST_TOKEN", "MCP_STREAM_API_TOKEN", "MCP_STREAM_METRICS_USER",
                                    "MCP_STREAM_METRICS_PASSWORD"}
    (workload,) = [o for o in objects if o["kind"] in {"Deployment", "StatefulSet"}]
    assert "ingest-s3cret" not in json.dumps(workload)
    assert [o["kind"] for o in objects if "ingest-s3cret" in json.dumps(o) or "aW5nZXN0LXMzY3JldA" in json.dumps(o)
            ] == ["Secret"]


def _runbook_links(objects: list[dict[str, Any]], base: str) -> list[str]:
    """The runbook links (to GitHub's docs/runbooks/, or to ``base``) of the rendered PrometheusRule and dashboards
    ConfigMaps."""
    shipped = [o for o in objects if o["kind"] == "PrometheusRule"
               or (o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"])]
    urls = re.findall(r"https?://[^\s\"'\\)\]]+", "\n".join(json.dumps(o) for o in shipped))
    return [u for u in urls if "/docs/runbooks/" in u or u.startswith(base)]


@pytest.mark.parametrize("base", ["https://runbooks.internal.example/mcp", "https://runbooks.internal.example/mcp/"])
def test_runbook_base_url_reaches_every_runbook_link_the_alerts_the_dashboards_and_the_detector(base, monkeypatch):
    """An air-gapped cluster's alerts linked the mirror, its dashboards and findings page still linked GitHub."""
    for name in [n for n in os.environ if n.upper().startswith("MCP_STREAM_")]:
        monkeypatch.delenv(name)
    root = base.rstrip("/")
    github = _runbook_links(_render(CHART, {}, (MONITORING,)), root)
    assert github and all(u.startswith("https://github.com/") for u in github)
    objects = _render(CHART, {"prometheusRule": {"runbookBaseUrl": base}}, (MONITORING,))
    mirrored = _runbook_links(objects, root)
    assert len(mirrored) == len(github) and all(u.startswith(f"{root}/") for u in mirrored), mirrored
    alerts = {p.stem for p in (ROOT / "docs" / "runbooks").glob("*.md")}
    assert {u.removeprefix(f"{root}/") for u in mirrored} - {""} <= {f"{a}.md" for a in alerts}
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    for alert in (r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r):
        assert alert["annotations"]["runbook_url"] == f"{root}/{alert['alert']}.md"
    args = _container(objects)["args"]
    assert f"--runbook-base-url={base}" in args
    assert load(args[1:]).config.links().runbook("MCPResumeLoop") == f"{root}/MCPResumeLoop.md"
    assert not [a for a in _container(_render(CHART, {}, ()))["args"] if a.startswith("--runbook-base-url")]


@pytest.mark.parametrize("namespace", ["", "mcp-apps"])
def test_the_guard_redis_secret_is_created_where_the_mcp_servers_that_mount_it_run(namespace):
    """A pod reads a Secret of its own namespace only: one in the detector's is of no use to servers elsewhere."""
    values = {"guardRedis": {"url": "rediss://:pw@redis:6379/0", "namespace": namespace}}
    (secret,) = [o for o in _render(CHART, values, ()) if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "mcp-stream-exporter-guard-redis"  # as docs/guard.md names it
    assert secret["metadata"]["namespace"] == (namespace or "monitoring")
    assert _validate(secret) == []


@pytest.mark.parametrize(("interval", "refused"), [("5s", "must not exceed serviceMonitor.interval"),
                                                   ("3m", "must be at most 75s"), ("1m15s", None), ("15s", None)])
def test_a_scrape_interval_that_would_scrape_nothing_or_silence_the_rate_alerts_is_refused(interval, refused):
    """A timeout past the interval: the operator refuses the ServiceMonitor whole. An interval past 2.5 minutes: the
    alerts' rates over 5 minutes never see two samples. Either was rendered, and failed silently."""
    values = {"serviceMonitor": {"enabled": True, "interval": interval}}
    if refused is None:
        (monitor,) = [o for o in _render(CHART, values, (MONITORING,)) if o["kind"] == "ServiceMonitor"]
        assert monitor["spec"]["endpoints"][0]["interval"] == interval
        return
    with pytest.raises(Exception, match=refused):
        _render(CHART, values, (MONITORING,))
