"""The Prometheus rules and the Grafana dashboard against a real Prometheus
scraping a real coalesce-server under load.

* `promtool check rules` passes on deploy/prometheus/coalesce-rules.yml, and
  `promtool test rules` on its unit tests (coalesce-rules.test.yml), where
  every alert fires once.
* A coalesce-server (synthetic:tiny) runs as deploy/k8s runs it: TLS on the
  gRPC port, a plaintext health port, tenants from an --api_keys_file; with
  mutual TLS too, so that both ways of naming a tenant are used. It runs under
  steady load from coalesce-cli loops, whose client certificate names their
  tenant ("cli"), and a grpcio client sends short calls with `authorization:
  Bearer KEY` (the tenant "search", which the batch's fairness makes room for)
  and one with an unknown key. Debian's `prometheus` scrapes the plaintext
  metrics port every second with the rules loaded.
* Every recording rule, every dashboard panel query (template variables
  substituted), the dashboard's `instance` variable query and the
  prometheus-adapter query return data through the HTTP API, with at least one
  number (not only NaN); every alerting and recording rule is loaded with
  health "ok".
* Every coalesce_* metric family the server exports is used by the dashboard
  or a rule; the tenant panels show both tenants; the probes' health port
  answers in plaintext while the gRPC port refuses plaintext.

Needs `prometheus` and `promtool` (Debian package `prometheus`, installed by
tools/install-deps.sh), PyYAML (python3-yaml), grpcio and protobuf
(python3-grpcio, python3-protobuf), `protoc` and `openssl`. COALESCE_SERVER and
COALESCE_CLI name the binaries (default: build/bin/). Set
COALESCE_DEPLOY_REPORT=FILE to get every query and what it returned as JSON.
"""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest

try:
    import yaml
except ImportError:  # reported by each test that needs it
    yaml = None

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES = os.path.join(REPO, "deploy", "prometheus", "coalesce-rules.yml")
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "coalesce-dashboard.json")
sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
sys.path.insert(0, os.path.join(REPO, "tests", "service"))
from coalesce_harness import (HarnessError, ServerProcess, die_with_parent,  # noqa: E402
                              health_serving)
from e2e_protos import compile_descriptors, load_stubs  # noqa: E402

SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
CLI = os.environ.get("COALESCE_CLI") or os.path.join(REPO, "build", "bin", "coalesce-cli")

# What Grafana would put for its built-in interval variables. With a 1 s
# scrape interval Grafana's $__rate_interval would be 4 s; a longer window
# makes the test independent of scheduling hiccups on a loaded machine.
RATE_INTERVAL = "30s"
INTERVAL = "5s"

