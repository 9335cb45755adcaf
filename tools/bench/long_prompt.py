#!/usr/bin/env python3
"""What a long prompt does to the streams already decoding, measured: the
decoders' worst gap between two tokens before a long prompt arrives and while
it is prefilled, and the long prompt's time to first token, with the engine
loop's step time target (--max_step_time) and without it (0: only
--max_batch_tokens bounds a step, the scheduling of earlier releases).

Each configuration is one server (SmolLM2-135M-Instruct by default). In it:
--streams streams decode (short distinct prompts, ignore_eos) for --settle
seconds (the worst gap then is 'before'); then one prompt of
--prompt_tokens random tokens arrives with max_new_tokens 1, and the worst
gap of any decoder from its arrival to its first token is 'during'; then the
same with prompt_logprobs. 'alone' is the long prompt's time to first token
with nothing else running. The server logs each step (--log_steps): the
prompt chunks of the steps beside decodes and those steps' times are printed
too.

The targets: during <= 2 x before + 250 ms (`bound`) with the time target,
and the long prompt's time to first token at most 1.5x what an earlier
build's took: --baseline_bin runs a third configuration with that build's
server (which has no --max_step_time), in the same run, and `vs base` is the
ratio to it; `vs off` is the ratio to this build without the target.

Run after tools/build.sh (tools/models/smollm2.py fetches the model once):
    python3 tools/bench/long_prompt.py [--model PATH] [--prompt_tokens 4096] [--streams 8]
Prints a table and, with --json FILE, writes every run's figures.
"""

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "service"))
sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
sys.path.insert(0, os.path.join(REPO, "tools", "models"))
from coalesce_harness import ServerProcess  # noqa: E402
from e2e_protos import compile_descriptors, load_stubs  # noqa: E402

STEP_RE = re.compile(r"step: seqs=\d+ decode_tokens=(\d+) prefill_tokens=(\d+) .* ms=([0-9.]+)")


class Client:
    def __init__(self, address, pb):
        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.generate = self.channel.unary_stream(
            "/coalesce.v1.Generator/Generate",
            request_serializer=pb.g.GenerateRequest.SerializeToString,
            response_deserializer=pb.g.GenerateResponse.FromString)
        self.info = self.channel.unary_unary(
            "/coalesce.v1.Generator/GetModelInfo",
            request_serializer=pb.g.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.g.ModelInfo.FromString)(pb.g.GetModelInfoRequest())

    def request(self, ids, max_new_tokens, prompt_logprobs=False):
        r = self.pb.g.GenerateRequest(max_new_tokens=max_new_tokens,
                                      prompt_logprobs=prompt_logprobs)
        r.prompt_token_ids.extend(ids)
        r.sampling.ignore_eos = True
        return r

    def first_token_time(self, req):
        """Seconds from the call to its first token."""
        start = time.monotonic()
        for _ in self.generate(req, timeout=600):
            return time.monotonic() - start
        raise RuntimeError("no token")


class Decoder(threading.Thread):
    """One stream: the arrival time of each of its messages."""

    def __init__(self, client, req):
        super().__init__(daemon=True)
        self.call = client.generate(req, timeout=3600)
        self.times = []

    def run(self):
        try:
            for _ in self.call:
                self.times.append(time.monotonic())
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
        self.ended = True

    error = None
    ended = False

    def worst_gap(self, start, end):
        """The longest wait for a token that ended within [start, end], the
        wait still going on at `end` included (call it once `end` is past)."""
        times = list(self.times)
        gaps = [b - a for a, b in zip(times, times[1:]) if start <= b <= end]
        last = max((t for t in times if t <= end), default=start)
        gaps.append(end - last)
        return max(gaps)


def random_prompt(rng, vocab, n):
    return [rng.randrange(100, vocab) for _ in range(n)]


