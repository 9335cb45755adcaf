"""Black-box end-to-end tests of coalesce-server.

Starts the real binary on the real stories260K model and talks to it over
gRPC and its Prometheus endpoint only. Run with Debian's interpreter, which
has python3-grpcio, python3-protobuf and python3-pytest:

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_server_e2e.py

Environment: see e2e_support (COALESCE_SERVER, COALESCE_MODELS_DIR,
COALESCE_SERVER_FLAGS, COALESCE_E2E_DESCRIPTORS).
"""

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from e2e_support import *  # noqa: F401,F403  the shared server, client and metrics helpers

# ---------------------------------------------------------------------------
# Servers (one per flag set)
# ---------------------------------------------------------------------------

def _serve(pb, flags, started_line=None):
    """Yields a client of a server started with `flags` (whose log, when
    `started_line` is given, must say so), and stops it afterwards."""
    server, client = start_server(flags)
    if started_line is not None:
        assert wait_for(lambda: started_line in server.log(), 5), server.log()
    client.bind(pb)
    yield client
    client.close()
    server.kill()


@pytest.fixture(scope="module")
def srv(pb):
    """The default server (no window, 16 slots), with a 64 KiB message limit."""
    yield from _serve(pb, ["--max_request_bytes=65536"])


@pytest.fixture(scope="module")
def batch_srv(pb):
    yield from _serve(pb, ["--batch_window=200ms", "--max_batch_size=8"])


@pytest.fixture(scope="module", params=["static", "static_padded"])
def static_srv(pb, request):
    yield from _serve(pb, ["--batching=" + request.param, "--batch_window=50ms"])


@pytest.fixture(scope="module")
def overlap_srv(pb):
    """Steps on their own thread while the engine thread streams (--overlap_steps=on)."""
    yield from _serve(pb, ["--overlap_steps=on"], "overlap_steps on")


@pytest.fixture(scope="module")
def one_thread_srv(pb):
    """Steps on the engine thread (--overlap_steps=off)."""
    yield from _serve(pb, ["--overlap_steps=off"], "overlap_steps off")


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


def test_overlapped_steps_stream_the_same_tokens(one_thread_srv, overlap_srv, golden):
    """--overlap_steps=on changes when tokens are handed to the streams, never
    which: the mixed batch gives each request what a server without overlap
    gives it alone, twice, and a cancelled request still frees its slot."""
    reqs = _mixed_requests(one_thread_srv, golden)
    solo = [one_thread_srv.generate(r) for _, r, _ in reqs]
    for round_ in range(2):
        together = run_concurrently([lambda r=r: overlap_srv.generate(r) for _, r, _ in reqs])
        for i, ((kind, _, case), alone, res) in enumerate(zip(reqs, solo, together)):
            label = "overlap round %d request %d (%s)" % (round_, i, kind)
            assert res.code is None, "%s: %r" % (label, res)
            assert (res.ids, res.text, res.finish) == (alone.ids, alone.text, alone.finish), label
            assert len(res.msgs) >= 2, label  # streamed, not delivered in one piece
            if case is not None:
                assert_golden(res, case, label)
    case = golden[0]
    call = overlap_srv.generate_call(
        overlap_srv.request(prompt=case["prompt"], max_new_tokens=CONTEXT - 5))
    got = []
    for msg in call:
        got.extend(msg.token_ids)
        if len(got) >= 3:
            break
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        for msg in call:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert got[:3] == case["output_ids"][:3]
    after = wait_idle(overlap_srv)
    assert after.get("coalesce_kv_cache_blocks", state="used") == 0


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

def test_cancel_frees_slot(srv, golden):
    before = wait_idle(srv)
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
    after = wait_idle(srv)
    assert after.get("coalesce_requests_total", status="cancelled") == cancelled_before + 1
    assert after.get("coalesce_requests_total", status="ok") == ok_before + load.ok_count()
    # The server still serves.
    assert_golden(srv.generate(srv.request(prompt=case["prompt"], max_new_tokens=124)),
                  case, "after cancel")


# A client of its own process: opens `n` streams of one serialized
# GenerateRequest, prints a line as each gets its first message, and then
# waits to be killed.
_DYING_CLIENT = r"""
import sys, threading, time, grpc
address, request, n = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
channel = grpc.insecure_channel(address)
generate = channel.unary_stream("/coalesce.v1.Generator/Generate",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)
lock = threading.Lock()
def stream():
    for i, _ in enumerate(generate(request, timeout=60)):
        if i == 0:
            with lock:
                sys.stdout.write("streaming\n")
                sys.stdout.flush()
for _ in range(n):
    threading.Thread(target=stream, daemon=True).start()
time.sleep(60)
"""


