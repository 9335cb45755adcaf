"""What the end-to-end tests share: the server process (on the harness of
tools/harness/coalesce_harness.py, failing the test when it does not start), a
gRPC client of coalesce.v1 with health and reflection, and Prometheus metrics
looked up by name and labels.

The client's message classes come from e2e_protos (a descriptor set, no
generated code).

Environment:
    COALESCE_SERVER           the server binary (default <repo>/build/bin/coalesce-server)
    COALESCE_MODELS_DIR       the folder holding stories260K/ (default <repo>/../shared/models)
    COALESCE_SERVER_FLAGS     flags for every server the tests start, before each
                              test's own (which win): e.g. "--device=cuda --dtype=fp32"
    COALESCE_E2E_DESCRIPTORS  a FileDescriptorSet made by e2e_protos, instead of running protoc
"""

import concurrent.futures
import os
import re
import socket
import sys
import threading
import time

import grpc
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
import coalesce_harness  # noqa: E402
from coalesce_harness import die_with_parent  # noqa: E402,F401  (tests import it from here)

SERVER = os.environ.get("COALESCE_SERVER") or os.path.join(REPO, "build", "bin", "coalesce-server")
MODELS = os.environ.get("COALESCE_MODELS_DIR") or os.path.join(REPO, "..", "shared", "models")
MODEL_BIN = os.path.join(MODELS, "stories260K", "stories260K.bin")
TOKENIZER_BIN = os.path.join(MODELS, "stories260K", "tok512.bin")
GOLDEN_JSON = os.path.join(MODELS, "stories260K", "golden.json")
SERVER_FLAGS = os.environ.get("COALESCE_SERVER_FLAGS", "").split()
# The backends GetModelInfo may name: the one --device asks for (the last
# --device flag wins, as in the server), either real one for "auto".
_DEVICE = ([f.split("=", 1)[1] for f in SERVER_FLAGS if f.startswith("--device=")] or ["auto"])[-1]
EXPECTED_BACKENDS = ("cpu", "cuda") if _DEVICE == "auto" else (_DEVICE,)

VOCAB = 512
CONTEXT = 512
RPC_TIMEOUT = 60  # seconds; no call in this file should come near it

# ---------------------------------------------------------------------------
# The server process (tools/harness/coalesce_harness.py)
# ---------------------------------------------------------------------------

# Servers not yet killed, and every server started since the current test
# began (conftest's log fixture prints the logs of both).
_RUNNING_SERVERS = []
_STARTED_IN_TEST = []


class Server(coalesce_harness.ServerProcess):
    """A coalesce-server for a test: stories260K unless `model_flags` say
    otherwise, then COALESCE_SERVER_FLAGS, then the test's `extra_flags`. A
    server that does not start fails the test.

    Its connections never age (--max_connection_age=inf unless the test says
    otherwise): a module's client keeps one channel for all of its tests,
    which under a sanitizer can outlast the 5 minutes after which the server
    would send GOAWAY and, its grace period later, close the connection under
    the calls still on it."""

    def __init__(self, extra_flags=(), model_flags=None):
        """`model_flags` replaces the default --model/--tokenizer (stories260K)."""
        if not os.path.exists(SERVER):
            pytest.fail("server binary not found: %s (set COALESCE_SERVER)" % SERVER)
        for f in (MODEL_BIN, TOKENIZER_BIN):
            if not os.path.exists(f):
                pytest.fail("model file not found: %s (set COALESCE_MODELS_DIR)" % f)
        if model_flags is None:
            model_flags = ["--model=" + MODEL_BIN, "--tokenizer=" + TOKENIZER_BIN]
        error = None
        try:
            leading = list(model_flags) + ["--max_connection_age=inf"] + SERVER_FLAGS
            super().__init__(SERVER, extra_flags, leading_flags=leading,
                             start_timeout_s=60)
        except coalesce_harness.HarnessError as e:
            error = str(e)
        if error:
            pytest.fail(error)  # outside the except: no chained traceback
        _RUNNING_SERVERS.append(self)
        _STARTED_IN_TEST.append(self)

    def kill(self):
        super().kill()
        if self in _RUNNING_SERVERS:
            _RUNNING_SERVERS.remove(self)

    def stop(self, grace_s=15.0):
        try:
            return super().stop(grace_s)
        finally:
            if self in _RUNNING_SERVERS:
                _RUNNING_SERVERS.remove(self)


