"""Offline checks of the Kubernetes manifests in deploy/k8s/.

What is built, and how: deploy/k8s (CPU) and deploy/k8s/gpu are kustomize
overlays of deploy/k8s/base. `build` below does what kustomize does with the
fields these kustomizations use (resources, namespace, replacements, images,
JSON 6902 patches), refuses any other field, and refuses what kustomize
refuses: a folder holding a kustomization it builds on ("cycle detected").

What is validated:
* Core kinds (Namespace, Deployment, Service, PodDisruptionBudget,
  HorizontalPodAutoscaler, NetworkPolicy) of both builds: against the
  Kubernetes OpenAPI schemas bundled in the PyPI package kubernetes-validate
  (pinned in tests/requirements.txt), in strict mode (unknown fields are
  errors), for the oldest Kubernetes the manifests support (1.27: native gRPC
  probes GA) and the newest the package knows. These tests skip, saying so,
  when kubernetes_validate is not importable; run them with the venv of
  tools/make-venv.sh (COALESCE_PYTHON).
* Kinds of CRDs, whose schemas are not bundled: prometheus-operator's
  ServiceMonitor and PrometheusRule, cert-manager's Certificate. Their
  apiVersion, kind, name and the fields the operators read, checked here by
  hand (unknown fields fail); the ServiceMonitor must select exactly the
  Service "coalesce" and name one of its ports; the PrometheusRule must hold
  exactly the groups of deploy/prometheus/coalesce-rules.yml.
* prometheus-adapter-values.yaml (Helm values, not an object): its rule
  exposes the metric the HPA asks for, from a metric the server exports.
* The wiring, each check a function that test_wiring_checks_catch_mistakes
  also runs on broken copies, so that a check that cannot fail fails:
  - the server's TLS and keys-file flags name files of the mounted Secrets
    (whole-directory mounts, readable by the server's group only), the TLS
    Secret is the one the Certificate fills, and deploy/README.md tells to
    create the keys Secret under the name and key the Deployment mounts;
  - the Certificate names both Services in the kustomization's namespace,
    and follows it when it changes;
  - the probes ask the plaintext --health_port, a container port of its own;
  - the NetworkPolicy selects the Deployment's pods, admits the gRPC port
    from the clients' namespace and the metrics port from Prometheus (the
    ServiceMonitor's port), nothing to the health port, no egress;
  - selectors match the pods, Service target ports exist, the gRPC ports do
    not claim cleartext HTTP/2, the pods meet the namespace's Pod Security
    level, the grace periods add up, every manifest is listed.
"""

import copy
import os
import re

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(REPO, "deploy", "k8s")
BASE = os.path.join(K8S, "base")
GPU = os.path.join(K8S, "gpu")
ADAPTER_VALUES = os.path.join(K8S, "prometheus-adapter-values.yaml")
RULES = os.path.join(REPO, "deploy", "prometheus", "coalesce-rules.yml")
README = os.path.join(REPO, "deploy", "README.md")
METRICS_SOURCE = os.path.join(REPO, "metrics", "server_metrics.cc")

# Files of deploy/k8s/ that are not kustomize resources.
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml"}
SCHEMA_VERSIONS = ["1.27", "latest"]
CORE_KINDS = {"Namespace", "Deployment", "Service", "PodDisruptionBudget",
              "HorizontalPodAutoscaler", "NetworkPolicy"}
CLUSTER_SCOPED = {"Namespace", "ClusterIssuer", "ClusterRole", "ClusterRoleBinding"}
# libyaml's loader where PyYAML has it (the same documents, faster).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_PARSED = {}


def load_yaml_docs(path):
    """The documents of a YAML file: parsed once, a fresh copy each call (the
    checks below build the manifests dozens of times and edit the copies)."""
    if path not in _PARSED:
        with open(path) as f:
            _PARSED[path] = [d for d in yaml.load_all(f, Loader=_LOADER) if d is not None]
    return copy.deepcopy(_PARSED[path])


def kustomization(path):
    return load_yaml_docs(os.path.join(path, "kustomization.yaml"))[0]


# ---------------------------------------------------------------------------
# kustomize, the part of it deploy/k8s uses
# ---------------------------------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "replacements", "images",
                        "patches"}


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