def run_config(name, binary, flags, args, pb):
    log_path = os.path.join(args.workdir, name.replace(" ", "_") + ".log")
    # One channel for the whole run: no GOAWAY after --max_connection_age.
    server = ServerProcess(binary, ["--model=" + args.model, "--batch_window=0",
                                    "--max_batch_size=%d" % args.max_batch_size,
                                    "--max_connection_age=inf", "--log_steps",
                                    "--log_level=debug"] + flags,
                           log_path=log_path, start_timeout_s=300)
    try:
        client = Client(server.address, pb)
        vocab = client.info.vocab_size
        rng = random.Random(7)
        out = {"config": name, "flags": flags}
        # The long prompt alone.
        out["alone_ttft"] = client.first_token_time(
            client.request(random_prompt(rng, vocab, args.prompt_tokens), 1))
        # Decoders that outlast the run: as many tokens as the context holds.
        budget = client.info.context_length - 32
        decoders = [Decoder(client, client.request(random_prompt(rng, vocab, 32), budget))
                    for _ in range(args.streams)]
        for d in decoders:
            d.start()
        while min(len(d.times) for d in decoders) < 3:
            if any(d.ended for d in decoders):
                raise SystemExit("a decoder ended: %s" % next(d.error for d in decoders if d.ended))
            time.sleep(0.05)
        t0 = time.monotonic()
        time.sleep(args.settle)
        t1 = time.monotonic()
        out["before"] = max(d.worst_gap(t0, t1) for d in decoders)
        for variant, logprobs in (("plain", False), ("prompt_logprobs", True)):
            mark = server.log_len()
            req = client.request(random_prompt(rng, vocab, args.prompt_tokens), 1, logprobs)
            start = time.monotonic()
            ttft = client.first_token_time(req)
            end = start + ttft
            # The decoders' next tokens (for the gaps until `end`) and the
            # server's step lines (logged as the steps end) come in meanwhile.
            time.sleep(args.settle / 2)
            steps = [tuple(float(x) for x in m.groups())
                     for m in map(STEP_RE.search, server.log(mark).splitlines()) if m]
            beside = [(p, ms) for d, p, ms in steps if d > 0 and p > 0]
            out[variant] = {
                "ttft": ttft,
                "during": max(d.worst_gap(start, end) for d in decoders),
                "chunks": [int(p) for p, _ in beside],
                "step_ms": [ms for _, ms in beside],
            }
        if any(d.ended for d in decoders):
            raise SystemExit("a decoder ended before the run did: %s"
                             % next(d.error for d in decoders if d.ended))
        for d in decoders:
            d.call.cancel()
        for d in decoders:
            d.join(30)
        client.channel.close()
        return out
    finally:
        server.stop()


def summary(values):
    if not values:
        return "-"
    return "%g / %g / %g" % (min(values), statistics.median(values), max(values))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="default: SmolLM2-135M-Instruct (tools/models/smollm2.py)")
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin"))
    ap.add_argument("--baseline_bin", help="another build's bin folder, run without the target")
    ap.add_argument("--prompt_tokens", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max_batch_size", type=int, default=16)
    ap.add_argument("--settle", type=float, default=4.0, help="seconds of decoding alone")
    ap.add_argument("--max_step_time", help="the target's (default: the server's default)")
    ap.add_argument("--server_flag", action="append", default=[],
                    help="a flag for every server (repeat)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.model is None:
        import smollm2
        args.model = str(smollm2.fetch(os.path.join(REPO, "build", "models")))
    with tempfile.TemporaryDirectory(prefix="coalesce-long-prompt-") as workdir:
        args.workdir = workdir
        desc = os.path.join(workdir, "api.desc")
        compile_descriptors(desc)
        pb = load_stubs(desc)
        server = os.path.join(args.bin, "coalesce-server")
        target = ["--max_step_time=" + args.max_step_time] if args.max_step_time else []
        configs = [("target", server, target), ("off", server, ["--max_step_time=0"])]
        if args.baseline_bin:
            configs.append(("baseline", os.path.join(args.baseline_bin, "coalesce-server"), []))
        results = [run_config(name, binary, args.server_flag + flags, args, pb)
                   for name, binary, flags in configs]
    off = next(r for r in results if r["config"] == "off")
    base = next((r for r in results if r["config"] == "baseline"), None)
    print("%d streams decoding, a %d-token prompt arrives (%s)" %
          (args.streams, args.prompt_tokens, os.path.basename(args.model)))
    print("%-9s %-16s %7s %8s %8s %9s %8s %9s  %-20s %s" % (
        "config", "prompt", "before", "during", "bound", "ttft", "vs off", "vs base",
        "chunks beside decodes", "their step ms (min / median / max)"))
    for r in results:
        for variant in ("plain", "prompt_logprobs"):
            v = r[variant]
            bound = 2 * r["before"] + 0.25
            print("%-9s %-16s %6.3fs %7.3fs %7.3fs %8.2fs %7.2fx %9s  %-20s %s" % (
                r["config"], variant, r["before"], v["during"], bound, v["ttft"],
                v["ttft"] / off[variant]["ttft"],
                "%.2fx" % (v["ttft"] / base[variant]["ttft"]) if base else "-",
                summary(v["chunks"]), summary(v["step_ms"])))
        print("%-9s %-16s %33.2fs" % (r["config"], "alone", r["alone_ttft"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "workdir"},
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