def start_server(extra_flags, model_flags=None):
    server = Server(extra_flags, model_flags)
    try:
        client = Client(server)
    except Exception:
        server.kill()
        raise
    return server, client


def caching_on_and_off(pb, flags):
    """For a module fixture: yields clients of two servers with `flags`, one
    with prefix caching on and one with it off, and stops both after."""
    on_server, on = start_server(flags)
    try:
        off_server, off = start_server(list(flags) + ["--prefix_caching=false"])
    except BaseException:
        on_server.kill()
        raise
    on.bind(pb)
    off.bind(pb)
    try:
        yield on, off
    finally:
        on.close()
        off.close()
        on_server.kill()
        off_server.kill()


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
        self.trailing = {}   # trailing metadata of a failed call
        self.elapsed = None  # seconds from the call to its end
        self.samples = {}    # index -> Sample, of every message

    def __repr__(self):
        return ("Result(code=%s, details=%r, finish=%s, n_ids=%d, ids=%s, text=%r, usage=%s)"
                % (self.code, self.details, self.finish, len(self.ids), self.ids, self.text,
                   None if self.usage is None else
                   (self.usage.prompt_tokens, self.usage.completion_tokens)))


class Sample:
    """One sample's output in a call with several (GenerateRequest.n)."""

    def __init__(self):
        self.ids = []
        self.text = ""
        self.finish = None   # of its last message
        self.usage = None
        self.messages = 0
        self.finals = 0      # messages with a finish_reason: must be 1

    def __repr__(self):
        return "Sample(finish=%s, ids=%s, text=%r)" % (self.finish, self.ids, self.text)