def _group(obj):
    api = obj["apiVersion"]
    return api.split("/")[0] if "/" in api else ""


def _selected(obj, select):
    unknown = set(select) - {"group", "version", "kind", "name"}
    assert not unknown, "selector fields this test does not know: %s" % unknown
    return (select.get("kind", obj["kind"]) == obj["kind"]
            and select.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
            and select.get("group", _group(obj)) == _group(obj)
            and ("version" not in select or obj["apiVersion"].endswith("/" + select["version"])))


def _path_tokens(field_path):
    return [int(t) if t.isdigit() else t for t in field_path.split(".")]


def _get(obj, field_path):
    for t in _path_tokens(field_path):
        obj = obj[t]
    return obj


def _set(obj, field_path, value):
    tokens = _path_tokens(field_path)
    for t in tokens[:-1]:
        obj = obj[t]
    obj[tokens[-1]] = value


def apply_replacement(objects, replacement):
    source = replacement["source"]
    sources = [o for o in objects if _selected(o, {k: v for k, v in source.items()
                                                   if k != "fieldPath"})]
    assert len(sources) == 1, "replacement source %s matches %d objects" % (source, len(sources))
    value = _get(sources[0], source["fieldPath"])
    for target in replacement["targets"]:
        hits = [o for o in objects if _selected(o, target["select"])]
        assert hits, "replacement target %s matches nothing" % target["select"]
        options = target.get("options", {})
        assert set(options) <= {"delimiter", "index"}, options
        for o in hits:
            for fp in target["fieldPaths"]:
                new = value
                if "delimiter" in options:
                    parts = _get(o, fp).split(options["delimiter"])
                    assert 0 <= options["index"] < len(parts), (fp, parts)
                    parts[options["index"]] = value
                    new = options["delimiter"].join(parts)
                _set(o, fp, new)


def apply_images(objects, images):
    for image in images:
        for o in objects:
            pod = o.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                if re.split(r"[:@]", c["image"])[0] == image["name"]:
                    c["image"] = "%s:%s" % (image.get("newName", image["name"]),
                                            image.get("newTag", "latest"))


def build(path, kust=None, _roots=()):
    """The objects kustomize builds from the kustomization in `path` (or from
    `kust` as if it were that file)."""
    path = os.path.realpath(path)
    for root in _roots:
        # kustomize: "cycle detected: candidate root ... contains visited root".
        assert not (root + os.sep).startswith(path + os.sep), (
            "kustomize refuses %s: it holds %s, which builds on it" % (path, root))
    kust = kust if kust is not None else kustomization(path)
    unknown = set(kust) - KUSTOMIZATION_FIELDS
    assert not unknown, "%s: kustomization fields this test does not build: %s" % (path, unknown)
    objects = []
    for rel in kust.get("resources", []):
        full = os.path.join(path, rel)
        if os.path.isdir(full):
            objects.extend(build(full, _roots=_roots + (path,)))
        else:
            assert os.path.realpath(full).startswith(path + os.sep), (
                "kustomize loads no file outside its folder: %s" % rel)
            objects.extend(load_yaml_docs(full))
    for patch in kust.get("patches", []):
        with open(os.path.join(path, patch["path"])) as f:
            ops = yaml.safe_load(f)
        assert isinstance(ops, list), "only JSON 6902 patches are built here"
        hits = [i for i, o in enumerate(objects) if _selected(o, patch["target"])]
        assert len(hits) == 1, patch
        objects[hits[0]] = apply_json6902(objects[hits[0]], ops)
    if "namespace" in kust:
        for o in objects:
            if o["kind"] == "Namespace":
                o["metadata"]["name"] = kust["namespace"]
            elif o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = kust["namespace"]
    apply_images(objects, kust.get("images", []))
    for r in kust.get("replacements", []):
        apply_replacement(objects, r)
    return objects


def cpu_objects():
    return build(K8S)


def gpu_objects():
    return build(GPU)


def one(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or
                                                          o["metadata"]["name"] == name)]
    assert len(found) == 1, "want one %s %s, have %d" % (kind, name or "", len(found))
    return found[0]


