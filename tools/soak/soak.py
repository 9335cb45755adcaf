#!/usr/bin/env python3
"""coalesce-soak: mixed, partly hostile load against a real coalesce-server for
a given time, then checks that the server came through it whole.

    tools/soak/soak.py --seconds=1800            # after tools/build.sh
    tools/soak/soak.py --seconds=60 --json=out.json

It starts the server (stories260K from ../shared/models, or $COALESCE_MODELS_DIR; a KV cache far too
small for the load so that preemption never stops, a short stall timeout;
tenants from an --api_keys_file: four, two of them sharing a prefix-cache
group, one with a token budget the load overdraws) and keeps WORKERS client
threads busy, each call as a random tenant, with a random mix of:

  exact       greedy and seeded sampled generations, each checked token for
              token against the same request run alone at the start;
  split       the same with split_special_tokens, which must change nothing
              (llama2.c's tokenizer matches no special token in the text; t-c,
              whose tenant entry forces it, splits in every kind too);
  samples     a seeded request for 4 samples, each checked against its
              reference (they may be preempted for other requests);
  priority    an exact request at priority 50, which preempts the others;
  privacy     a fresh prompt sent by one tenant, then by a tenant outside its
              prefix-cache partition, which must find none of it cached;
  budget      requests of the tenant with the small budget: refused when it is
              spent (with a wait), and one larger than a minute's budget
              refused for good (pushback -1);
  long        a 400-token prompt with prompt_logprobs beside the others;
  cancel      streams cancelled by the client after a few messages;
  deadline    calls with deadlines of 50 ms to 1 s (finished ones are exact);
  invalid     bad arguments, a prompt too long for the context, garbage bytes,
              invalid UTF-8, gzip-compressed requests: each must get its own
              error code at once;
  misc        Tokenize, Detokenize, GetModelInfo, Health;
  stall       now and then a raw HTTP/2 client (python3-h2) that stops
              reading mid-stream, whose slot the server must take back.

Every few seconds it samples the server's memory (VmRSS) and open file
descriptors. At the end it requires: no unexpected outcome and no output that
differs from its reference; the server back to idle (nothing running or
waiting, no KV block in use); memory and descriptors on a plateau (the last
quarter of the run at most 10% + 8 MiB and 8 descriptors above the second
quarter); and a clean exit on SIGTERM. Exit status 0 when all of that holds.

Needs Debian's python3 with python3-grpcio, python3-protobuf and python3-h2
(tools/install-deps.sh), and protoc; the messages come from
tests/service/e2e_protos.py (a descriptor set, no generated code).
"""

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "service"))
sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
from coalesce_harness import HarnessError, ServerProcess  # noqa: E402
from e2e_protos import compile_descriptors, load_stubs  # noqa: E402

MODELS = os.environ.get("COALESCE_MODELS_DIR") or os.path.join(REPO, "..", "shared", "models")
PROMPTS = ["Once upon a time", "The little dog", "Tim and Sam", "The sun was hot",
           "Lily had a red ball", "One day, a bird", "Mom said", "The big tree"]
KINDS = {"exact": 31, "split": 3, "cancel": 10, "deadline": 10, "invalid": 12, "misc": 8,
         "samples": 8, "priority": 5, "privacy": 6, "budget": 4, "long": 3}
# name: (key, what else the tenants file says of it)
TENANTS = {"t-a": ("soak-key-a", {"max_priority": 50}),
           "t-b": ("soak-key-b", {"prefix_cache_group": "org", "weight": 2}),
           "t-c": ("soak-key-c", {"prefix_cache_group": "org", "split_special_tokens": True}),
           "t-small": ("soak-key-small", {"tokens_per_minute": 1500})}
# The tenants that share cached prompts with each.
PARTITION = {"t-a": {"t-a"}, "t-b": {"t-b", "t-c"}, "t-c": {"t-b", "t-c"},
             "t-small": {"t-small"}}