class Client:
    def __init__(self, server, credentials=None, wait_ready=True):
        """A channel to `server`: plaintext, or over TLS with `credentials`
        (grpc.ssl_channel_credentials); waits until it connects unless told
        not to (a client the server will refuse)."""
        self.server = server
        self.channel = (grpc.insecure_channel(server.address) if credentials is None
                        else grpc.secure_channel(server.address, credentials))
        if wait_ready:
            grpc.channel_ready_future(self.channel).result(timeout=30)
        self.pb = None
        # Sent with every Generator call: [("authorization", "Bearer KEY")].
        self.metadata = None

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
        self._apply_chat_template = self.channel.unary_unary(
            m + "ApplyChatTemplate",
            request_serializer=g.ApplyChatTemplateRequest.SerializeToString,
            response_deserializer=g.ApplyChatTemplateResponse.FromString)
        self._health = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=pb.health.HealthCheckRequest.SerializeToString,
            response_deserializer=pb.health.HealthCheckResponse.FromString)
        self._health_watch = self.channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
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
                top_k=None, top_p=None, seed=None, stop=(), request_id="", priority=0,
                messages=None, n=None, split_special_tokens=None):
        g = self.pb.g
        r = g.GenerateRequest(max_new_tokens=max_new_tokens, request_id=request_id,
                              priority=priority)
        if n is not None:
            r.n = n
        if split_special_tokens is not None:
            r.split_special_tokens = split_special_tokens
        if prompt is not None:
            r.prompt = prompt
        if ids is not None:
            r.prompt_token_ids.extend(ids)
        for m in messages or ():
            r.messages.add(role=m["role"], content=m["content"])
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
        call = self._generate(req, timeout=timeout, metadata=self.metadata)
        try:
            for msg in call:
                res.times.append(time.monotonic() - t0)
                res.msgs.append(msg)
                res.ids.extend(msg.token_ids)
                res.text += msg.text
                sample = res.samples.setdefault(msg.index, Sample())
                sample.ids.extend(msg.token_ids)
                sample.text += msg.text
                sample.messages += 1
                if msg.finish_reason:
                    sample.finals += 1
                    sample.finish = msg.finish_reason
                    sample.usage = msg.usage
        except grpc.RpcError as e:
            res.code = e.code()
            res.details = e.details()
            res.trailing = dict(e.trailing_metadata() or ())
            res.elapsed = time.monotonic() - t0
            return res
        res.elapsed = time.monotonic() - t0
        if res.msgs:
            res.finish = res.msgs[-1].finish_reason
            res.usage = res.msgs[-1].usage
        return res

    def generate_call(self, req, timeout=RPC_TIMEOUT):
        return self._generate(req, timeout=timeout, metadata=self.metadata)

    def generate_raw(self, req, timeout=RPC_TIMEOUT):
        return list(self._generate_raw(req, timeout=timeout))

    def info(self):
        return self._info(self.pb.g.GetModelInfoRequest(), timeout=RPC_TIMEOUT,
                          metadata=self.metadata)

    def tokenize(self, text, add_special_tokens, split_special_tokens=None):
        req = self.pb.g.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        if split_special_tokens is not None:
            req.split_special_tokens = split_special_tokens
        return list(self._tokenize(req, timeout=RPC_TIMEOUT, metadata=self.metadata).token_ids)

    def detokenize(self, ids):
        return self._detokenize(self.pb.g.DetokenizeRequest(token_ids=ids),
                                timeout=RPC_TIMEOUT, metadata=self.metadata).text

    def apply_chat_template(self, messages, add_generation_prompt=True,
                            split_special_tokens=None):
        """(text, token_ids); a failed call raises grpc.RpcError."""
        req = self.pb.g.ApplyChatTemplateRequest(add_generation_prompt=add_generation_prompt)
        if split_special_tokens is not None:
            req.split_special_tokens = split_special_tokens
        for m in messages:
            req.messages.add(role=m["role"], content=m["content"])
        res = self._apply_chat_template(req, timeout=RPC_TIMEOUT, metadata=self.metadata)
        return res.text, list(res.token_ids)

    def health(self, service="", timeout=RPC_TIMEOUT):
        return self._health(self.pb.health.HealthCheckRequest(service=service),
                            timeout=timeout).status

    def health_watch(self, service="", timeout=RPC_TIMEOUT):
        """The Watch stream: the current status, then every change."""
        return self._health_watch(self.pb.health.HealthCheckRequest(service=service),
                                  timeout=timeout)

    def list_services(self):
        req = self.pb.reflection.ServerReflectionRequest(list_services="*")
        responses = list(self._reflect(iter([req]), timeout=RPC_TIMEOUT))
        assert len(responses) == 1, responses
        r = responses[0]
        assert r.WhichOneof("message_response") == "list_services_response", r
        return [s.name for s in r.list_services_response.service]

    # -- metrics -----------------------------------------------------------
    def metrics(self):
        return parse_metrics(coalesce_harness.read_metrics_text(self.server.metrics_port))


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
    """Metrics of Prometheus text (the harness parses the lines; an
    unparsable one raises its HarnessError)."""
    out = Metrics()
    for name, labels, value in coalesce_harness.metric_samples(text):
        out[(name, tuple(sorted(_LABEL_RE.findall(labels))))] = value
    return out


def with_sampling_controls(req, controls):
    """Sets `controls` (SamplingParams field name -> value; logit_bias a
    dict of id -> bias, stop_token_ids a list) on `req`; returns it."""
    for name, value in controls.items():
        if name == "logit_bias":
            for token, bias in value.items():
                req.sampling.logit_bias[token] = bias
        elif name == "stop_token_ids":
            req.sampling.stop_token_ids.extend(value)
        else:
            setattr(req.sampling, name, value)
    return req


def wait_for(predicate, timeout, interval=0.05):
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            return value
        time.sleep(interval)


def time_to_close(s, limit_s):
    """Reads the socket `s` (plain or TLS) until the server closes it (end of
    stream, reset, or a TLS error); returns (seconds it took, bytes received),
    or (None, bytes) if it is still open after limit_s."""
    t0 = time.monotonic()
    data = b""
    s.settimeout(0.2)
    while time.monotonic() - t0 < limit_s:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:  # a reset, or ssl.SSLError
            return time.monotonic() - t0, data
        if not chunk:
            return time.monotonic() - t0, data
        data += chunk
    return None, data


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


def wait_idle(client, timeout=10):
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