def server_container(deployment):
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


def flag(container, name):
    for a in container.get("args", []):
        if a.startswith("--%s=" % name):
            return a.split("=", 1)[1]
    return None


def seconds(duration):
    """A duration of the server's flags or of Go (cert-manager): 30s, 10m,
    2160h, 1h30m."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(a + b for a, b in parts) == duration, duration
    return sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)


def container_ports(container):
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def resolve_port(container, port):
    """A port of a Service's targetPort or a NetworkPolicy: a number, or the
    name of a container port."""
    if isinstance(port, int):
        return port
    return container_ports(container)[port]


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
    objects = cpu_objects()
    assert {o["kind"] for o in objects} >= CORE_KINDS
    assert _validate_core(objects) == len(SCHEMA_VERSIONS) * sum(
        o["kind"] in CORE_KINDS for o in objects)


def test_gpu_overlay_matches_the_kubernetes_schemas():
    objects = gpu_objects()
    d = one(objects, "Deployment", "coalesce")
    c = server_container(d)
    assert c["image"] == "coalesce-cuda:latest"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in d["spec"]["template"]["spec"]["tolerations"])
    # Everything else is the base's: TLS, keys, probes, policy.
    for check in WIRING_CHECKS.values():
        check(objects)
    _validate_core(objects)


def test_schema_validation_catches_mistakes():
    """The validator is not a no-op: a misspelt field and a wrong type fail."""
    kv = _kubernetes_validate()
    d = copy.deepcopy(one(cpu_objects(), "Deployment"))
    d["spec"]["replica"] = 2
    with pytest.raises(kv.ValidationError):
        kv.validate(d, kv.latest_version(), strict=True)
    d = copy.deepcopy(one(cpu_objects(), "Deployment"))
    d["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"] = "health"
    with pytest.raises(kv.ValidationError):
        kv.validate(d, kv.latest_version(), strict=True)
    p = copy.deepcopy(one(cpu_objects(), "NetworkPolicy"))
    p["spec"]["ingress"][0]["form"] = p["spec"]["ingress"][0].pop("from")
    with pytest.raises(kv.ValidationError):
        kv.validate(p, kv.latest_version(), strict=True)


# ---------------------------------------------------------------------------
# Kinds of CRDs (no bundled schema: the fields their operators need)
# ---------------------------------------------------------------------------

def test_service_monitor():
    objects = cpu_objects()
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
        # The metrics endpoint is plaintext HTTP, TLS or not on the gRPC port.
        assert ep.get("scheme", "http") == "http", ep
        if "interval" in ep and "scrapeTimeout" in ep:
            assert seconds(ep["scrapeTimeout"]) <= seconds(ep["interval"])
    # The rules' alerts expect job="coalesce": the job label is the Service's name.
    assert "jobLabel" not in spec
    with open(RULES) as f:
        assert 'job="coalesce"' in f.read()


def test_prometheus_rule_holds_the_rules_file():
    pr = one(cpu_objects(), "PrometheusRule")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["name"]
    with open(RULES) as f:
        groups = yaml.safe_load(f)["groups"]
    assert pr["spec"]["groups"] == groups, (
        "deploy/k8s/base/prometheus-rule.yaml is out of date: run "
        "python3 deploy/prometheus/make-prometheusrule.py")
    for g in pr["spec"]["groups"]:
        assert g["name"] and g["rules"]
        for r in g["rules"]:
            assert ("record" in r) != ("alert" in r) and r["expr"], r


# cert-manager.io/v1 Certificate: the spec fields and key usages cert-manager
# knows (its CRD's enums).
CERTIFICATE_SPEC_FIELDS = {
    "secretName", "secretTemplate", "issuerRef", "commonName", "dnsNames", "ipAddresses", "uris",
    "emailAddresses", "otherNames", "subject", "literalSubject", "duration", "renewBefore",
    "renewBeforePercentage", "privateKey", "usages", "isCA", "keystores", "revisionHistoryLimit",
    "additionalOutputFormats", "encodeUsagesInRequest", "nameConstraints"}
KEY_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc"}


def test_certificate_fields():
    cert = one(cpu_objects(), "Certificate")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert set(cert) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = cert["spec"]
    assert set(spec) <= CERTIFICATE_SPEC_FIELDS, set(spec) - CERTIFICATE_SPEC_FIELDS
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", spec["secretName"])
    assert set(spec.get("secretTemplate", {})) <= {"labels", "annotations"}
    ref = spec["issuerRef"]
    assert set(ref) <= {"name", "kind", "group"} and ref["name"], ref
    assert ref.get("kind", "Issuer") in ("Issuer", "ClusterIssuer"), ref
    assert ref.get("group", "cert-manager.io") == "cert-manager.io", ref
    assert set(spec["usages"]) <= KEY_USAGES, spec["usages"]
    assert "server auth" in spec["usages"]
    key = spec["privateKey"]
    assert set(key) <= {"algorithm", "size", "encoding", "rotationPolicy"}, key
    assert key["algorithm"] in ("RSA", "ECDSA", "Ed25519")
    assert key.get("encoding", "PKCS1") in ("PKCS1", "PKCS8")
    assert key.get("rotationPolicy") == "Always", "a renewal should bring a new key"
    # Renewed well before it ends, and not so often that it churns.
    assert seconds(spec["renewBefore"]) < seconds(spec["duration"])
    assert seconds(spec["renewBefore"]) >= 24 * 3600
    assert not spec.get("isCA", False)


# ---------------------------------------------------------------------------
# The wiring: each check takes the built objects and fails on a mistake
# ---------------------------------------------------------------------------

def _deployment_parts(objects):
    d = one(objects, "Deployment")
    return d, d["spec"]["template"]["spec"], server_container(d)


def _mounted_file(pod, container, path):
    """(volume, mount, key) of the Secret file at `path` in `container`."""
    directory, name = os.path.split(path)
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
    assert len(mounts) == 1, "%s: no volume mounted at %s" % (path, directory)
    mount = mounts[0]
    # A subPath mount never sees the Secret change: no rotation, no new keys.
    assert "subPath" not in mount and "subPathExpr" not in mount, mount
    assert mount.get("readOnly") is True, mount
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, "%s: volume %s is not a Secret" % (path, volume["name"])
    items = volume["secret"].get("items")
    if items:
        keys = [i["key"] for i in items if i["path"] == name]
        assert keys, "%s: the Secret volume %s does not project %s" % (path, volume["name"], name)
        name = keys[0]
    return volume, mount, name


def _readable_by_the_server_only(pod, volume):
    mode = volume["secret"].get("defaultMode", 0o644)
    assert mode & 0o007 == 0, "Secret %s is world-readable (mode %o)" % (volume["name"], mode)
    # The files are root's; the server reads them through the pod's fsGroup.
    assert mode & 0o040, "Secret %s is not group-readable (mode %o)" % (volume["name"], mode)
    sc = pod["securityContext"]
    assert sc.get("fsGroup") is not None, "no fsGroup: the server could not read mode %o" % mode
    assert sc["fsGroup"] == sc["runAsGroup"], sc


def check_tls_files_come_from_the_certificate(objects):
    _, pod, c = _deployment_parts(objects)
    cert = one(objects, "Certificate")
    assert flag(c, "tls_cert_file") and flag(c, "tls_key_file"), "TLS is off"
    wanted = {"tls_cert_file": "tls.crt", "tls_key_file": "tls.key",
              "tls_client_ca_file": "ca.crt"}
    for name, key in wanted.items():
        path = flag(c, name)
        if path is None:
            continue
        volume, _, got = _mounted_file(pod, c, path)
        assert volume["secret"]["secretName"] == cert["spec"]["secretName"], (
            "--%s reads Secret %s, the Certificate fills %s"
            % (name, volume["secret"]["secretName"], cert["spec"]["secretName"]))
        assert got == key, "--%s=%s: cert-manager writes %s" % (name, path, key)
        _readable_by_the_server_only(pod, volume)
    assert 1 <= seconds(flag(c, "tls_reload_interval") or "10s") <= 60


def check_api_keys_file_is_the_documented_secret(objects):
    _, pod, c = _deployment_parts(objects)
    path = flag(c, "api_keys_file")
    assert path, "no --api_keys_file: every caller would be anonymous"
    volume, _, key = _mounted_file(pod, c, path)
    secret = volume["secret"]["secretName"]
    assert secret != one(objects, "Certificate")["spec"]["secretName"]
    assert volume["secret"].get("optional") is not True, "a missing keys file stops the server"
    _readable_by_the_server_only(pod, volume)
    # deploy/README.md says how to create it, with the same name, key and namespace.
    namespace = one(objects, "Namespace")["metadata"]["name"]
    with open(README) as f:
        readme = f.read()
    command = re.search(r"kubectl create secret generic (\S+) -n (\S+) "
                        r"--from-file=([^=\s]+)=\S+", readme)
    assert command, "deploy/README.md does not show how to create the keys Secret"
    assert command.groups() == (secret, namespace, key), (command.groups(),
                                                         (secret, namespace, key))


def check_certificate_names_the_services(objects):
    cert = one(objects, "Certificate")
    namespace = one(objects, "Namespace")["metadata"]["name"]
    names = cert["spec"]["dnsNames"]
    assert len(names) == len(set(names)), names
    for svc in (o for o in objects if o["kind"] == "Service"):
        assert svc["metadata"]["namespace"] == namespace
        n = svc["metadata"]["name"]
        for want in (n, "%s.%s" % (n, namespace), "%s.%s.svc" % (n, namespace),
                     "%s.%s.svc.cluster.local" % (n, namespace)):
            assert want in names, "the certificate does not name %s" % want
    for name in names:
        labels = name.split(".")
        assert len(labels) == 1 or labels[1] == namespace, (
            "%s is not in the namespace %s" % (name, namespace))
    assert cert["metadata"]["namespace"] == namespace


def check_probes_use_the_health_port(objects):
    _, _, c = _deployment_parts(objects)
    ports = container_ports(c)
    assert flag(c, "port") == str(ports["grpc"])
    assert flag(c, "metrics_port") == str(ports["metrics"])
    assert flag(c, "health_port") == str(ports["health"]), (
        "--health_port=%s, container port health %s" % (flag(c, "health_port"), ports["health"]))
    assert len(set(ports.values())) == len(ports), ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The kubelet's gRPC probe speaks no TLS: with TLS on the gRPC port,
        # only the plaintext health port can answer it.
        assert c[probe]["grpc"]["port"] == ports["health"], (probe, c[probe])
        assert "service" not in c[probe]["grpc"], "the server's health status is for service ''"


def _admitted(policy, container):
    """{container port: [peers]} of the policy's ingress rules."""
    out = {}
    for rule in policy["spec"].get("ingress", []):
        assert rule.get("from"), "an ingress rule without `from` admits everyone: %s" % rule
        assert rule.get("ports"), "an ingress rule without `ports` admits every port: %s" % rule
        for p in rule["ports"]:
            assert p.get("protocol", "TCP") == "TCP" and "endPort" not in p, p
            out.setdefault(resolve_port(container, p["port"]), []).extend(rule["from"])
    return out


