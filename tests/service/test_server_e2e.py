"""Black-box end-to-end tests of coalesce-server.

Starts the real binary on the real stories260K model and talks to it over
gRPC and its Prometheus endpoint only. Run with Debian's interpreter, which
has python3-grpcio, python3-protobuf and python3-pytest:

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_server_e2e.py

Environment:
    COALESCE_SERVER      the server binary (default <repo>/build/bin/coalesce-server)
    COALESCE_MODELS_DIR  the folder holding stories260K/ (default <repo>/../shared/models)

Python stubs are generated at test time into a temporary folder. Only the
message classes (*_pb2) are generated; calls go through grpc's generic
multi-callables, so no grpc python plugin is needed. Debian bookworm's
python3-grpc-tools (1.14.1) bundles a protoc too old for proto3 `optional`,
so when `python3 -m grpc_tools.protoc` fails the system `protoc` is used.
"""

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
MODELS = os.environ.get("COALESCE_MODELS_DIR") or os.path.join(REPO, "..", "shared", "models")
MODEL_BIN = os.path.join(MODELS, "stories260K", "stories260K.bin")
TOKENIZER_BIN = os.path.join(MODELS, "stories260K", "tok512.bin")
GOLDEN_JSON = os.path.join(MODELS, "stories260K", "golden.json")

VOCAB = 512
CONTEXT = 512
RPC_TIMEOUT = 60  # seconds; no call in this file should come near it

# ---------------------------------------------------------------------------
# Stubs
# ---------------------------------------------------------------------------

HEALTH_PROTO = """
syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health { rpc Check(HealthCheckRequest) returns (HealthCheckResponse); }
"""

# The subset of grpc/reflection/v1alpha/reflection.proto that list_services
# needs (field numbers as upstream; unknown fields are skipped on parse).
REFLECTION_PROTO = """
syntax = "proto3";
package grpc.reflection.v1alpha;
message ServerReflectionRequest {
  string host = 1;
  oneof message_request {
    string file_by_filename = 3;
    string file_containing_symbol = 4;
    string list_services = 7;
  }
}
message ServiceResponse { string name = 1; }
message ListServiceResponse { repeated ServiceResponse service = 1; }
message ErrorResponse { int32 error_code = 1; string error_message = 2; }
message ServerReflectionResponse {
  string valid_host = 1;
  ServerReflectionRequest original_request = 2;
  oneof message_response {
    ListServiceResponse list_services_response = 6;
    ErrorResponse error_response = 7;
  }
}
service ServerReflection {
  rpc ServerReflectionInfo(stream ServerReflectionRequest)
      returns (stream ServerReflectionResponse);
}
"""