# With the harness's --host=127.0.0.1 --port=0 --metrics_port=0.
SERVER_FLAGS = [
    "--model=synthetic:tiny",
    # Fewer slots than concurrent requests, so that requests wait; a KV cache
    # that long requests fill most of (819 blocks of 16 tokens; 8 sequences of
    # up to 1,300 tokens take about 650), without preemptions.
    "--max_batch_size=8", "--kv_cache_memory=16MiB", "--threads=1",
]
LOAD_LOOPS = 2          # background threads, each running coalesce-cli in a loop
LOAD_CONCURRENCY = 6    # streams per coalesce-cli run
# Tenants (--api_keys_file): coalesce-cli is named by its client certificate,
# the grpcio client by its key.
CLI_SUBJECT = "CN=coalesce-cli"
API_KEY = "deploy-test-key-5e1f0c"
TENANTS = [{"name": "cli", "client_cert_subject": CLI_SUBJECT},
           {"name": "search", "key_sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}]
KEYED_INTERVAL = 0.25   # seconds between the keyed client's calls
MIN_SCRAPES = 10        # successful scrapes before the queries are checked
DATA_TIMEOUT = 40       # seconds for every query to return data after that



def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.fail("%s not found: install Debian's package `prometheus` (tools/install-deps.sh)"
                    % name)
    return path


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args, cwd):
    r = subprocess.run(["openssl"] + list(args), cwd=cwd, capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        pytest.fail("openssl %s failed:\n%s" % (" ".join(args), r.stderr))


def make_pki(d):
    """A CA, the server's certificate for 127.0.0.1 and coalesce-cli's client
    certificate (subject CLI_SUBJECT), as cert-manager's Secret names them
    for the server: ca.crt, tls.crt, tls.key; client.crt, client.key."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=deploy-test-ca",
             cwd=d)
    for name, subject, ext in (("tls", "/CN=coalesce", "subjectAltName=IP:127.0.0.1\n"
                                "extendedKeyUsage=serverAuth\n"),
                               ("client", "/" + CLI_SUBJECT, "extendedKeyUsage=clientAuth\n")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", name + ".key", "-out", name + ".csr", "-subj", subject, cwd=d)
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write(ext)
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", name + ".crt", "-days", "2", "-extfile",
                 name + ".ext", cwd=d)


def _kill(proc):
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------------------
# What the files hold
# ---------------------------------------------------------------------------

def _need_yaml():
    if yaml is None:
        pytest.fail("PyYAML not importable: install Debian's python3-yaml (tools/install-deps.sh)")


def load_rules():
    _need_yaml()
    with open(RULES) as f:
        doc = yaml.safe_load(f)
    recording, alerting = [], []
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recording.append((rule["record"], rule["expr"]))
            else:
                alerting.append((rule["alert"], rule["expr"]))
    return recording, alerting


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_panels(dashboard):
    """Every panel, rows' nested panels (collapsed rows) included."""
    out = []

    def walk(panels):
        for p in panels:
            out.append(p)
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    return out


def dashboard_targets(dashboard):
    """(panel title, refId, expr) of every query of every panel."""
    out = []
    for p in dashboard_panels(dashboard):
        for t in p.get("targets", []):
            if t.get("hide"):
                continue
            out.append((p["title"], t.get("refId", "?"), t["expr"]))
    return out


def substitute(expr, instance):
    """Replaces the dashboard's variables as Grafana would for one selected
    instance (a regex match of one literal value) and its interval variables."""
    out = expr
    for name, value in (("instance", instance), ("__rate_interval", RATE_INTERVAL),
                        ("__interval", INTERVAL), ("__range", "1m")):
        out = out.replace("${%s}" % name, value).replace("$" + name, value)
    assert "$" not in out, "unknown variable left in %r" % out
    return out


# ---------------------------------------------------------------------------
# Static checks (no server needed)
# ---------------------------------------------------------------------------

def test_promtool_check_rules():
    r = subprocess.run([_tool("promtool"), "check", "rules", RULES],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "promtool check rules failed:\n%s%s" % (r.stdout, r.stderr)
    recording, alerting = load_rules()
    assert "SUCCESS: %d rules found" % (len(recording) + len(alerting)) in r.stdout, r.stdout


def test_promtool_rule_unit_tests():
    """deploy/prometheus/coalesce-rules.test.yml: each alert fires on the series
    that should make it fire, after its `for`, and not at a healthy load."""
    tests = os.path.join(os.path.dirname(RULES), "coalesce-rules.test.yml")
    r = subprocess.run([_tool("promtool"), "test", "rules", tests],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, "promtool test rules failed:\n%s%s" % (r.stdout, r.stderr)
    # Every alert has a test in which it fires.
    with open(tests) as f:
        cases = yaml.safe_load(f)["tests"] if yaml else []
    fired = {t["alertname"] for case in cases for t in case.get("alert_rule_test", [])
             if t.get("exp_alerts")}
    _, alerting = load_rules()
    assert {name for name, _ in alerting} <= fired, "alerts never shown firing: %s" % sorted(
        {name for name, _ in alerting} - fired)


def test_dashboard_structure():
    d = load_dashboard()
    assert 36 <= d["schemaVersion"] <= 40
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    inst = variables["instance"]
    assert inst["type"] == "query"
    assert inst["definition"] == "label_values(coalesce_build_info, instance)"
    assert inst["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in dashboard_panels(d)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dashboard_panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p.get("targets"), "panel %r has no query" % p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            # Every panel that shows one replica's series among others filters by
            # $instance; fleet-wide recorded series (by job only) are the exception.
            if "coalesce:requests_waiting:avg" != t["expr"].strip():
                assert "$instance" in t["expr"], (p["title"], t["expr"])


# ---------------------------------------------------------------------------
# The stack: server, load, Prometheus
# ---------------------------------------------------------------------------

class Stack:
    def __init__(self, tmp):
        self.tmp = tmp
        self.server = self.prom = None
        self.stop = threading.Event()
        self.load_threads = []
        self.load_procs = set()
        self.load_lock = threading.Lock()
        self.load_runs = 0
        self.load_failures = []
        self.keyed_ok = 0
        self.keyed_failures = []
        self.wrong_key_code = None

    # -- server ---------------------------------------------------------------
    def start_server(self):
        if not os.path.exists(SERVER):
            pytest.fail("server binary not found: %s (set COALESCE_SERVER)" % SERVER)
        self.pki = os.path.join(self.tmp, "pki")
        os.mkdir(self.pki)
        make_pki(self.pki)
        keys = os.path.join(self.tmp, "keys.json")
        with open(keys, "w") as f:
            json.dump({"tenants": TENANTS}, f)
        # As deploy/k8s/base/deployment.yaml, with mutual TLS for coalesce-cli.
        flags = SERVER_FLAGS + [
            "--tls_cert_file=%s/tls.crt" % self.pki, "--tls_key_file=%s/tls.key" % self.pki,
            "--tls_client_ca_file=%s/ca.crt" % self.pki, "--api_keys_file=" + keys,
            "--health_port=0"]
        error = None
        try:
            self.server = ServerProcess(SERVER, flags, start_timeout_s=60)
        except HarnessError as e:
            error = str(e)
        if error:
            pytest.fail(error)  # outside the except: no chained traceback
        self.grpc_address = self.server.address
        self.instance = "127.0.0.1:%d" % self.server.metrics_port

    # -- load -----------------------------------------------------------------
    def _cli(self, *flags, timeout=120):
        argv = [CLI, "--server=" + self.grpc_address, "--tls_ca_file=%s/ca.crt" % self.pki,
                "--tls_cert_file=%s/client.crt" % self.pki,
                "--tls_key_file=%s/client.key" % self.pki] + list(flags)
        # Named by its certificate: no API key from the environment.
        env = {k: v for k, v in os.environ.items() if k != "COALESCE_API_KEY"}
        proc = subprocess.Popen(die_with_parent(argv),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env)
        with self.load_lock:
            self.load_procs.add(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        with self.load_lock:
            self.load_procs.discard(proc)
        return proc.returncode, out.decode("utf-8", "replace")

    def _load_loop(self, i):
        while not self.stop.is_set():
            # Sampled (greedy output of the random synthetic model reaches
            # EOS within a few tokens): a few hundred tokens per request.
            rc, out = self._cli("--concurrency=%d" % LOAD_CONCURRENCY, "--temperature=1",
                                "--max_new_tokens=%d" % (1000 + 200 * i), "--summary")
            with self.load_lock:
                self.load_runs += 1
                if rc != 0 and not self.stop.is_set():
                    self.load_failures.append(out[-2000:])

    def _keyed_loop(self, channel, generate, request):
        """Short calls of the tenant "search" (its key; the client certificate
        mutual TLS needs would name "cli"), after one with an unknown key."""
        try:
            list(generate(request, timeout=30, metadata=[("authorization", "Bearer nope")]))
        except grpc.RpcError as e:
            self.wrong_key_code = e.code()
        while not self.stop.is_set():
            try:
                list(generate(request, timeout=30,
                              metadata=[("authorization", "Bearer " + API_KEY)]))
                with self.load_lock:
                    self.keyed_ok += 1
            except grpc.RpcError as e:
                if not self.stop.is_set():
                    with self.load_lock:
                        self.keyed_failures.append("%s: %s" % (e.code(), e.details()))
            self.stop.wait(KEYED_INTERVAL)
        channel.close()

    def start_load(self):
        if not os.path.exists(CLI):
            pytest.fail("client binary not found: %s (set COALESCE_CLI)" % CLI)
        for i in range(LOAD_LOOPS):
            t = threading.Thread(target=self._load_loop, args=(i,), daemon=True)
            t.start()
            self.load_threads.append(t)
        desc = os.path.join(self.tmp, "coalesce.desc")
        compile_descriptors(desc)
        g = load_stubs(desc).g

        def read(name):
            with open(os.path.join(self.pki, name), "rb") as f:
                return f.read()
        channel = grpc.secure_channel(self.grpc_address, grpc.ssl_channel_credentials(
            root_certificates=read("ca.crt"), private_key=read("client.key"),
            certificate_chain=read("client.crt")))
        generate = channel.unary_stream(
            "/coalesce.v1.Generator/Generate",
            request_serializer=g.GenerateRequest.SerializeToString,
            response_deserializer=g.GenerateResponse.FromString)
        request = g.GenerateRequest(prompt="Once upon a time", max_new_tokens=32)
        request.sampling.temperature = 1
        t = threading.Thread(target=self._keyed_loop, args=(channel, generate, request),
                             daemon=True)
        t.start()
        self.load_threads.append(t)

    # -- Prometheus ------------------------------------------------------------
    def start_prometheus(self):
        prometheus = _tool("prometheus")
        self.prom_port = _free_port()
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            yaml.safe_dump({
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                           "evaluation_interval": "1s"},
                "rule_files": [RULES],
                "scrape_configs": [{"job_name": "coalesce",
                                    "static_configs": [{"targets": [self.instance]}]}],
            }, f)
        self.prom_log = open(os.path.join(self.tmp, "prometheus.log"), "wb")
        self.prom = subprocess.Popen(
            die_with_parent([prometheus, "--config.file=" + config,
             "--storage.tsdb.path=" + os.path.join(self.tmp, "data"),
             "--web.listen-address=127.0.0.1:%d" % self.prom_port, "--log.level=warn"]),
            stdin=subprocess.DEVNULL, stdout=self.prom_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.prom.poll() is not None:
                pytest.fail("prometheus exited (rc %s):\n%s" % (self.prom.returncode,
                                                                self.prometheus_log()))
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % self.prom_port,
                                            timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus not ready within 30 s:\n%s" % self.prometheus_log())
            time.sleep(0.2)

    def prometheus_log(self):
        try:
            with open(os.path.join(self.tmp, "prometheus.log"), "rb") as f:
                return f.read().decode("utf-8", "replace")[-5000:]
        except OSError:
            return ""

    def api(self, path, **params):
        url = "http://127.0.0.1:%d/api/v1/%s" % (self.prom_port, path)
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            body = json.loads(e.read().decode("utf-8"))
        return body

    def query(self, expr):
        """The instant vector of `expr`, or raises with Prometheus's error."""
        body = self.api("query", query=expr)
        if body.get("status") != "success":
            raise AssertionError("query %r failed: %s: %s"
                                 % (expr, body.get("errorType"), body.get("error")))
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    # -- teardown ----------------------------------------------------------------
    def close(self):
        self.stop.set()
        with self.load_lock:
            procs = list(self.load_procs)
        for p in procs:
            _kill(p)
        for t in self.load_threads:
            t.join(30)
        _kill(self.prom)
        if getattr(self, "prom_log", None):
            self.prom_log.close()
        if self.server is not None:
            self.server.kill()


@pytest.fixture(scope="module")
def stack():
    _need_yaml()
    tmp = tempfile.mkdtemp(prefix="coalesce-deploy-prom-")
    s = Stack(tmp)
    try:
        s.start_server()
        s.start_load()
        s.start_prometheus()
        # The target is up and has been scraped MIN_SCRAPES times.
        deadline = time.monotonic() + 60
        refused = False
        while True:
            r = s.query('count_over_time(up{job="coalesce", instance="%s"}[1m])' % s.instance)
            up = s.query('up{job="coalesce", instance="%s"}' % s.instance)
            if up and up[0]["value"][1] == "1" and not refused:
                # Once scraped: one request refused (prompt + max_new_tokens
                # beyond the 2048-token context), so that a rejection counter
                # visibly moves.
                s._cli("--max_new_tokens=4096", timeout=30)
                refused = True
            if (r and float(r[0]["value"][1]) >= MIN_SCRAPES and up
                    and up[0]["value"][1] == "1"):
                break
            if time.monotonic() > deadline:
                pytest.fail("target not up with %d scrapes within 60 s: %s\ntargets: %s\n"
                            "prometheus log:\n%s" % (MIN_SCRAPES, r, s.api("targets"),
                                                     s.prometheus_log()))
            time.sleep(0.5)
        yield s
    finally:
        s.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _has_number(result):
    return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in result)


def _wait_all_nonempty(stack, named_exprs):
    """Polls until every expression returns a non-empty result with at least one
    number (not only NaN, as a quantile of an unused histogram gives) or
    DATA_TIMEOUT passes; returns {name: result} (the last result of each)."""
    results = {}
    pending = dict(named_exprs)
    deadline = time.monotonic() + DATA_TIMEOUT
    while True:
        for name, expr in list(pending.items()):
            res = stack.query(expr)
            results[name] = res
            if res and _has_number(res):
                del pending[name]
        if not pending or time.monotonic() > deadline:
            return results
        time.sleep(1)


def _report(section, entries):
    path = os.environ.get("COALESCE_DEPLOY_REPORT")
    if not path:
        return
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {}
    report[section] = entries
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _summarize(result):
    return [{"labels": r["metric"], "value": r["value"][1]} for r in result[:12]]


def test_load_ran(stack):
    # The checks below mean something only if requests were served.
    r = stack.query('sum(coalesce_requests_total{status="ok", instance="%s"})' % stack.instance)
    assert r and float(r[0]["value"][1]) > 0, "no request finished OK; server log:\n%s" % "".join(
        stack.server.log_lines()[-50:])
    assert not stack.load_failures, "coalesce-cli failed:\n%s" % stack.load_failures[0]
    assert not stack.keyed_failures, "calls with the API key failed: %s" % stack.keyed_failures
    assert stack.keyed_ok > 0, "no call with the API key finished"
    assert stack.wrong_key_code == grpc.StatusCode.UNAUTHENTICATED, stack.wrong_key_code


def test_every_recording_rule_returns_data(stack):
    recording, _ = load_rules()
    names = [name for name, _ in recording]
    assert len(names) == len(set(names)), "a recording rule name repeats"
    # The rule's own expression, and the series it records.
    exprs = {}
    for name, expr in recording:
        exprs["expr " + name] = expr
        exprs["series " + name] = name
    results = _wait_all_nonempty(stack, exprs)
    _report("recording_rules", {k: {"expr": exprs[k], "result": _summarize(v)}
                                for k, v in results.items()})
    empty = [k for k, v in results.items() if not v]
    assert not empty, "recording rules without data:\n  %s\nprometheus log:\n%s" % (
        "\n  ".join("%s: %s" % (k, exprs[k]) for k in empty), stack.prometheus_log())
    nan = [k for k, v in results.items() if not _has_number(v)]
    assert not nan, "recording rules giving only NaN:\n  %s" % (
        "\n  ".join("%s: %s" % (k, exprs[k]) for k in nan))


def test_every_dashboard_query_returns_data(stack):
    d = load_dashboard()
    exprs = {}
    for title, ref, expr in dashboard_targets(d):
        exprs["%s [%s]" % (title, ref)] = substitute(expr, stack.instance)
    assert len(exprs) >= 30
    results = _wait_all_nonempty(stack, exprs)
    _report("dashboard", {k: {"expr": exprs[k], "result": _summarize(v)}
                          for k, v in results.items()})
    empty = [k for k, v in results.items() if not v]
    assert not empty, "dashboard queries without data:\n  %s" % (
        "\n  ".join("%s: %s" % (k, exprs[k]) for k in empty))
    nan = [k for k, v in results.items() if not _has_number(v)]
    assert not nan, "dashboard queries giving only NaN:\n  %s" % (
        "\n  ".join("%s: %s" % (k, exprs[k]) for k in nan))


def test_dashboard_instance_variable(stack):
    d = load_dashboard()
    var = next(v for v in d["templating"]["list"] if v["name"] == "instance")
    m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"])
    assert m, var["definition"]
    body = stack.api("label/%s/values" % m.group(2), **{"match[]": m.group(1)})
    assert body["status"] == "success", body
    assert stack.instance in body["data"], body


def test_every_rule_is_loaded_and_healthy(stack):
    recording, alerting = load_rules()
    want = {("recording", n) for n, _ in recording} | {("alerting", n) for n, _ in alerting}
    deadline = time.monotonic() + DATA_TIMEOUT
    while True:
        body = stack.api("rules")
        assert body["status"] == "success", body
        have = {}
        for group in body["data"]["groups"]:
            for rule in group["rules"]:
                kind = "recording" if rule["type"] == "recording" else "alerting"
                have[(kind, rule["name"])] = rule
        missing = sorted(want - set(have))
        unhealthy = sorted((k, r.get("health"), r.get("lastError", ""))
                           for k, r in have.items() if r.get("health") != "ok")
        if (not missing and not unhealthy) or time.monotonic() > deadline:
            break
        time.sleep(1)
    _report("alerts", {n: {"health": have[("alerting", n)].get("health"),
                           "state": have[("alerting", n)].get("state")}
                       for _, n in sorted(k for k in have if k[0] == "alerting")})
    assert not missing, "rules not loaded: %s" % missing
    assert not unhealthy, "rules not healthy: %s" % unhealthy
    assert len(alerting) >= 6


def test_tenant_panels_show_every_tenant(stack):
    """The panels on the tenants' requests, tokens and times to first token
    return a series for each tenant: the one named by its client certificate
    and the one named by its key. (Fairness preemptions only ever hit the
    tenant that fills the batch, "cli": its panel is checked for data by
    test_every_dashboard_query_returns_data.)"""
    d = load_dashboard()
    exprs = {"%s [%s]" % (title, ref): substitute(expr, stack.instance)
             for title, ref, expr in dashboard_targets(d)
             if re.search(r"\bcoalesce_tenant_(requests_total|tokens_total"
                          r"|time_to_first_token_seconds_bucket)\b", expr)}
    assert len(exprs) >= 4, "no dashboard panels on the tenants' requests, tokens and latency"
    want = {t["name"] for t in TENANTS}
    deadline = time.monotonic() + DATA_TIMEOUT
    while True:
        seen = {name: {r["metric"].get("tenant") for r in stack.query(expr)
                       if r["value"][1] not in ("NaN", "0")}
                for name, expr in exprs.items()}
        missing = {name: sorted(want - got) for name, got in seen.items() if want - got}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, "tenant panels without a tenant: %s\n%s" % (
        missing, "\n".join("%s: %s" % (k, exprs[k]) for k in missing))
    # The refusal of the unknown key is counted.
    r = stack.query('sum(coalesce_requests_rejected_total{reason="unauthenticated", '
                    'instance="%s"})' % stack.instance)
    assert r and float(r[0]["value"][1]) >= 1, r


def test_health_port_answers_probes_in_plaintext(stack):
    """What the Deployment's probes rely on: with TLS on the gRPC port, the
    --health_port answers grpc.health.v1 in plaintext, and the gRPC port does
    not."""
    m = re.search(r"health service in plaintext on [0-9.]+:(\d+)", stack.server.log())
    assert m, stack.server.log()
    assert health_serving("127.0.0.1:" + m.group(1))
    assert not health_serving(stack.grpc_address)


def test_every_server_metric_is_used(stack):
    """A metric the server exports but neither the dashboard nor a rule uses
    is probably missing from both."""
    text = stack.server.metrics_text()
    # The exposer_* families are prometheus-cpp's own.
    families = set(re.findall(r"^# TYPE (coalesce_\S+) ", text, re.M))
    assert "coalesce_requests_total" in families, families
    recording, alerting = load_rules()
    used = " ".join([e for _, e in recording] + [e for _, e in alerting] +
                    [e for _, _, e in dashboard_targets(load_dashboard())])
    unused = sorted(f for f in families if not re.search(r"\b%s(_bucket|_sum|_count)?\b" % f,
                                                          used))
    assert not unused, ("metrics exported by the server but used by no dashboard panel and no "
                        "rule in deploy/: %s" % unused)


def test_prometheus_adapter_query_returns_data(stack):
    """The metricsQuery of deploy/k8s/prometheus-adapter-values.yaml, as the
    adapter expands it for one pod (here: one instance; under Kubernetes the
    matchers are namespace and pod)."""
    _need_yaml()
    with open(os.path.join(REPO, "deploy", "k8s", "prometheus-adapter-values.yaml")) as f:
        values = yaml.safe_load(f)
    rules = values["rules"]["custom"]
    assert rules
    for rule in rules:
        series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        expr = (rule["metricsQuery"].replace("<<.Series>>", series)
                .replace("<<.LabelMatchers>>", 'instance="%s"' % stack.instance)
                .replace("<<.GroupBy>>", "instance"))
        result = _wait_all_nonempty(stack, {rule["name"]["as"]: expr})[rule["name"]["as"]]
        assert result, "prometheus-adapter query without data: %s" % expr
        assert result[0]["metric"] == {"instance": stack.instance}, result