def _namespace_of(peer):
    sel = peer.get("namespaceSelector")
    assert sel is not None, "a peer without namespaceSelector means this namespace: %s" % peer
    assert set(sel) == {"matchLabels"}, sel
    assert set(sel["matchLabels"]) == {"kubernetes.io/metadata.name"}, sel
    return sel["matchLabels"]["kubernetes.io/metadata.name"]


def check_network_policy(objects):
    d, _, c = _deployment_parts(objects)
    policy = one(objects, "NetworkPolicy")
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]
    assert set(selector) == {"matchLabels"} and selector["matchLabels"], selector
    assert all(pod_labels.get(k) == v for k, v in selector["matchLabels"].items()), (
        "the NetworkPolicy does not select the Deployment's pods: %s" % selector)
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    # The server opens no connection: no egress at all.
    assert not policy["spec"].get("egress"), policy["spec"]["egress"]
    ports = container_ports(c)
    admitted = _admitted(policy, c)
    # Exactly gRPC and metrics; the health port is the kubelet's, from the node.
    assert set(admitted) == {ports["grpc"], ports["metrics"]}, (admitted, ports)
    # gRPC: whole namespaces of clients, each named.
    for peer in admitted[ports["grpc"]]:
        assert "ipBlock" not in peer, peer
        _namespace_of(peer)
    # Prometheus: its pods in the namespace of the Prometheus that
    # prometheus-adapter queries, on the port the ServiceMonitor scrapes.
    with open(ADAPTER_VALUES) as f:
        url = yaml.safe_load(f)["prometheus"]["url"]
    m = re.fullmatch(r"https?://[a-z0-9-]+\.([a-z0-9-]+)\.svc(\.cluster\.local)?", url)
    assert m, url
    for peer in admitted[ports["metrics"]]:
        assert _namespace_of(peer) == m.group(1), (peer, url)
        assert peer.get("podSelector", {}).get("matchLabels"), (
            "any pod of the monitoring namespace may scrape: %s" % peer)
    sm = one(objects, "ServiceMonitor")
    svc = one(objects, "Service", "coalesce")
    for ep in sm["spec"]["endpoints"]:
        sp = next(p for p in svc["spec"]["ports"] if p["name"] == ep["port"])
        assert resolve_port(c, sp["targetPort"]) == ports["metrics"], (ep, sp)
    # Both Services' gRPC ports lead to an admitted port.
    for s in (o for o in objects if o["kind"] == "Service"):
        for p in s["spec"]["ports"]:
            assert resolve_port(c, p["targetPort"]) in admitted, (s["metadata"]["name"], p)