def _protoc(include_dir, out_dir, proto):
    """Compiles `proto` (relative to include_dir) to *_pb2.py in out_dir."""
    attempts = [[sys.executable, "-m", "grpc_tools.protoc"]]
    if shutil.which("protoc"):
        attempts.append([shutil.which("protoc")])
    errors = []
    for cmd in attempts:
        r = subprocess.run(cmd + ["-I", include_dir, "--python_out=" + out_dir, proto],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return
        errors.append("%s: %s" % (" ".join(cmd), r.stderr.strip()))
    raise RuntimeError("cannot compile %s:\n%s" % (proto, "\n".join(errors)))


class Stubs:
    pass


@pytest.fixture(scope="session")
def pb():
    d = tempfile.mkdtemp(prefix="coalesce-e2e-stubs-")
    extra = os.path.join(d, "extra")
    for rel, text in (("grpc/health/v1/health.proto", HEALTH_PROTO),
                      ("grpc/reflection/v1alpha/reflection.proto", REFLECTION_PROTO)):
        path = os.path.join(extra, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    out = os.path.join(d, "out")
    os.makedirs(out)
    _protoc(os.path.join(REPO, "proto"), out, "coalesce/v1/generator.proto")
    _protoc(extra, out, "grpc/health/v1/health.proto")
    _protoc(extra, out, "grpc/reflection/v1alpha/reflection.proto")
    sys.path.insert(0, out)
    from coalesce.v1 import generator_pb2
    # `grpc` is the installed grpc package, so the generated grpc.health and
    # grpc.reflection modules are loaded from their files, under other names.
    import importlib.util

    def load(name, rel):
        spec = importlib.util.spec_from_file_location(name, os.path.join(out, rel))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    health_pb2 = load("e2e_health_pb2", "grpc/health/v1/health_pb2.py")
    reflection_pb2 = load("e2e_reflection_pb2", "grpc/reflection/v1alpha/reflection_pb2.py")
    s = Stubs()
    s.g = generator_pb2
    s.health = health_pb2
    s.reflection = reflection_pb2
    yield s
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def golden():
    with open(GOLDEN_JSON) as f:
        data = json.load(f)
    cases = data["cases"]
    assert len(cases) >= 2
    return cases


# ---------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------

def _die_with_parent():
    """In the child: SIGKILL it if pytest dies (e.g. killed by a ctest timeout)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_SERVING_RE = re.compile(r"serving (\S+) on ([0-9.]+):(\d+) \(metrics port (-?\d+)\)")
_RUNNING_SERVERS = []


class Server:
    def __init__(self, extra_flags=()):
        if not os.path.exists(SERVER):
            pytest.fail("server binary not found: %s (set COALESCE_SERVER)" % SERVER)
        for f in (MODEL_BIN, TOKENIZER_BIN):
            if not os.path.exists(f):
                pytest.fail("model file not found: %s (set COALESCE_MODELS_DIR)" % f)
        self.cmd = [SERVER, "--model=" + MODEL_BIN, "--tokenizer=" + TOKENIZER_BIN,
                    "--port=0", "--metrics_port=0", "--host=127.0.0.1"] + list(extra_flags)
        self._log = []
        self._lock = threading.Lock()
        self._serving = threading.Event()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.port = self.metrics_port = None
        if not self._serving.wait(60):
            self.kill()
            pytest.fail("server did not log 'serving ' within 60 s; cmd %s\nlog:\n%s"
                        % (" ".join(self.cmd), self.log()))
        if self.port is None:
            self.kill()
            pytest.fail("server exited before serving (rc %s); log:\n%s"
                        % (self.proc.returncode, self.log()))
        self.address = "127.0.0.1:%d" % self.port
        _RUNNING_SERVERS.append(self)

    def _drain(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            with self._lock:
                self._log.append(line)
            if self.port is None:
                m = _SERVING_RE.search(line)
                if m:
                    self.port = int(m.group(3))
                    self.metrics_port = int(m.group(4))
                    self._serving.set()
        self.proc.wait()
        self._serving.set()

    def log(self, start=0):
        with self._lock:
            return "".join(self._log[start:])

    def log_len(self):
        with self._lock:
            return len(self._log)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(5)
        if self in _RUNNING_SERVERS:
            _RUNNING_SERVERS.remove(self)


@pytest.fixture(autouse=True)
def _server_log_on_failure():
    """Prints each running server's log lines from this test. pytest shows the
    captured output only for tests that fail."""
    marks = {id(s): s.log_len() for s in _RUNNING_SERVERS}
    yield
    for s in list(_RUNNING_SERVERS):
        start = marks.get(id(s), 0)
        sys.stderr.write("---- server log (%s), from this test ----\n%s"
                         % (" ".join(s.cmd[4:]), s.log(start)))


def _start(extra_flags):
    server = Server(extra_flags)
    try:
        client = Client(server)
    except Exception:
        server.kill()
        raise
    return server, client


# ---------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------

class Result:
    def __init__(self):
        self.msgs = []       # GenerateResponse, in order
        self.times = []      # arrival time of each, seconds since the call started
        self.ids = []
        self.text = ""
        self.finish = None
        self.usage = None
        self.code = None     # grpc.StatusCode of a failed call, else None
        self.details = None

    def __repr__(self):
        return ("Result(code=%s, details=%r, finish=%s, n_ids=%d, ids=%s, text=%r, usage=%s)"
                % (self.code, self.details, self.finish, len(self.ids), self.ids, self.text,
                   None if self.usage is None else
                   (self.usage.prompt_tokens, self.usage.completion_tokens)))


class Client:
    def __init__(self, server):
        self.server = server
        self.channel = grpc.insecure_channel(server.address)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.pb = None

    def bind(self, pb):
        self.pb = pb
        g = pb.g
        m = "/coalesce.v1.Generator/"
        self._generate = self.channel.unary_stream(
            m + "Generate", request_serializer=g.GenerateRequest.SerializeToString,
            response_deserializer=g.GenerateResponse.FromString)
        self._generate_raw = self.channel.unary_stream(
            m + "Generate", request_serializer=g.GenerateRequest.SerializeToString,
            response_deserializer=lambda b: b)
        self._info = self.channel.unary_unary(
            m + "GetModelInfo", request_serializer=g.GetModelInfoRequest.SerializeToString,
            response_deserializer=g.ModelInfo.FromString)
        self._tokenize = self.channel.unary_unary(
            m + "Tokenize", request_serializer=g.TokenizeRequest.SerializeToString,
            response_deserializer=g.TokenizeResponse.FromString)
        self._detokenize = self.channel.unary_unary(
            m + "Detokenize", request_serializer=g.DetokenizeRequest.SerializeToString,
            response_deserializer=g.DetokenizeResponse.FromString)
        self._health = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=pb.health.HealthCheckRequest.SerializeToString,
            response_deserializer=pb.health.HealthCheckResponse.FromString)
        self._reflect = self.channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=pb.reflection.ServerReflectionRequest.SerializeToString,
            response_deserializer=pb.reflection.ServerReflectionResponse.FromString)
        return self

    def close(self):
        self.channel.close()

    # -- requests ----------------------------------------------------------
    def request(self, prompt=None, ids=None, max_new_tokens=16, temperature=None,
                top_k=None, top_p=None, seed=None, stop=(), request_id=""):
        g = self.pb.g
        r = g.GenerateRequest(max_new_tokens=max_new_tokens, request_id=request_id)
        if prompt is not None:
            r.prompt = prompt
        if ids is not None:
            r.prompt_token_ids.extend(ids)
        if temperature is not None:
            r.sampling.temperature = temperature
        if top_k is not None:
            r.sampling.top_k = top_k
        if top_p is not None:
            r.sampling.top_p = top_p
        if seed is not None:
            r.sampling.seed = seed
        r.stop.extend(stop)
        return r

    def generate(self, req, timeout=RPC_TIMEOUT):
        """Runs one Generate call to its end; a failed call is recorded, not raised."""
        res = Result()
        t0 = time.monotonic()
        call = self._generate(req, timeout=timeout)
        try:
            for msg in call:
                res.times.append(time.monotonic() - t0)
                res.msgs.append(msg)
                res.ids.extend(msg.token_ids)
                res.text += msg.text
        except grpc.RpcError as e:
            res.code = e.code()
            res.details = e.details()
            return res
        if res.msgs:
            res.finish = res.msgs[-1].finish_reason
            res.usage = res.msgs[-1].usage
        return res

    def generate_call(self, req, timeout=RPC_TIMEOUT):
        return self._generate(req, timeout=timeout)

    def generate_raw(self, req, timeout=RPC_TIMEOUT):
        return list(self._generate_raw(req, timeout=timeout))

    def info(self):
        return self._info(self.pb.g.GetModelInfoRequest(), timeout=RPC_TIMEOUT)

    def tokenize(self, text, add_special_tokens):
        return list(self._tokenize(self.pb.g.TokenizeRequest(
            text=text, add_special_tokens=add_special_tokens), timeout=RPC_TIMEOUT).token_ids)

    def detokenize(self, ids):
        return self._detokenize(self.pb.g.DetokenizeRequest(token_ids=ids),
                                timeout=RPC_TIMEOUT).text

    def health(self, service="", timeout=RPC_TIMEOUT):
        return self._health(self.pb.health.HealthCheckRequest(service=service),
                            timeout=timeout).status

    def list_services(self):
        req = self.pb.reflection.ServerReflectionRequest(list_services="*")
        responses = list(self._reflect(iter([req]), timeout=RPC_TIMEOUT))
        assert len(responses) == 1, responses
        r = responses[0]
        assert r.WhichOneof("message_response") == "list_services_response", r
        return [s.name for s in r.list_services_response.service]

    # -- metrics -----------------------------------------------------------
    def metrics(self):
        url = "http://127.0.0.1:%d/metrics" % self.server.metrics_port
        with urllib.request.urlopen(url, timeout=10) as f:
            return parse_metrics(f.read().decode("utf-8"))


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Metrics(dict):
    """(name, ((label, value), ...)) -> float."""

    def get(self, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        if key not in self:
            raise AssertionError("metric %s%s missing; have: %s" % (
                name, labels, sorted(k for k in self if k[0].startswith(name[:12]))))
        return self[key]

    def bucket(self, name, le):
        return self.get(name + "_bucket", le=le)


def parse_metrics(text):
    out = Metrics()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_RE.match(line)
        assert m, "unparsable metrics line: %r" % line
        labels = tuple(sorted(_LABEL_RE.findall(m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def wait_for(predicate, timeout, interval=0.05):
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            return value
        time.sleep(interval)


def run_concurrently(fns):
    """Runs the callables at once (released together by a barrier); returns
    their results in order."""
    barrier = threading.Barrier(len(fns))

    def wrap(fn):
        barrier.wait(10)
        return fn()

    with concurrent.futures.ThreadPoolExecutor(len(fns)) as ex:
        futures = [ex.submit(wrap, fn) for fn in fns]
        return [f.result(timeout=120) for f in futures]


# ---------------------------------------------------------------------------
# Servers (one per flag set)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(pb):
    """The default server (5 ms window, 16 slots), with a 64 KiB message limit."""
    server, client = _start(["--max_request_bytes=65536"])
    client.bind(pb)
    yield client
    client.close()
    server.kill()


@pytest.fixture(scope="module")
def batch_srv(pb):
    server, client = _start(["--batch_window=200ms", "--max_batch_size=8"])
    client.bind(pb)
    yield client
    client.close()
    server.kill()


@pytest.fixture(scope="module")
def static_srv(pb):
    server, client = _start(["--batching=static", "--batch_window=50ms"])
    client.bind(pb)
    yield client
    client.close()
    server.kill()


def assert_golden(res, case, label=""):
    g_ids = case["output_ids"]
    assert res.code is None, "%s: call failed: %r" % (label, res)
    n = min(len(res.ids), len(g_ids))
    first_diff = next((i for i in range(n) if res.ids[i] != g_ids[i]), None)
    assert res.ids == g_ids, ("%s: ids differ from the golden (first difference at %s; "
                              "%d vs %d ids)\n got %s\nwant %s"
                              % (label, first_diff, len(res.ids), len(g_ids), res.ids, g_ids))
    assert res.text == case["completion_text"], label
    assert res.finish == 1, "%s: finish_reason %s, want LENGTH" % (label, res.finish)
    assert res.usage.prompt_tokens == len(case["prompt_ids"]), label
    assert res.usage.completion_tokens == len(g_ids), label


# ---------------------------------------------------------------------------
# 1. Goldens
# ---------------------------------------------------------------------------

def test_golden_greedy_through_server(srv, golden):
    for i, case in enumerate(golden):
        n = len(case["output_ids"])
        for mode in ("prompt", "ids"):
            rid = "golden-%d-%s" % (i, mode)
            if mode == "prompt":
                req = srv.request(prompt=case["prompt"], max_new_tokens=n, request_id=rid)
            else:
                req = srv.request(ids=case["prompt_ids"], max_new_tokens=n, request_id=rid)
            res = srv.generate(req)
            assert_golden(res, case, rid)
            # Only the last message carries finish_reason and usage; every
            # message echoes the request id.
            for m in res.msgs[:-1]:
                assert m.finish_reason == 0, rid
                assert not m.HasField("usage"), rid
            assert all(m.request_id == rid for m in res.msgs), rid
            # Greedy with top_k/top_p/seed set is still greedy.
        req = srv.request(prompt=case["prompt"], max_new_tokens=n, top_k=5, top_p=0.5, seed=7,
                          temperature=0.0)
        assert_golden(srv.generate(req), case, "greedy with sampling knobs")


def test_shorter_generation_is_golden_prefix(srv, golden):
    case = golden[1]
    res = srv.generate(srv.request(prompt=case["prompt"], max_new_tokens=7))
    assert res.ids == case["output_ids"][:7], res
    assert res.finish == 1 and res.usage.completion_tokens == 7, res


# ---------------------------------------------------------------------------
# 2. Batching invariance
# ---------------------------------------------------------------------------

def _mixed_requests(srv, golden):
    reqs = []
    for case in golden:
        n = len(case["output_ids"])
        reqs.append(("golden-text", srv.request(prompt=case["prompt"], max_new_tokens=n), case))
        reqs.append(("golden-ids", srv.request(ids=case["prompt_ids"], max_new_tokens=n), case))
    for prompt, n in (("Lily and Tom went to", 17), ("The cat sat on the", 40),
                      ("One day, a big bird", 80), ("Sam had a red ball", 200)):
        reqs.append(("greedy", srv.request(prompt=prompt, max_new_tokens=n), None))
    for seed, (prompt, n) in enumerate((("Once upon a time", 90), ("The little dog", 60),
                                        ("Tim was happy because", 100),
                                        ("Once upon a time", 75)), start=11):
        reqs.append(("sampled", srv.request(prompt=prompt, max_new_tokens=n, temperature=0.8,
                                            top_p=0.9, seed=seed), None))
    assert len(reqs) == 12
    return reqs


def test_batching_invariance(srv, golden):
    reqs = _mixed_requests(srv, golden)
    solo = [srv.generate(r) for _, r, _ in reqs]
    for (kind, _, case), res in zip(reqs, solo):
        assert res.code is None, res
        assert res.finish in (1, 3), res  # LENGTH or EOS
        if case is not None:
            assert_golden(res, case, "solo " + kind)
    # Two concurrent rounds: the batch's composition differs between them.
    for round_ in range(2):
        together = run_concurrently([lambda r=r: srv.generate(r) for _, r, _ in reqs])
        for i, ((kind, req, case), alone, res) in enumerate(zip(reqs, solo, together)):
            label = "round %d request %d (%s, seed %s)" % (
                round_, i, kind, req.sampling.seed if req.sampling.HasField("seed") else None)
            assert res.code is None, "%s: %r" % (label, res)
            assert res.ids == alone.ids, "%s: batched %s\nalone %s" % (label, res.ids, alone.ids)
            assert res.text == alone.text, label
            assert res.finish == alone.finish, label
            if case is not None:
                assert_golden(res, case, label)
    # The sampled requests are not greedy in disguise: their seeds matter.
    a = srv.generate(srv.request(prompt="Once upon a time", max_new_tokens=90,
                                 temperature=0.8, top_p=0.9, seed=11))
    b = srv.generate(srv.request(prompt="Once upon a time", max_new_tokens=90,
                                 temperature=0.8, top_p=0.9, seed=12))
    assert a.ids == solo[8].ids
    assert a.ids != b.ids and a.ids != golden[0]["output_ids"][:90]


# ---------------------------------------------------------------------------
# 3. Streaming
# ---------------------------------------------------------------------------

def test_streaming_is_incremental(srv, golden):
    # The prompt is the golden prompt, so the first 124 ids are known.
    req = srv.request(prompt=golden[0]["prompt"], max_new_tokens=300)
    best = None
    for _ in range(3):  # the criterion is timing-based: allow a rerun on a loaded machine
        res = srv.generate(req)
        assert res.code is None, res
        assert res.ids[:124] == golden[0]["output_ids"], res
        assert len(res.ids) == 300 or res.finish == 3, res
        assert sum(len(m.token_ids) for m in res.msgs) == len(res.ids)
        if len(res.msgs) >= 10 and res.times[0] < 0.5 * res.times[-1]:
            best = res
            break
    assert best is not None, ("300 tokens came in %d messages, first at %.4f s, last at %.4f s"
                              % (len(res.msgs), res.times[0], res.times[-1]))


# ---------------------------------------------------------------------------
# 4. Cancellation and deadlines free their slots
# ---------------------------------------------------------------------------

def _wait_idle(client, timeout=10):
    def idle():
        m = client.metrics()
        return (m.get("coalesce_requests_running") == 0
                and m.get("coalesce_requests_waiting") == 0
                and m.get("coalesce_kv_cache_blocks", state="used") == 0) and m
    m = wait_for(idle, timeout)
    assert m, "server did not return to idle; last metrics: running %s waiting %s used %s" % (
        client.metrics().get("coalesce_requests_running"),
        client.metrics().get("coalesce_requests_waiting"),
        client.metrics().get("coalesce_kv_cache_blocks", state="used"))
    return m


class BackgroundLoad:
    """Threads that keep `n` long greedy generations running until stopped,
    so that engine steps are wide and a single generation lasts long enough
    to be cancelled mid-way even on a fast machine. Each result is checked
    against the same request run alone."""

    PROMPTS = ("Tim", "Sam had a red ball", "The sun was", "Ben and Mia")

    def __init__(self, client, n=12, max_new_tokens=400):
        self.client = client
        self.reqs = [client.request(prompt=self.PROMPTS[i % len(self.PROMPTS)],
                                    max_new_tokens=max_new_tokens) for i in range(n)]
        self.stop = threading.Event()
        self.results = [[] for _ in range(n)]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i):
        while not self.stop.is_set():
            self.results[i].append(self.client.generate(self.reqs[i]))

    def __enter__(self):
        self.solo = {r.prompt: self.client.generate(r) for r in self.reqs}
        for t in self.threads:
            t.start()
        # Wait until they are all running.
        wait_for(lambda: self.client.metrics().get("coalesce_requests_running")
                 >= len(self.reqs), 10, interval=0.005)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)
        if exc[0] is not None:
            return False  # do not mask the test's own failure
        for req, results in zip(self.reqs, self.results):
            for r in results:
                assert r.code is None, "background request failed: %r" % r
                assert r.ids == self.solo[req.prompt].ids, "background request changed"
        return False

    def ok_count(self):
        """Generate calls made (solo runs included), all of which succeeded."""
        return sum(len(r) for r in self.results) + len(self.reqs)


def test_cancel_frees_slot(srv, golden):
    before = _wait_idle(srv)
    cancelled_before = before.get("coalesce_requests_total", status="cancelled")
    ok_before = before.get("coalesce_requests_total", status="ok")
    case = golden[0]
    # Long (342 tokens, then EOS), so that it is still running when the cancel arrives.
    req = srv.request(prompt=case["prompt"], max_new_tokens=CONTEXT - 5)
    with BackgroundLoad(srv) as load:
        call = srv.generate_call(req)
        got = []
        for msg in call:
            got.extend(msg.token_ids)
            if len(got) >= 3:
                break
        # While it runs, it holds a slot and KV blocks (with the others').
        m = srv.metrics()
        running_seen = m.get("coalesce_requests_running")
        used_seen = m.get("coalesce_kv_cache_blocks", state="used")
        call.cancel()
        try:
            for msg in call:
                got.extend(msg.token_ids)
            pytest.fail("the call ended normally (%d tokens) instead of CANCELLED" % len(got))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e
        # The cancelled request leaves the batch while the others still run.
        assert wait_for(lambda: srv.metrics().get("coalesce_requests_total", status="cancelled")
                        == cancelled_before + 1, 5), "cancelled counter did not increase"
    assert got[:3] == case["output_ids"][:3]
    assert running_seen >= 2 and used_seen >= 2, (running_seen, used_seen)
    after = _wait_idle(srv)
    assert after.get("coalesce_requests_total", status="cancelled") == cancelled_before + 1
    assert after.get("coalesce_requests_total", status="ok") == ok_before + load.ok_count()
    # The server still serves.
    assert_golden(srv.generate(srv.request(prompt=case["prompt"], max_new_tokens=124)),
                  case, "after cancel")


def test_deadline_exceeded_while_running_frees_slot(srv, golden):
    before = _wait_idle(srv)
    dl_before = before.get("coalesce_requests_total", status="deadline_exceeded")
    req = srv.request(prompt=golden[0]["prompt"], max_new_tokens=CONTEXT - 5)
    with BackgroundLoad(srv):
        # How long the generation takes under this load: measured, not assumed.
        t0 = time.monotonic()
        full = srv.generate(req)
        full_s = time.monotonic() - t0
        assert full.code is None and len(full.ids) > 300, full
        # The machine's speed varies, so shrink the deadline until one expires
        # while the request is running (some tokens already streamed).
        expired = []
        timeout = min(0.3, full_s / 3)
        for _ in range(8):
            res = srv.generate(req, timeout=timeout)
            if res.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                expired.append(res)
                if res.ids:
                    break
                timeout *= 1.5  # expired before the first token: give it longer
            else:
                assert res.code is None and res.ids == full.ids, res
                timeout /= 2
    assert expired and expired[-1].ids, (
        "no deadline expired mid-generation (last timeout %.3f s, generation %.3f s)"
        % (timeout, full_s))
    for res in expired:
        assert res.ids == full.ids[:len(res.ids)]
    after = _wait_idle(srv)
    # No expired call was counted as a plain cancel. (A call can also expire
    # on the client after the server sent its last token, while the loaded
    # client is still reading: the server rightly counts that one "ok".)
    assert after.get("coalesce_requests_total", status="cancelled") == (
        before.get("coalesce_requests_total", status="cancelled"))
    dl_delta = after.get("coalesce_requests_total", status="deadline_exceeded") - dl_before
    assert 0 <= dl_delta <= len(expired)


def test_deadline_exceeded_while_waiting(batch_srv, golden):
    """Alone on the 200 ms-window server, a request waits for companions; a
    100 ms deadline ends it in the queue."""
    c = batch_srv
    before = _wait_idle(c)
    dl_before = before.get("coalesce_requests_total", status="deadline_exceeded")
    res = c.generate(c.request(prompt=golden[0]["prompt"], max_new_tokens=50), timeout=0.1)
    assert res.code == grpc.StatusCode.DEADLINE_EXCEEDED, res
    assert res.ids == []
    after = _wait_idle(c)
    assert after.get("coalesce_requests_total", status="deadline_exceeded") == dl_before + 1
    # Nothing of it ran: it never reached the engine's batch.
    assert after.get("coalesce_generated_tokens_total") == before.get(
        "coalesce_generated_tokens_total")
    res = c.generate(c.request(prompt=golden[0]["prompt"], max_new_tokens=50))
    assert res.ids == golden[0]["output_ids"][:50]


# ---------------------------------------------------------------------------
# 5. Bad inputs
# ---------------------------------------------------------------------------

def test_bad_inputs(srv, golden):
    case = golden[0]
    INV = grpc.StatusCode.INVALID_ARGUMENT
    R = srv.request
    bad = [
        ("neither prompt nor ids", R(max_new_tokens=5), INV, ["prompt", "empty"]),
        ("both", R(prompt="hi", ids=[1, 403], max_new_tokens=5), INV,
         ["exactly one", "prompt_token_ids"]),
        ("empty prompt", R(prompt="", max_new_tokens=5), INV, ["prompt", "empty"]),
        ("token id -1", R(ids=[1, -1, 403], max_new_tokens=5), INV,
         ["prompt_token_ids[1]", "-1", "512"]),
        ("token id 512", R(ids=[1, 403, 512], max_new_tokens=5), INV,
         ["prompt_token_ids[2]", "512", "vocab"]),
        ("prompt + max_new_tokens > context", R(prompt="Once upon a time", max_new_tokens=508),
         INV, ["5 tokens", "508", "context", "512"]),
        ("512 prompt ids + 1", R(ids=[1] + [403] * 511, max_new_tokens=1), INV,
         ["512 tokens", "context"]),
        ("max_new_tokens 0", R(prompt="Hi", max_new_tokens=0), INV, ["max_new_tokens", "0"]),
        ("max_new_tokens -3", R(prompt="Hi", max_new_tokens=-3), INV, ["max_new_tokens", "-3"]),
        ("max_new_tokens 1000000", R(prompt="Hi", max_new_tokens=1000000), INV,
         ["max_new_tokens", "1000000", "context"]),
        ("temperature -1", R(prompt="Hi", temperature=-1.0), INV, ["temperature"]),
        ("temperature nan", R(prompt="Hi", temperature=float("nan")), INV, ["temperature"]),
        ("temperature inf", R(prompt="Hi", temperature=float("inf")), INV, ["temperature"]),
        ("top_p 0", R(prompt="Hi", temperature=1.0, top_p=0.0), INV, ["top_p"]),
        ("top_p 1.5", R(prompt="Hi", temperature=1.0, top_p=1.5), INV, ["top_p", "1.5"]),
        ("top_k -1", R(prompt="Hi", temperature=1.0, top_k=-1), INV, ["top_k", "-1"]),
        ("17 stop sequences", R(prompt="Hi", stop=["s%d" % i for i in range(17)]), INV,
         ["stop", "16", "17"]),
        ("empty stop sequence", R(prompt="Hi", stop=["ok", ""]), INV, ["stop[1]"]),
        ("257-byte stop sequence", R(prompt="Hi", stop=["x" * 257]), INV, ["stop[0]", "257"]),
        ("257-byte request_id", R(prompt="Hi", request_id="r" * 257), INV,
         ["request_id", "257"]),
        # About 850 tokens of text: beyond the context once encoded.
        ("3 KB prompt", R(prompt="Once upon a time. " * 170, max_new_tokens=5), INV,
         ["context", "512"]),
    ]
    n_invalid = len(bad)
    oversized = R(prompt="x" * 100_000, max_new_tokens=5)  # > --max_request_bytes=65536

    before = _wait_idle(srv)
    inv_before = before.get("coalesce_requests_total", status="invalid_argument")
    ok_before = before.get("coalesce_requests_total", status="ok")

    # A well-formed stream runs, repeatedly, the whole time.
    stop_flag = threading.Event()
    good_results = []

    def good_loop():
        while not stop_flag.is_set() or not good_results:
            good_results.append(srv.generate(R(prompt=case["prompt"],
                                               max_new_tokens=len(case["output_ids"]))))

    t = threading.Thread(target=good_loop)
    t.start()
    try:
        failures = []
        for name, req, code, needles in bad:
            res = srv.generate(req)
            if res.code != code:
                failures.append("%s: got %s %r, want %s" % (name, res.code, res.details, code))
                continue
            if res.msgs:
                failures.append("%s: got %d messages before the error" % (name, len(res.msgs)))
            missing = [s for s in needles if s.lower() not in (res.details or "").lower()]
            if missing:
                failures.append("%s: message %r does not name %s" % (name, res.details, missing))
        res = srv.generate(oversized)
        if res.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            failures.append("100 KB request: got %s %r, want RESOURCE_EXHAUSTED"
                            % (res.code, res.details))
        elif "larger than max" not in (res.details or "").lower():
            failures.append("100 KB request: message %r does not say it is too large"
                            % res.details)
        # Detokenize/Tokenize errors and empty inputs do not break anything either.
        with pytest.raises(grpc.RpcError) as e:
            srv.detokenize([1, -5])
        if e.value.code() != INV or "token_ids[1]" not in e.value.details():
            failures.append("Detokenize([1, -5]): %s %r" % (e.value.code(), e.value.details()))
        assert srv.tokenize("", True) in ([1], []), "Tokenize('') with BOS"
        assert srv.detokenize([]) == ""
    finally:
        stop_flag.set()
        t.join(60)
    assert not failures, "\n".join(failures)
    assert good_results, "the concurrent good stream never finished"
    for i, r in enumerate(good_results):
        assert_golden(r, case, "concurrent good stream #%d" % i)

    after = _wait_idle(srv)
    assert after.get("coalesce_requests_total", status="invalid_argument") == inv_before + n_invalid
    # And afterwards the server still serves correctly.
    for c in golden:
        assert_golden(srv.generate(R(prompt=c["prompt"], max_new_tokens=len(c["output_ids"]))),
                      c, "after the bad inputs")
    after2 = _wait_idle(srv)
    assert after2.get("coalesce_requests_total", status="ok") == (
        ok_before + len(good_results) + len(golden))


# ---------------------------------------------------------------------------
# 6. Stop sequences
# ---------------------------------------------------------------------------

def _min_tokens_containing(srv, case, stop):
    """The fewest golden output tokens whose decoded text contains `stop`."""
    prompt_text = srv.detokenize(case["prompt_ids"])
    for k in range(1, len(case["output_ids"]) + 1):
        text = srv.detokenize(case["prompt_ids"] + case["output_ids"][:k])
        assert text.startswith(prompt_text)
        if stop in text[len(prompt_text):]:
            return k
    return None


@pytest.mark.parametrize("stops,first", [
    ([" Lily"], " Lily"),                 # a whole token
    (["ed Lil"], "ed Lil"),               # spans two tokens
    (["zzz", " park", " Lily"], " Lily"),  # earliest of several
    (["\nLily's"], "\nLily's"),           # after a newline, later in the text
])
def test_stop_sequences(srv, golden, stops, first):
    case = golden[0]
    full = case["completion_text"]
    cut = full.index(first)
    assert all(s not in full[:cut + len(first) - 1] for s in stops if s != first)
    res = srv.generate(srv.request(prompt=case["prompt"], max_new_tokens=len(case["output_ids"]),
                                   stop=stops))
    assert res.code is None, res
    assert res.text == full[:cut], res
    assert res.finish == 2, "finish_reason %s, want STOP" % res.finish
    k = _min_tokens_containing(srv, case, first)
    assert k is not None
    assert res.usage.completion_tokens == k, res
    assert res.ids == case["output_ids"][:k], res
    assert res.usage.prompt_tokens == len(case["prompt_ids"])


def test_stop_sequence_absent_runs_to_length(srv, golden):
    case = golden[1]
    res = srv.generate(srv.request(prompt=case["prompt"], max_new_tokens=len(case["output_ids"]),
                                   stop=["dragon", "Lilyx"]))
    assert_golden(res, case, "absent stop")


# ---------------------------------------------------------------------------
# 7. Tokenizer and model info
# ---------------------------------------------------------------------------

def test_tokenize_detokenize_model_info(srv, golden):
    for case in golden:
        assert srv.tokenize(case["prompt"], True) == case["prompt_ids"]
        assert srv.tokenize(case["prompt"], False) == case["prompt_ids"][1:]
        assert srv.detokenize(case["prompt_ids"] + case["output_ids"]) == case["text"]
    assert srv.detokenize([1, 2]) == ""  # control tokens decode to nothing
    with pytest.raises(grpc.RpcError) as e:
        srv.detokenize([1, 403, 512])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[2]" in e.value.details() and "512" in e.value.details()

    info = srv.info()
    assert info.name == "stories260K"
    assert info.vocab_size == VOCAB
    assert info.context_length == CONTEXT
    assert info.backend == "cpu"
    assert info.synthetic is False
    assert info.path.endswith("stories260K.bin"), info.path
    assert (info.num_layers, info.hidden_size, info.num_attention_heads,
            info.num_key_value_heads) == (5, 64, 8, 4)
    assert 250_000 <= info.num_parameters <= 270_000, (
        "num_parameters = %d, want about 260K" % info.num_parameters)
    assert info.bos_token_id == 1
    assert 1 in info.eos_token_ids, list(info.eos_token_ids)
    assert info.max_batch_size == 16  # the flag's default
    assert info.architecture


# ---------------------------------------------------------------------------
# 8. UTF-8
# ---------------------------------------------------------------------------

def _proto_string_fields(raw, field_number):
    """The raw bytes of every length-delimited field `field_number` in a
    serialized message (so UTF-8 validity is checked here, not by protobuf)."""
    out, i = [], 0

    def varint():
        nonlocal i
        shift = value = 0
        while True:
            b = raw[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(raw):
        key = varint()
        wire = key & 7
        if wire == 0:
            varint()
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n = varint()
            if key >> 3 == field_number:
                out.append(raw[i:i + n])
            i += n
        else:
            raise AssertionError("unexpected wire type %d" % wire)
    return out


def test_utf8_round_trip_and_streamed_text(srv):
    text = "Ünïcödé 日本語 🎉"
    ids = srv.tokenize(text, True)
    assert ids[0] == 1
    assert srv.tokenize(text, False) == ids[1:]
    # CJK and the emoji are not in the 512-token vocabulary: byte fallback.
    assert any(3 <= t <= 258 for t in ids), ids
    assert srv.detokenize(ids) == text
    no_bos = srv.detokenize(ids[1:])
    # Without BOS before it, the dummy-prefix space may or may not be shown.
    assert no_bos in (text, " " + text), repr(no_bos)
    # Invalid byte sequences become U+FFFD; incomplete ones too.
    e6 = 3 + 0xE6  # first byte of a 3-byte character
    assert srv.detokenize([1, 403, e6]).endswith("\ufffd")

    prompt_text = srv.detokenize(ids)
    saw_multi_chunks = 0
    for seed in (1, 2, 3, 4, 5):
        req = srv.request(prompt=text, max_new_tokens=120, temperature=1.5, seed=seed)
        raws = srv.generate_raw(req)
        assert raws
        chunks = []
        gen_ids = []
        for raw in raws:
            for b in _proto_string_fields(raw, 2):
                chunks.append(b.decode("utf-8"))  # strict: raises on invalid UTF-8
            gen_ids.extend(srv.pb.g.GenerateResponse.FromString(raw).token_ids)
        last = srv.pb.g.GenerateResponse.FromString(raws[-1])
        assert last.finish_reason in (1, 3), last
        assert last.usage.completion_tokens == len(gen_ids)
        saw_multi_chunks += len(chunks) > 1
        whole = srv.detokenize(ids + gen_ids)
        assert whole.startswith(prompt_text)
        assert "".join(chunks) == whole[len(prompt_text):], (
            "seed %d: streamed text != Detokenize(prompt + generated) minus the prompt" % seed)
    assert saw_multi_chunks


def test_utf8_split_character_in_output(srv):
    """A prompt of byte tokens ending mid-character: the generated text must
    still be valid UTF-8 on its own (the prompt's bytes are not re-sent)."""
    ids = [1, 403, 407, 261, 378, 3 + 0xE6, 3 + 0x97]  # ... + first 2 bytes of "日"
    for seed in (3, 4):
        raws = srv.generate_raw(srv.request(ids=ids, max_new_tokens=60, temperature=1.5,
                                            seed=seed))
        text = "".join(b.decode("utf-8") for raw in raws for b in _proto_string_fields(raw, 2))
        gen_ids = [t for raw in raws
                   for t in srv.pb.g.GenerateResponse.FromString(raw).token_ids]
        last = srv.pb.g.GenerateResponse.FromString(raws[-1])
        assert last.usage.completion_tokens == len(gen_ids)
        assert last.usage.prompt_tokens == len(ids)
        # Decoded on their own (the context token only matters for a leading
        # space after BOS, which 0x97 is not).
        assert text == srv.detokenize([2] + gen_ids), seed


# ---------------------------------------------------------------------------
# 9. Batching shows in the metrics
# ---------------------------------------------------------------------------

def test_batching_visible_in_metrics(batch_srv, golden):
    c = batch_srv
    before = _wait_idle(c)
    reqs = []
    for i in range(8):
        case = golden[i % 2]
        reqs.append(c.request(prompt=case["prompt"], max_new_tokens=40 + 10 * i))
    results = run_concurrently([lambda r=r: c.generate(r) for r in reqs])
    for i, res in enumerate(results):
        case = golden[i % 2]
        assert res.code is None, res
        assert res.ids == case["output_ids"][:40 + 10 * i], "request %d: %r" % (i, res)
        assert res.finish == 1
    after = _wait_idle(c)

    def d(name, **labels):
        return after.get(name, **labels) - before.get(name, **labels)

    steps = d("coalesce_batch_size_count")
    single = d("coalesce_batch_size_bucket", le="1")
    up_to_4 = d("coalesce_batch_size_bucket", le="4")
    total = d("coalesce_batch_size_sum")
    assert steps > 0
    assert steps - single > 0, "no step ran more than one sequence"
    assert steps - up_to_4 > 0, "no step ran more than four of the 8 coalesced requests"
    assert total / steps > 1, "mean batch size %.2f" % (total / steps)
    # Every sequence of every step produced a token, and nothing else did.
    assert total == sum(r.usage.completion_tokens for r in results)
    assert d("coalesce_generated_tokens_total") == sum(r.usage.completion_tokens for r in results)
    assert d("coalesce_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert d("coalesce_time_to_first_token_seconds_count") == 8
    assert d("coalesce_queue_wait_seconds_count") == 8
    assert d("coalesce_request_duration_seconds_count") == 8
    assert d("coalesce_requests_total", status="ok") == 8
    # The longest request (110 tokens) ran at least 110 steps; coalescing
    # means the 8 requests needed far fewer than the 600 steps of one at a time.
    assert 110 <= steps < 300, steps


def test_lone_request_waits_for_the_window(batch_srv, golden):
    c = batch_srv
    before = _wait_idle(c)
    res = c.generate(c.request(prompt=golden[0]["prompt"], max_new_tokens=5))
    assert res.ids == golden[0]["output_ids"][:5]
    # Alone, it may only start when the 200 ms window closes (rule c).
    assert res.times[0] >= 0.19, "first token after %.3f s" % res.times[0]
    assert res.times[0] < 5.0
    after = _wait_idle(c)
    waited = (after.get("coalesce_queue_wait_seconds_sum")
              - before.get("coalesce_queue_wait_seconds_sum"))
    assert 0.19 <= waited < 5.0, waited


# ---------------------------------------------------------------------------
# 10. Health and reflection
# ---------------------------------------------------------------------------

def test_health_and_reflection(srv, pb):
    assert srv.health("") == pb.health.HealthCheckResponse.SERVING
    services = srv.list_services()
    assert "coalesce.v1.Generator" in services, services
    assert "grpc.health.v1.Health" in services, services


# ---------------------------------------------------------------------------
# 11. SIGTERM drains
# ---------------------------------------------------------------------------

def test_sigterm_drains(pb, golden):
    server, client = _start(["--grace_period=20s"])
    try:
        client.bind(pb)
        case = golden[0]
        req = client.request(prompt=case["prompt"], max_new_tokens=300, request_id="draining")
        solo = client.generate(req)
        assert solo.code is None and len(solo.ids) == 300, solo
        # Other long streams run alongside, so the drain has work to wait for.
        others = [client.request(prompt=p, max_new_tokens=400, request_id="other-%d" % i)
                  for i, p in enumerate(BackgroundLoad.PROMPTS * 2)]
        others_solo = [client.generate(r) for r in others]
        calls = [client.generate_call(r) for r in others]
        # The draining stream: read a few messages, then SIGTERM.
        call = client.generate_call(req)
        msgs = []
        it = iter(call)
        while sum(len(m.token_ids) for m in msgs) < 3:
            msgs.append(next(it))
        running = client.metrics().get("coalesce_requests_running")
        t_signal = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert running >= 1, "nothing was running when SIGTERM was sent"
        assert wait_for(lambda: "draining" in server.log(), 5), "no drain log line"
        # New work is refused while draining.
        time.sleep(0.2)
        late = client.generate(client.request(prompt="Hello", max_new_tokens=5), timeout=5)
        assert late.code == grpc.StatusCode.UNAVAILABLE, late
        try:
            status = client.health(timeout=2)
            assert status == pb.health.HealthCheckResponse.NOT_SERVING, status
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        # The running streams finish with everything.
        try:
            for m in it:
                msgs.append(m)
        except grpc.RpcError as e:
            pytest.fail("the draining stream failed: %s %s" % (e.code(), e.details()))
        ids = [t for m in msgs for t in m.token_ids]
        assert ids == solo.ids
        assert "".join(m.text for m in msgs) == solo.text
        assert msgs[-1].finish_reason == 1
        assert msgs[-1].usage.completion_tokens == 300
        for r, alone, c in zip(others, others_solo, calls):
            try:
                got = list(c)
            except grpc.RpcError as e:
                pytest.fail("%s failed while draining: %s %s" % (r.request_id, e.code(),
                                                                 e.details()))
            assert [t for m in got for t in m.token_ids] == alone.ids, r.request_id
            assert got[-1].finish_reason == alone.finish, r.request_id
        rc = server.proc.wait(max(1, 20 + 10 - (time.monotonic() - t_signal)))
        assert rc == 0, "exit code %s" % rc
        assert "stopped" in server.log()
    finally:
        client.close()
        server.kill()


def test_sigterm_idle_server_exits_quickly(pb):
    server, client = _start([])
    try:
        client.bind(pb)
        assert client.health() == pb.health.HealthCheckResponse.SERVING
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(10)
        assert rc == 0
        assert time.monotonic() - t0 < 5  # nothing to wait for: no grace period spent
    finally:
        client.close()
        server.kill()


# ---------------------------------------------------------------------------
# 12. Static batching
# ---------------------------------------------------------------------------

def test_static_batching_goldens(static_srv, golden):
    c = static_srv
    reqs = []
    for case in golden:
        n = len(case["output_ids"])
        reqs.append((c.request(prompt=case["prompt"], max_new_tokens=n), case))
        reqs.append((c.request(ids=case["prompt_ids"], max_new_tokens=n), case))
        reqs.append((c.request(prompt=case["prompt"], max_new_tokens=30), case))
    for _ in range(2):
        results = run_concurrently([lambda r=r: c.generate(r) for r, _ in reqs])
        for (req, case), res in zip(reqs, results):
            if req.max_new_tokens == len(case["output_ids"]):
                assert_golden(res, case, "static")
            else:
                assert res.ids == case["output_ids"][:30], res
                assert res.finish == 1
    seeded = c.request(prompt="The little dog", max_new_tokens=50, temperature=0.8, top_p=0.9,
                       seed=5)
    alone = c.generate(seeded)
    with_others = run_concurrently([lambda: c.generate(seeded)] +
                                   [lambda r=r: c.generate(r) for r, _ in reqs[:3]])
    assert with_others[0].ids == alone.ids