def test_client_killed_mid_stream_ends_its_requests(srv, golden):
    """A client that dies mid-stream (its process killed: the connection just
    closes, no cancellation is sent) does not take the server down, and its
    generations stop within a step instead of running on: each counted
    cancelled, its slot and KV blocks freed, while other streams go on."""
    before = wait_idle(srv)
    cancelled_before = before.get("coalesce_requests_total", status="cancelled")
    ok_before = before.get("coalesce_requests_total", status="ok")
    case = golden[0]
    # Long (342 tokens, then EOS): still running when the client dies.
    req = srv.request(prompt=case["prompt"], max_new_tokens=CONTEXT - 5)
    n = 4
    with BackgroundLoad(srv) as load:
        child = subprocess.Popen(
            [sys.executable, "-c", _DYING_CLIENT, srv.server.address,
             req.SerializeToString().hex(), str(n)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for _ in range(n):
                line = child.stdout.readline()
                assert line == "streaming\n", "the client's stream did not start: %r" % line
            child.kill()
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
        assert wait_for(lambda: srv.metrics().get("coalesce_requests_total", status="cancelled")
                        == cancelled_before + n, 10), "the dead client's requests did not end"
    after = wait_idle(srv)
    assert after.get("coalesce_requests_total", status="cancelled") == cancelled_before + n
    # Every other request of the run succeeded, with its solo output (BackgroundLoad).
    assert after.get("coalesce_requests_total", status="ok") == ok_before + load.ok_count()
    assert_golden(srv.generate(srv.request(prompt=case["prompt"], max_new_tokens=124)),
                  case, "after the client died")


def test_deadline_exceeded_while_running_frees_slot(srv, golden):
    before = wait_idle(srv)
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
    after = wait_idle(srv)
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
    before = wait_idle(c)
    dl_before = before.get("coalesce_requests_total", status="deadline_exceeded")
    res = c.generate(c.request(prompt=golden[0]["prompt"], max_new_tokens=50), timeout=0.1)
    assert res.code == grpc.StatusCode.DEADLINE_EXCEEDED, res
    assert res.ids == []
    after = wait_idle(c)
    assert after.get("coalesce_requests_total", status="deadline_exceeded") == dl_before + 1
    # Nothing of it ran: it never reached the engine's batch.
    assert after.get("coalesce_generated_tokens_total") == before.get(
        "coalesce_generated_tokens_total")
    res = c.generate(c.request(prompt=golden[0]["prompt"], max_new_tokens=50))
    assert res.ids == golden[0]["output_ids"][:50]


# ---------------------------------------------------------------------------
# 5. Bad inputs
# ---------------------------------------------------------------------------

def test_empty_prompt_is_unconditional_generation_from_bos(srv):
    """No prompt and no ids (proto3 cannot tell an empty prompt from none):
    generation from BOS alone, as llama2.c and transformers allow; the same
    tokens as prompt_token_ids=[BOS]."""
    bos = srv.info().bos_token_id
    for req in (srv.request(prompt="", max_new_tokens=12), srv.request(max_new_tokens=12)):
        res = srv.generate(req)
        assert res.code is None, res
        assert res.usage.prompt_tokens == 1, res
        assert res.ids == srv.generate(srv.request(ids=[bos], max_new_tokens=12)).ids
        assert len(res.ids) > 0


def test_bad_inputs(srv, golden):
    case = golden[0]
    INV = grpc.StatusCode.INVALID_ARGUMENT
    R = srv.request
    bad = [
        ("both", R(prompt="hi", ids=[1, 403], max_new_tokens=5), INV,
         ["exactly one", "prompt_token_ids"]),
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

    before = wait_idle(srv)
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

    after = wait_idle(srv)
    assert after.get("coalesce_requests_total", status="invalid_argument") == inv_before + n_invalid
    # And afterwards the server still serves correctly.
    for c in golden:
        assert_golden(srv.generate(R(prompt=c["prompt"], max_new_tokens=len(c["output_ids"]))),
                      c, "after the bad inputs")
    after2 = wait_idle(srv)
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
    assert info.backend in EXPECTED_BACKENDS, (info.backend, EXPECTED_BACKENDS)
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
    before = wait_idle(c)
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
    after = wait_idle(c)

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
    before = wait_idle(c)
    res = c.generate(c.request(prompt=golden[0]["prompt"], max_new_tokens=5))
    assert res.ids == golden[0]["output_ids"][:5]
    # Alone, it may only start when the 200 ms window closes (rule c).
    assert res.times[0] >= 0.19, "first token after %.3f s" % res.times[0]
    assert res.times[0] < 5.0
    after = wait_idle(c)
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
    server, client = start_server(["--grace_period=20s"])
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
    server, client = start_server([])
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


# ---------------------------------------------------------------------------
# 13. A lost device (simulated with the testing-only --fault_injection)
# ---------------------------------------------------------------------------

def test_device_lost_fails_requests_reports_not_serving_and_exits(pb, golden):
    """Every engine step after the 60th fails as a GPU whose context is gone
    does. The running stream ends with INTERNAL after its 60 tokens, a request
    that was queued but never ran gets UNAVAILABLE, one sent after the loss is
    refused, health turns NOT_SERVING, and the process exits with a non-zero
    code within seconds (so Kubernetes restarts it).

    The queued request must be in the engine's queue before the loss, which
    comes 60 fast steps after the running request starts: it is sent first,
    and held there, without a single step, until the loss. The coalescing
    window holds it alone (2 slots); the running one then joins it, is
    admitted first (higher priority), and takes a block of the 20-block KV
    cache, so the queued one (a 310-token prompt: all 20 blocks) cannot
    follow. Sent after the running one had started instead, it could reach
    the server just as the shutdown begins, and gRPC itself then cancels it
    (see the late request below)."""
    steps = 60
    # stories260K: 1280 bytes of KV cache per token, 20 blocks of 16 tokens.
    server, client = start_server(["--fault_injection=device_lost_after_steps:%d" % steps,
                                   "--max_batch_size=2", "--batch_window=30s",
                                   "--kv_cache_memory=400KiB", "--kv_block_size=16",
                                   "--grace_period=30s"])
    try:
        client.bind(pb)
        assert "TESTING" in server.log(), "the fault injection is not in the start-up log"
        assert "KV cache: 20 blocks of 16 tokens" in server.log()
        health = client.pb.health.HealthCheckResponse
        watch = client.health_watch(timeout=30)
        statuses = iter(watch)
        assert next(statuses).status == health.SERVING
        waiting = client.generate_call(
            client.request(ids=[10 + i % 400 for i in range(310)], max_new_tokens=5), timeout=30)
        assert wait_for(lambda: client.metrics().get("coalesce_requests_waiting") == 1, 10), \
            "the request to be left waiting never reached the engine's queue"
        case = golden[0]
        running = client.generate_call(
            client.request(prompt=case["prompt"], max_new_tokens=300, priority=1), timeout=30)
        msgs = []
        with pytest.raises(grpc.RpcError) as failed:
            for m in running:
                msgs.append(m)
        t_lost = time.monotonic()
        assert failed.value.code() == grpc.StatusCode.INTERNAL, failed.value
        # Every successful step made one token of the stream, as the golden
        # says; tokens not yet written when the error came are dropped (an
        # error replaces the final message), so the client saw at most that.
        ids = [t for m in msgs for t in m.token_ids]
        assert 1 <= len(ids) <= steps and ids == case["output_ids"][:len(ids)], ids
        with pytest.raises(grpc.RpcError) as refused:
            list(waiting)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "before this request ran" in refused.value.details(), refused.value
        # A request sent now is refused without running: UNAVAILABLE (by the
        # engine loop, or the connection), or CANCELLED when it reaches the
        # server's gRPC layer as the shutdown begins and gRPC cancels it
        # before the service sees it (grpc/grpc#41785); both are retryable
        # under the policy deploy/README.md recommends.
        late = client.generate(client.request(prompt="Tim", max_new_tokens=5), timeout=10)
        assert late.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), late
        assert late.msgs == [], late
        # Health: NOT_SERVING for every service, seen by the open Watch.
        assert next(statuses).status == health.NOT_SERVING
        watch.cancel()
        rc = server.proc.wait(15)
        assert rc != 0 and rc == 3, "exit code %s" % rc
        assert time.monotonic() - t_lost < 8, "took %.1f s to exit" % (time.monotonic() - t_lost)
        log = server.log()
        assert "device lost" in log
        assert "stopped after a lost device" in log
    finally:
        client.close()
        server.kill()