def check_services_and_selectors(objects):
    d, _, c = _deployment_parts(objects)
    pod_labels = d["spec"]["template"]["metadata"]["labels"]

    def selects(selector):
        return all(pod_labels.get(k) == v for k, v in selector.items())
    assert selects(d["spec"]["selector"]["matchLabels"])
    assert selects(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    ports = container_ports(c)
    tls = flag(c, "tls_cert_file") is not None
    for svc in (o for o in objects if o["kind"] == "Service"):
        assert selects(svc["spec"]["selector"]), svc["metadata"]["name"]
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, p
            assert ports[p["targetPort"]] == p["port"], p
            assert p["targetPort"] != "health", "the health port is for the kubelet only"
            if p["targetPort"] == "grpc" and tls:
                assert p.get("appProtocol") != "kubernetes.io/h2c", (
                    "%s says cleartext HTTP/2 for a TLS port" % svc["metadata"]["name"])
    headless = one(objects, "Service", "coalesce-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    assert [p["port"] for p in headless["spec"]["ports"]] == [50051]
    regular = one(objects, "Service", "coalesce")
    assert sorted(p["port"] for p in regular["spec"]["ports"]) == [9090, 50051]
    assert regular["spec"].get("type", "ClusterIP") == "ClusterIP"


def check_pod_security(objects):
    """The namespace enforces Pod Security `restricted`; the pods must meet it
    or they are refused at creation."""
    ns = one(objects, "Namespace")
    labels = ns["metadata"]["labels"]
    assert labels.get("pod-security.kubernetes.io/enforce") == "restricted", labels
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == ns["metadata"]["name"], o["metadata"]
    _, pod, _ = _deployment_parts(objects)
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
               "persistentVolumeClaim", "projected", "secret"}
    for v in pod.get("volumes", []):
        assert set(v) - {"name"} <= allowed, v
    psc = pod["securityContext"]
    assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 1) != 0
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
        assert set(sc.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {}))
        assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), c["name"]
        assert not sc.get("privileged"), c["name"]