def field(number, payload):
    return bytes([number << 3 | 2, len(payload)]) + payload


class Soak:
    def __init__(self, args, pb):
        self.args = args
        self.pb = pb
        self.lock = threading.Lock()
        self.counts = {}       # (kind, outcome) -> n
        self.failures = []     # descriptions of unexpected outcomes (first 50 kept)
        self.samples = []      # (seconds, rss_kib, fds)
        self.stop = threading.Event()

    # -- bookkeeping ---------------------------------------------------------
    def count(self, kind, outcome):
        with self.lock:
            self.counts[(kind, outcome)] = self.counts.get((kind, outcome), 0) + 1

    def fail(self, what):
        with self.lock:
            self.counts[("unexpected", "")] = self.counts.get(("unexpected", ""), 0) + 1
            if len(self.failures) < 50:
                self.failures.append(what)

    # -- the server ----------------------------------------------------------
    def start_server(self):
        """The server, on tools/harness/coalesce_harness.py."""
        model = ["--model=" + os.path.join(MODELS, "stories260K", "stories260K.bin"),
                 "--tokenizer=" + os.path.join(MODELS, "stories260K", "tok512.bin")]
        keys = os.path.join(self.args.workdir, "tenants.json")
        with open(keys, "w") as f:
            json.dump({"tenants": [dict(name=name, key_sha256=hashlib.sha256(key.encode())
                                        .hexdigest(), **extra)
                                   for name, (key, extra) in TENANTS.items()]}, f)
        flags = ["--kv_cache_memory=600KiB", "--kv_block_size=16", "--max_batch_size=16",
                 "--max_batch_tokens=64", "--max_queue=256", "--stream_stall_timeout=200ms",
                 "--grace_period=10s", "--api_keys_file=" + keys] + self.args.server_flag
        try:
            self.server = ServerProcess(self.args.server, flags, leading_flags=model,
                                        start_timeout_s=60)
        except HarnessError as e:
            raise SystemExit("the server did not start: %s" % e)
        self.address = self.server.address

    def metrics(self):
        """{series: value}: 'name' or 'name{labels}' as the server writes them."""
        return self.server.metrics()

    def sample(self, t0):
        pid = self.server.proc.pid
        with open("/proc/%d/status" % pid) as f:
            rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        fds = len(os.listdir("/proc/%d/fd" % pid))
        self.samples.append((time.monotonic() - t0, rss, fds))

    # -- clients -------------------------------------------------------------
    def channel(self, **kw):
        return grpc.insecure_channel(self.address, **kw)

    def stubs(self, ch):
        g, m = self.pb.g, "/coalesce.v1.Generator/"
        ident = lambda b: b  # noqa: E731
        return {
            "generate": ch.unary_stream(m + "Generate",
                                        request_serializer=g.GenerateRequest.SerializeToString,
                                        response_deserializer=g.GenerateResponse.FromString),
            "generate_raw": ch.unary_stream(m + "Generate", request_serializer=ident,
                                            response_deserializer=ident),
            "tokenize": ch.unary_unary(m + "Tokenize",
                                       request_serializer=g.TokenizeRequest.SerializeToString,
                                       response_deserializer=g.TokenizeResponse.FromString),
            "detokenize": ch.unary_unary(m + "Detokenize",
                                         request_serializer=g.DetokenizeRequest.SerializeToString,
                                         response_deserializer=g.DetokenizeResponse.FromString),
            "info": ch.unary_unary(m + "GetModelInfo",
                                   request_serializer=g.GetModelInfoRequest.SerializeToString,
                                   response_deserializer=g.ModelInfo.FromString),
            "health": ch.unary_unary("/grpc.health.v1.Health/Check",
                                     request_serializer=self.pb.health.HealthCheckRequest
                                     .SerializeToString,
                                     response_deserializer=self.pb.health.HealthCheckResponse
                                     .FromString),
        }

    def exact_requests(self):
        """The requests whose output must never change: greedy and seeded."""
        g = self.pb.g
        reqs = []
        for i, p in enumerate(PROMPTS):
            reqs.append(g.GenerateRequest(prompt=p, max_new_tokens=20 + 30 * i))
            r = g.GenerateRequest(prompt=p, max_new_tokens=120, request_id="seeded-%d" % i)
            r.sampling.temperature = 0.9
            r.sampling.top_p = 0.95
            r.sampling.seed = 1000 + i
            reqs.append(r)
        return reqs

    def samples_request(self):
        """A seeded request for 4 samples: sample i must equal its own
        reference (self.sample_refs[i])."""
        r = self.pb.g.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=60, n=4,
                                      request_id="samples")
        r.sampling.temperature = 1.0
        r.sampling.seed = 77
        return r

    def run_stream(self, call):
        ids, last = [], None
        for m in call:
            ids.extend(m.token_ids)
            last = m
        return ids, last

    def run_samples(self, call):
        """{index: ids} of a call with several samples."""
        out = {}
        for m in call:
            out.setdefault(m.index, []).extend(m.token_ids)
        return out

    def worker(self, seed):
        rng = random.Random(seed)
        ch = self.channel()
        s = self.stubs(ch)
        gz = self.channel(compression=grpc.Compression.Gzip)
        gz_tok = self.stubs(gz)["tokenize"]
        kinds = [k for k, w in KINDS.items() for _ in range(w)]
        g = self.pb.g
        while not self.stop.is_set():
            kind = rng.choice(kinds)
            tenant = "t-small" if kind == "budget" else rng.choice(["t-a", "t-b", "t-c"])
            md = [("authorization", "Bearer " + TENANTS[tenant][0])]
            try:
                if kind in ("exact", "priority", "split"):
                    i = rng.randrange(len(self.refs))
                    req = self.reqs[i]
                    if kind == "priority":
                        tenant, md = "t-a", [("authorization", "Bearer " + TENANTS["t-a"][0])]
                        req = g.GenerateRequest()
                        req.CopyFrom(self.reqs[i])
                        req.priority = 50
                    if kind == "split":
                        req = g.GenerateRequest()
                        req.CopyFrom(self.reqs[i])
                        req.split_special_tokens = True
                    ids, last = self.run_stream(s["generate"](req, timeout=120, metadata=md))
                    if ids != self.refs[i]:
                        self.fail("%s: request %d gave different tokens" % (kind, i))
                    elif last.usage.completion_tokens != len(ids):
                        self.fail("%s: usage %d for %d tokens" % (kind, last.usage.completion_tokens,
                                                                  len(ids)))
                    else:
                        self.count(kind, "ok")
                elif kind == "samples":
                    got = self.run_samples(s["generate"](self.samples_req, timeout=120,
                                                          metadata=md))
                    if got != self.sample_refs:
                        self.fail("samples: a sample gave different tokens")
                    else:
                        self.count(kind, "ok")
                elif kind == "privacy":
                    self.privacy(rng, s, tenant)
                elif kind == "budget":
                    self.budget(rng, s, md)
                elif kind == "long":
                    r = g.GenerateRequest(max_new_tokens=8, prompt_logprobs=True)
                    r.prompt_token_ids.extend([1] + [rng.randrange(3, 512) for _ in range(399)])
                    msgs = list(s["generate"](r, timeout=120, metadata=md))
                    if len(msgs[0].prompt_logprobs) != 399:
                        self.fail("long: %d prompt log-probabilities for 400 tokens"
                                  % len(msgs[0].prompt_logprobs))
                    else:
                        self.count(kind, "ok")
                elif kind == "cancel":
                    call = s["generate"](g.GenerateRequest(prompt=rng.choice(PROMPTS),
                                                           max_new_tokens=400), timeout=120,
                                         metadata=md)
                    n = rng.randrange(1, 6)
                    for k, _ in enumerate(call):
                        if k + 1 >= n:
                            break
                    call.cancel()
                    self.count(kind, "cancelled")
                elif kind == "deadline":
                    i = rng.randrange(len(self.refs))
                    try:
                        ids, _ = self.run_stream(
                            s["generate"](self.reqs[i], timeout=rng.uniform(0.05, 1.0),
                                          metadata=md))
                        if ids != self.refs[i]:
                            self.fail("deadline: request %d finished with different tokens" % i)
                        else:
                            self.count(kind, "ok")
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                            raise
                        self.count(kind, "deadline_exceeded")
                elif kind == "invalid":
                    self.invalid(rng, s, gz_tok, md)
                else:
                    text = rng.choice(PROMPTS)
                    ids = list(s["tokenize"](g.TokenizeRequest(text=text), timeout=30,
                                             metadata=md).token_ids)
                    back = s["detokenize"](g.DetokenizeRequest(token_ids=ids), timeout=30,
                                           metadata=md).text
                    if back.lstrip(" ") != text:  # llama2c's dummy prefix space
                        self.fail("misc: Detokenize(Tokenize(%r)) gave %r" % (text, back))
                    s["info"](g.GetModelInfoRequest(), timeout=30, metadata=md)
                    if s["health"](self.pb.health.HealthCheckRequest(), timeout=30).status != 1:
                        self.fail("misc: health not SERVING")
                    self.count(kind, "ok")
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.count(kind, "resource_exhausted")  # overload: allowed
                else:
                    self.fail("%s: %s %s" % (kind, e.code(), e.details()))
        ch.close()
        gz.close()

    def invalid(self, rng, s, gz_tok, md):
        g = self.pb.g
        case = rng.randrange(7)
        expect = grpc.StatusCode.INVALID_ARGUMENT
        try:
            if case == 0:
                list(s["generate"](g.GenerateRequest(prompt="Hi", max_new_tokens=0), timeout=30,
                                   metadata=md))
            elif case == 1:
                list(s["generate"](g.GenerateRequest(prompt="Hi " * 2000, max_new_tokens=8),
                                   timeout=30, metadata=md))
            elif case == 2:
                list(s["generate_raw"](bytes(rng.randrange(256) for _ in range(24)), timeout=30,
                                       metadata=md))
            elif case == 3:
                list(s["generate_raw"](field(1, b"Hi \xff") + b"\x18\x04", timeout=30,
                                       metadata=md))
            elif case == 4:
                list(s["generate"](g.GenerateRequest(prompt_token_ids=[9999], max_new_tokens=4),
                                   timeout=30, metadata=md))
            elif case == 5:
                expect = grpc.StatusCode.UNAUTHENTICATED
                list(s["generate"](g.GenerateRequest(prompt="Hi", max_new_tokens=4), timeout=30,
                                   metadata=[("authorization", "Bearer not-a-key")]))
            else:
                expect = grpc.StatusCode.UNIMPLEMENTED
                gz_tok(g.TokenizeRequest(text="x" * 100), timeout=30, metadata=md)
        except grpc.RpcError as e:
            if e.code() == expect:
                self.count("invalid", "refused")
                return
            raise
        if case == 2:
            self.count("invalid", "parsed")  # random bytes that formed a valid request
            return
        self.fail("invalid: case %d was accepted" % case)

    def privacy(self, rng, s, tenant):
        """A fresh prompt (never sent before) from `tenant`, then from one
        outside its prefix-cache partition: the second finds nothing cached,
        whatever the first left in the cache."""
        other = rng.choice([t for t in ("t-a", "t-b", "t-c") if t not in PARTITION[tenant]])
        r = self.pb.g.GenerateRequest(max_new_tokens=2)
        r.prompt_token_ids.extend([1] + [rng.randrange(3, 512) for _ in range(63)])
        cached = []
        for who in (tenant, other):
            md = [("authorization", "Bearer " + TENANTS[who][0])]
            _, last = self.run_stream(s["generate"](r, timeout=120, metadata=md))
            cached.append(last.usage.cached_prompt_tokens)
        if cached[1] != 0:
            self.fail("privacy: %s found %d tokens of %s's prompt cached"
                      % (other, cached[1], tenant))
        else:
            self.count("privacy", "ok")

    def budget(self, rng, s, md):
        """The small budget (1500 tokens a minute): a call for 2 samples of
        up to 100 tokens runs or is refused with a wait; one that could never
        fit is refused for good."""
        g = self.pb.g
        never = rng.random() < 0.2
        r = g.GenerateRequest(prompt=rng.choice(PROMPTS), max_new_tokens=200 if never else 100,
                              n=8 if never else 2)
        try:
            self.run_stream(s["generate"](r, timeout=120, metadata=md))
        except grpc.RpcError as e:
            pushback = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            if never and (pushback != "-1" or "tokens per minute" not in e.details()):
                self.fail("budget: a call larger than the budget got %r, pushback %s"
                          % (e.details(), pushback))
            elif not never and not int(pushback or 0) > 0:
                self.fail("budget: refused without a wait: %r" % e.details())
            else:
                self.count("budget", "refused")
            return
        if never:
            self.fail("budget: a call larger than a minute's budget ran")
        else:
            self.count("budget", "ok")

    def staller(self, rng):
        """Now and then, a client that stops reading (tests/service/h2_client.py)."""
        from h2_client import StalledClient
        while not self.stop.wait(rng.uniform(5, 15)):
            # Sampled, so that it rarely ends early on EOS: it must still be
            # generating when the server's 200 ms stall timeout passes.
            request = self.pb.g.GenerateRequest(prompt=rng.choice(PROMPTS), max_new_tokens=450)
            request.sampling.temperature = 1.0
            payload = request.SerializeToString()
            client = StalledClient(self.address, payload,
                                   [("authorization", "Bearer " + TENANTS["t-a"][0])])
            # Ended by the server if it was still generating when the stall
            # timeout passed; otherwise it finished first, its slot free, and
            # only its last message waits (until the connection ages out).
            deadline = time.monotonic() + 30
            while not client.reset.wait(0.2) and time.monotonic() < deadline \
                    and not self.stop.is_set():
                pass
            self.count("stall", "ended" if client.reset.is_set() else "finished first")
            client.close()

    # -- the run -------------------------------------------------------------
    def run(self):
        self.start_server()
        ch = self.channel()
        s = self.stubs(ch)
        md = [("authorization", "Bearer " + TENANTS["t-a"][0])]
        self.reqs = self.exact_requests()
        self.refs = [self.run_stream(s["generate"](r, timeout=120, metadata=md))[0]
                     for r in self.reqs]
        # Each sample alone: the request with the sample's seed.
        self.samples_req = self.samples_request()
        self.sample_refs = {}
        for i in range(self.samples_req.n):
            alone = self.pb.g.GenerateRequest()
            alone.CopyFrom(self.samples_req)
            alone.n = 1
            alone.sampling.seed = self.samples_req.sampling.seed + i
            self.sample_refs[i] = self.run_stream(s["generate"](alone, timeout=120,
                                                                metadata=md))[0]
        ch.close()
        t0 = time.monotonic()
        self.sample(t0)
        threads = [threading.Thread(target=self.worker, args=(self.args.seed + i,), daemon=True)
                   for i in range(self.args.workers)]
        threads.append(threading.Thread(target=self.staller,
                                        args=(random.Random(self.args.seed),), daemon=True))
        for t in threads:
            t.start()
        next_report = t0 + 60
        while time.monotonic() - t0 < self.args.seconds:
            time.sleep(min(self.args.sample_every, max(0.1, self.args.seconds
                                                        - (time.monotonic() - t0))))
            self.sample(t0)
            if not self.server.running():
                self.fail("the server exited during the run (status %s)"
                          % self.server.proc.returncode)
                break
            if time.monotonic() >= next_report:
                next_report += 60
                _, rss, fds = self.samples[-1]
                print("%5.0f s: %d calls, %d unexpected, RSS %.1f MiB, %d fds"
                      % (time.monotonic() - t0, sum(self.counts.values()),
                         self.counts.get(("unexpected", ""), 0), rss / 1024, fds), flush=True)
        self.stop.set()
        for t in threads:
            t.join(120)
        return self.finish(t0)

    def finish(self, t0):
        elapsed = time.monotonic() - t0
        checks = []
        # Idle: nothing running or waiting, no KV block held.
        idle, m = False, {}
        for _ in range(300):
            m = self.metrics()
            if (m.get("coalesce_requests_running") == 0 and m.get("coalesce_requests_waiting") == 0
                    and m.get('coalesce_kv_cache_blocks{state="used"}') == 0):
                idle = True
                break
            time.sleep(0.1)
        checks.append(("back to idle, no KV block held", idle))
        checks.append(("no unexpected outcome or changed output",
                       self.counts.get(("unexpected", ""), 0) == 0))
        q = max(1, len(self.samples) // 4)
        second, last = self.samples[q:2 * q], self.samples[-q:]
        rss_mid = statistics.median(r for _, r, _ in second) if second else 0
        rss_end = statistics.median(r for _, r, _ in last)
        fds_mid = max(f for _, _, f in second) if second else 0
        fds_end = max(f for _, _, f in last)
        checks.append(("RSS on a plateau (%.1f -> %.1f MiB)" % (rss_mid / 1024, rss_end / 1024),
                       rss_end <= rss_mid * 1.10 + 8 * 1024))
        checks.append(("file descriptors on a plateau (%d -> %d)" % (fds_mid, fds_end),
                       fds_end <= fds_mid + 8))
        rc = self.server.stop(grace_s=30)
        if rc is None:
            rc = "timeout"
        checks.append(("clean exit on SIGTERM (status %s)" % rc, rc == 0))
        report = {
            "seconds": round(elapsed, 1),
            "workers": self.args.workers,
            "calls": {"%s/%s" % k: v for k, v in sorted(self.counts.items())},
            "generated_tokens": m.get("coalesce_generated_tokens_total"),
            "preemptions": m.get("coalesce_preemptions_total"),
            "admission_preemptions": {k: v for k, v in m.items()
                                      if k.startswith("coalesce_admission_preemptions_total")},
            "stalled_streams": m.get("coalesce_stalled_streams_total"),
            "rss_mib": {"start": round(self.samples[0][1] / 1024, 1),
                        "second_quarter_median": round(rss_mid / 1024, 1),
                        "last_quarter_median": round(rss_end / 1024, 1),
                        "max": round(max(r for _, r, _ in self.samples) / 1024, 1)},
            "fds": {"start": self.samples[0][2], "second_quarter_max": fds_mid,
                    "last_quarter_max": fds_end},
            "checks": {name: ok for name, ok in checks},
            "failures": self.failures,
        }
        print(json.dumps(report, indent=2))
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(report, f, indent=2)
        ok = all(ok for _, ok in checks)
        print("soak %s: %.0f s, %d calls" % ("passed" if ok else "FAILED", elapsed,
                                             sum(self.counts.values())))
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--workers", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sample_every", type=float, default=5)
    ap.add_argument("--server", default=os.environ.get("COALESCE_SERVER")
                    or os.path.join(REPO, "build", "bin", "coalesce-server"))
    ap.add_argument("--server_flag", action="append", default=[],
                    help="one more coalesce-server flag (repeatable)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="coalesce-soak-") as workdir:
        args.workdir = workdir
        desc = os.path.join(workdir, "coalesce.desc")
        compile_descriptors(desc)
        soak = Soak(args, load_stubs(desc))
        try:
            rc = soak.run()
        finally:
            if soak.__dict__.get("server") is not None:
                soak.server.kill()
        if rc != 0:
            lines = soak.server.log().splitlines()
            print("---- last server log lines ----\n" + "\n".join(lines[-40:]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
