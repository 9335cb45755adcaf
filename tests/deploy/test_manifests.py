"""Offline checks of the Kubernetes manifests in deploy/k8s/.

What is validated, and how:
* Core kinds (Deployment, Service, PodDisruptionBudget,
  HorizontalPodAutoscaler), the base and the GPU overlay (its JSON 6902 patch
  applied here): against the Kubernetes OpenAPI schemas bundled in the PyPI
  package kubernetes-validate (pinned in tests/requirements.txt), in strict mode
  (unknown fields are errors), for the oldest Kubernetes the manifests support
  (1.27: native gRPC probes GA) and the newest the package knows. These tests
  skip, saying so, when kubernetes_validate is not importable; run them with the
  venv of tools/make-venv.sh (COALESCE_PYTHON).
* prometheus-operator kinds (ServiceMonitor, PrometheusRule), whose CRD
  schemas are not bundled: apiVersion, kind, metadata.name and the fields the
  operator requires, checked here by hand; the ServiceMonitor must select
  exactly the Service "coalesce" and name one of its ports; the PrometheusRule
  must hold exactly the groups of deploy/prometheus/coalesce-rules.yml.
* prometheus-adapter-values.yaml (Helm values, not an object): its rule
  exposes the metric the HPA asks for, from a metric the server exports.
* Consistency: selectors match the pod labels, Service target ports exist,
  probes use the gRPC port, the startup probe allows minutes, the grace
  periods add up, kustomization.yaml lists every manifest.
"""

import copy
import os
import re

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(REPO, "deploy", "k8s")
RULES = os.path.join(REPO, "deploy", "prometheus", "coalesce-rules.yml")
METRICS_SOURCE = os.path.join(REPO, "metrics", "server_metrics.cc")

# Files in deploy/k8s that are not Kubernetes objects of the base.
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml"}
SCHEMA_VERSIONS = ["1.27", "latest"]
CORE_KINDS = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kustomization(path):
    with open(os.path.join(path, "kustomization.yaml")) as f:
        return yaml.safe_load(f)


def base_objects():
    out = []
    for rel in kustomization(K8S)["resources"]:
        out.extend(load_yaml_docs(os.path.join(K8S, rel)))
    return out


def one(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or
                                                          o["metadata"]["name"] == name)]
    assert len(found) == 1, "want one %s %s, have %d" % (kind, name or "", len(found))
    return found[0]


def json_pointer_unescape(token):
    return token.replace("~1", "/").replace("~0", "~")