WIRING_CHECKS = {
    "tls": check_tls_files_come_from_the_certificate,
    "api_keys": check_api_keys_file_is_the_documented_secret,
    "dns_names": check_certificate_names_the_services,
    "probes": check_probes_use_the_health_port,
    "network_policy": check_network_policy,
    "services": check_services_and_selectors,
    "pod_security": check_pod_security,
}


@pytest.mark.parametrize("name", sorted(WIRING_CHECKS))
def test_wiring(name):
    WIRING_CHECKS[name](cpu_objects())


def _container(objects):
    return server_container(one(objects, "Deployment"))


def _pod(objects):
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def _set_flag(objects, name, value):
    args = _container(objects)["args"]
    i = next(i for i, a in enumerate(args) if a.startswith("--%s=" % name))
    args[i] = "--%s=%s" % (name, value)


def _volume(objects, name):
    return next(v for v in _pod(objects)["volumes"] if v["name"] == name)


def _policy_rule(objects, port):
    return next(r for r in one(objects, "NetworkPolicy")["spec"]["ingress"]
                if any(p["port"] == port for p in r["ports"]))


# (check that must fail, the mistake)
MISTAKES = {
    "cert file outside the mount": ("tls", lambda o: _set_flag(o, "tls_cert_file",
                                                               "/etc/coalesce/tls.crt")),
    "key file not cert-manager's": ("tls", lambda o: _set_flag(o, "tls_key_file",
                                                               "/etc/coalesce/tls/key.pem")),
    "TLS volume from another Secret": (
        "tls", lambda o: _volume(o, "tls")["secret"].update(secretName="other-tls")),
    "Certificate fills another Secret": (
        "tls", lambda o: one(o, "Certificate")["spec"].update(secretName="coalesce-cert")),
    "TLS mounted with subPath": (
        "tls", lambda o: _container(o)["volumeMounts"][0].update(subPath="tls.crt")),
    "TLS files world-readable": ("tls", lambda o: _volume(o, "tls")["secret"].update(
        defaultMode=0o444)),
    "TLS files readable by root only": ("tls", lambda o: _volume(o, "tls")["secret"].update(
        defaultMode=0o400)),
    "no fsGroup": ("tls", lambda o: _pod(o)["securityContext"].pop("fsGroup")),
    "client CA under another name": (
        "tls", lambda o: _container(o)["args"].append(
            "--tls_client_ca_file=/etc/coalesce/tls/ca.pem")),
    "keys file in another folder": ("api_keys", lambda o: _set_flag(o, "api_keys_file",
                                                                    "/etc/coalesce/keys.json")),
    "keys Secret renamed": ("api_keys", lambda o: _volume(o, "api-keys")["secret"].update(
        secretName="api-keys")),
    "keys Secret optional": ("api_keys", lambda o: _volume(o, "api-keys")["secret"].update(
        optional=True)),
    "headless Service not named": ("dns_names", lambda o: one(o, "Certificate")["spec"].update(
        dnsNames=[n for n in one(o, "Certificate")["spec"]["dnsNames"]
                  if not n.startswith("coalesce-headless")])),
    "Certificate in another namespace": (
        "dns_names", lambda o: one(o, "Certificate")["spec"]["dnsNames"].__setitem__(
            3, "coalesce.default.svc.cluster.local")),
    "probe on the TLS port": ("probes", lambda o: _container(o)["readinessProbe"]["grpc"].update(
        port=50051)),
    "--health_port not the probes' port": ("probes", lambda o: _set_flag(o, "health_port",
                                                                         "8082")),
    "policy selects other pods": ("network_policy", lambda o: one(o, "NetworkPolicy")["spec"][
        "podSelector"]["matchLabels"].update({"app.kubernetes.io/component": "worker"})),
    "policy admits another gRPC port": (
        "network_policy", lambda o: _policy_rule(o, 50051)["ports"][0].update(port=50052)),
    "policy admits anyone to gRPC": ("network_policy",
                                     lambda o: _policy_rule(o, 50051).pop("from")),
    "policy admits the health port": ("network_policy", lambda o: _policy_rule(
        o, 50051)["ports"].append({"port": 8081, "protocol": "TCP"})),
    "policy admits all of monitoring": ("network_policy", lambda o: _policy_rule(
        o, 9090)["from"][0].pop("podSelector")),
    "policy allows egress": ("network_policy", lambda o: one(o, "NetworkPolicy")["spec"].update(
        egress=[{"ports": [{"port": 53, "protocol": "UDP"}]}])),
    "metrics container port moved": ("network_policy", lambda o: _container(o)["ports"][1].update(
        containerPort=9091)),
    "TLS port says h2c": ("services", lambda o: one(o, "Service", "coalesce")["spec"]["ports"][
        0].update(appProtocol="kubernetes.io/h2c")),
    "privilege escalation": ("pod_security", lambda o: _container(o)["securityContext"].update(
        allowPrivilegeEscalation=True)),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_wiring_checks_catch_mistakes(mistake):
    check, mutate = MISTAKES[mistake]
    objects = cpu_objects()
    WIRING_CHECKS[check](objects)  # passes as built
    mutate(objects)
    with pytest.raises(AssertionError):
        WIRING_CHECKS[check](objects)


def test_certificate_names_follow_the_namespace():
    """Another `namespace:` in base/kustomization.yaml moves the Certificate's
    DNS names with it (the replacement covers every qualified name)."""
    kust = kustomization(BASE)
    kust["namespace"] = "llm-serving"
    objects = build(BASE, kust=kust)
    check_certificate_names_the_services(objects)
    assert "coalesce-headless.llm-serving.svc.cluster.local" in one(
        objects, "Certificate")["spec"]["dnsNames"]
    # As written, before kustomize, the names are the base namespace's.
    with open(os.path.join(BASE, "certificate.yaml")) as f:
        written = yaml.safe_load(f)
    assert one(cpu_objects(), "Certificate")["spec"]["dnsNames"] == written["spec"]["dnsNames"]


# ---------------------------------------------------------------------------
# The kustomizations
# ---------------------------------------------------------------------------

def check_lists_every_manifest(resources, files):
    listed = set(resources)
    present = {f for f in files if f.endswith((".yaml", ".yml"))} - NOT_RESOURCES
    assert listed == present, "base/kustomization.yaml resources %s, files %s" % (
        sorted(listed), sorted(present))
    assert len(resources) == len(listed), resources


def test_kustomizations_list_every_manifest():
    resources = kustomization(BASE)["resources"]
    files = os.listdir(BASE)
    check_lists_every_manifest(resources, files)
    # A manifest left out, or listed twice, fails.
    for bad in ([r for r in resources if r != "networkpolicy.yaml"], resources + resources[:1]):
        with pytest.raises(AssertionError):
            check_lists_every_manifest(bad, files)
    # deploy/k8s holds the overlays' folders and the adapter's Helm values.
    assert kustomization(K8S)["resources"] == ["base"]
    assert {f for f in os.listdir(K8S) if f.endswith((".yaml", ".yml"))} == NOT_RESOURCES
    gpu = kustomization(GPU)
    assert gpu["resources"] == ["../base"]
    assert {f for f in os.listdir(GPU) if f.endswith((".yaml", ".yml"))} == (
        {"kustomization.yaml"} | {p["path"] for p in gpu["patches"]})
    for objects in (cpu_objects(), gpu_objects()):
        for o in objects:
            assert {"apiVersion", "kind", "metadata"} <= set(o), o
        names = [(o["kind"], o["metadata"]["name"]) for o in objects]
        assert len(names) == len(set(names)), names
    # The image is set by the overlays, not the base.
    assert "images" not in kustomization(BASE)
    assert server_container(one(cpu_objects(), "Deployment"))["image"] == "coalesce:latest"


def test_overlays_would_build_with_kustomize():
    """kustomize refuses an overlay inside the folder of its base; `build`
    refuses it the same way (the GPU overlay once was deploy/k8s/gpu on the
    base deploy/k8s)."""
    kust = kustomization(GPU)
    kust["resources"] = ["../"]
    with pytest.raises(AssertionError, match="builds on it"):
        build(GPU, kust=kust)
    unknown = dict(kustomization(K8S), commonLabels={"a": "b"})
    with pytest.raises(AssertionError, match="fields this test does not build"):
        build(K8S, kust=unknown)


# ---------------------------------------------------------------------------
# Autoscaling chain
# ---------------------------------------------------------------------------

def test_hpa_and_prometheus_adapter_agree():
    objects = cpu_objects()
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

    with open(ADAPTER_VALUES) as f:
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
# Start-up and shutdown
# ---------------------------------------------------------------------------

def test_probes_and_shutdown():
    d = one(cpu_objects(), "Deployment")
    pod = d["spec"]["template"]["spec"]
    c = server_container(d)
    assert flag(c, "model"), "no --model"
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
    # The server talks to no Kubernetes API.
    assert pod.get("automountServiceAccountToken") is False