def apply_json6902(doc, ops):
    """Applies the `add`/`replace`/`remove` operations of a JSON 6902 patch (all
    kustomize overlays here use)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        tokens = [json_pointer_unescape(t) for t in op["path"].split("/")[1:]]
        parent = doc
        for t in tokens[:-1]:
            parent = parent[int(t)] if isinstance(parent, list) else parent[t]
        last = tokens[-1]
        if op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif op["op"] == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                if op["op"] == "replace":
                    assert last in parent, "replace of missing %s" % op["path"]
                parent[last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise AssertionError("unsupported patch op %r" % op["op"])
    return doc


def gpu_objects():
    kust = kustomization(os.path.join(K8S, "gpu"))
    assert kust["resources"] == ["../"]
    objects = base_objects()
    for patch in kust["patches"]:
        with open(os.path.join(K8S, "gpu", patch["path"])) as f:
            ops = yaml.safe_load(f)
        target = patch["target"]
        hits = 0
        for i, o in enumerate(objects):
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]:
                objects[i] = apply_json6902(o, ops)
                hits += 1
        assert hits == 1, patch
    return objects


def server_container(deployment):
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


def flag(container, name):
    for a in container.get("args", []):
        if a.startswith("--%s=" % name):
            return a.split("=", 1)[1]
    return None


def seconds(duration):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert m, duration
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


# ---------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------

def _kubernetes_validate():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes_validate is not importable: schema validation of deploy/k8s skipped "
               "(pip install -r tests/requirements.txt in a venv, e.g. tools/make-venv.sh, "
               "and run with COALESCE_PYTHON)")


def _validate_core(objects):
    kv = _kubernetes_validate()
    checked = 0
    for version in SCHEMA_VERSIONS:
        v = kv.latest_version() if version == "latest" else version
        for o in objects:
            if o["kind"] not in CORE_KINDS:
                continue
            try:
                kv.validate(o, v, strict=True)
            except kv.ValidationError as e:
                pytest.fail("%s %s invalid for Kubernetes %s: %s at %s"
                            % (o["kind"], o["metadata"]["name"], v, e.message,
                               "/".join(str(p) for p in e.path)))
            checked += 1
    return checked


def test_core_objects_match_the_kubernetes_schemas():
    objects = base_objects()
    assert {o["kind"] for o in objects} >= CORE_KINDS
    assert _validate_core(objects) == len(SCHEMA_VERSIONS) * sum(
        o["kind"] in CORE_KINDS for o in objects)


def test_gpu_overlay_matches_the_kubernetes_schemas():
    objects = gpu_objects()
    d = one(objects, "Deployment", "coalesce")
    c = server_container(d)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in d["spec"]["template"]["spec"]["tolerations"])
    _validate_core(objects)


def test_schema_validation_catches_mistakes():
    """The validator is not a no-op: a misspelt field and a wrong type fail."""
    kv = _kubernetes_validate()
    d = copy.deepcopy(one(base_objects(), "Deployment"))
    d["spec"]["replica"] = 2
    with pytest.raises(kv.ValidationError):
        kv.validate(d, kv.latest_version(), strict=True)
    d = copy.deepcopy(one(base_objects(), "Deployment"))
    d["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(d, kv.latest_version(), strict=True)


# ---------------------------------------------------------------------------
# prometheus-operator kinds (no bundled schema: the fields the operator needs)
# ---------------------------------------------------------------------------

def test_service_monitor():
    objects = base_objects()
    sm = one(objects, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", sm["metadata"]["name"])
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "jobLabel", "namespaceSelector",
                         "targetLabels", "podTargetLabels", "sampleLimit"}
    wanted = spec["selector"]["matchLabels"]
    services = [o for o in objects if o["kind"] == "Service"
                and all(o["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
    # Exactly the ClusterIP Service: selecting the headless one too would
    # scrape every pod twice.
    assert [s["metadata"]["name"] for s in services] == ["coalesce"], services
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"], spec
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout",
                           "honorLabels", "relabelings", "metricRelabelings"}, ep
        assert ep["port"] in port_names, ep
        assert ep.get("path", "/metrics") == "/metrics"
        if "interval" in ep and "scrapeTimeout" in ep:
            assert seconds(ep["scrapeTimeout"]) <= seconds(ep["interval"])
    # The rules' alerts expect job="coalesce": the job label is the Service's name.
    assert "jobLabel" not in spec
    with open(RULES) as f:
        assert 'job="coalesce"' in f.read()


def test_prometheus_rule_holds_the_rules_file():
    pr = one(base_objects(), "PrometheusRule")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["name"]
    with open(RULES) as f:
        groups = yaml.safe_load(f)["groups"]
    assert pr["spec"]["groups"] == groups, (
        "deploy/k8s/prometheus-rule.yaml is out of date: run "
        "python3 deploy/prometheus/make-prometheusrule.py")
    for g in pr["spec"]["groups"]:
        assert g["name"] and g["rules"]
        for r in g["rules"]:
            assert ("record" in r) != ("alert" in r) and r["expr"], r


# ---------------------------------------------------------------------------
# Autoscaling chain
# ---------------------------------------------------------------------------

def test_hpa_and_prometheus_adapter_agree():
    objects = base_objects()
    hpa = one(objects, "HorizontalPodAutoscaler")
    d = one(objects, "Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", d["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] <= d["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    pods_metrics = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods_metrics, hpa["spec"]["metrics"]
    name = pods_metrics[0]["metric"]["name"]
    assert name == "coalesce_requests_waiting"
    assert pods_metrics[0]["target"]["type"] == "AverageValue"

    with open(os.path.join(K8S, "prometheus-adapter-values.yaml")) as f:
        values = yaml.safe_load(f)
    rules = values["rules"]["custom"]
    exposing = [r for r in rules if r["name"]["as"] == name]
    assert len(exposing) == 1, rules
    rule = exposing[0]
    series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
    assert re.fullmatch(rule["name"]["matches"], series)
    overrides = rule["resources"]["overrides"]
    assert overrides["namespace"]["resource"] == "namespace"
    assert overrides["pod"]["resource"] == "pod"
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"], rule["metricsQuery"]
    # The series is a metric the server exports, under that name.
    with open(METRICS_SOURCE) as f:
        assert '"%s"' % series in f.read(), "%s not in %s" % (series, METRICS_SOURCE)


# ---------------------------------------------------------------------------
# Consistency of the Deployment, Services, PDB
# ---------------------------------------------------------------------------

def test_kustomization_lists_every_manifest():
    listed = set(kustomization(K8S)["resources"])
    present = {f for f in os.listdir(K8S) if f.endswith((".yaml", ".yml"))} - NOT_RESOURCES
    assert listed == present, "kustomization.yaml resources %s, files %s" % (listed, present)
    for o in base_objects():
        assert {"apiVersion", "kind", "metadata"} <= set(o), o
    names = [(o["kind"], o["metadata"]["name"]) for o in base_objects()]
    assert len(names) == len(set(names)), names


def test_selectors_match_the_pods():
    objects = base_objects()
    d = one(objects, "Deployment")
    pod_labels = d["spec"]["template"]["metadata"]["labels"]

    def selects(selector):
        return all(pod_labels.get(k) == v for k, v in selector.items())
    assert selects(d["spec"]["selector"]["matchLabels"])
    assert selects(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    container_ports = {p["name"]: p["containerPort"] for p in server_container(d)["ports"]}
    for svc in (o for o in objects if o["kind"] == "Service"):
        assert selects(svc["spec"]["selector"]), svc["metadata"]["name"]
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in container_ports, p
            assert container_ports[p["targetPort"]] == p["port"], p
    headless = one(objects, "Service", "coalesce-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    assert [p["port"] for p in headless["spec"]["ports"]] == [50051]
    regular = one(objects, "Service", "coalesce")
    assert sorted(p["port"] for p in regular["spec"]["ports"]) == [9090, 50051]
    assert regular["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_probes_and_shutdown():
    d = one(base_objects(), "Deployment")
    pod = d["spec"]["template"]["spec"]
    c = server_container(d)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert flag(c, "port") == str(ports["grpc"]) == "50051"
    assert flag(c, "metrics_port") == str(ports["metrics"]) == "9090"
    assert flag(c, "model"), "no --model"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["grpc"], probe
        assert "service" not in c[probe]["grpc"], "the server's health status is for service ''"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, \
        "give the startup probe minutes for model loading"
    # The grace periods add up: preStop sleep + --grace_period < the pod's.
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = float(pre_stop[1])
    grace = seconds(flag(c, "grace_period"))
    assert sleep + grace + 5 <= pod["terminationGracePeriodSeconds"], (
        sleep, grace, pod["terminationGracePeriodSeconds"])
    # Liveness must not kill a draining pod on kubelets that still probe it.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= sleep + grace
    # In a container, sizes must not be derived from the node.
    assert flag(c, "kv_cache_memory") not in (None, "auto")
    assert flag(c, "threads") not in (None, "0")
    assert "memory" in c["resources"]["limits"]
    # A rolling update never lowers capacity.
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
