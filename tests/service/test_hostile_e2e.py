"""Unusual and hostile traffic against the real server: each test is one way
a client (careless or malicious) once hurt it, and checks that it no longer
does and that nothing else was disturbed.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_hostile_e2e.py

Besides grpcio, some tests speak raw HTTP/2 (python3-h2) to be a client that
gRPC's own library would never be: one that stops reading.
"""

import gzip
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from e2e_support import (MODELS, SERVER, coalesce_harness, die_with_parent, run_concurrently,
                         start_server, time_to_close, wait_for, wait_idle)
from h2_client import StalledClient

HERE = os.path.dirname(os.path.abspath(__file__))


def serve(pb, flags, model_flags=None):
    server, client = start_server(flags, model_flags)
    client.bind(pb)
    return server, client


def stop(server, client):
    client.close()
    server.kill()


def status_kib(server, field):
    with open("/proc/%d/status" % server.proc.pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError("no %s in /proc/%d/status" % (field, server.proc.pid))


def raw_call(client, method, payload, stream, timeout=30):
    """Sends `payload` bytes as the request of `method` (a Generator method,
    or a whole path such as /grpc.health.v1.Health/Check) with no
    serialization; returns (code, details) of the result, code None on
    success."""
    path = method if method.startswith("/") else "/coalesce.v1.Generator/" + method
    ident = lambda b: b  # noqa: E731
    if stream:
        call = client.channel.unary_stream(path, request_serializer=ident,
                                           response_deserializer=ident)
        try:
            list(call(payload, timeout=timeout))
        except grpc.RpcError as e:
            return e.code(), e.details()
    else:
        call = client.channel.unary_unary(path, request_serializer=ident,
                                          response_deserializer=ident)
        try:
            call(payload, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return None, None


def field(number, payload):
    """A length-delimited protobuf field (wire type 2)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def varint_field(number, value):
    assert value < 128
    return bytes([number << 3, value])


def varint(value):
    """An unsigned varint: 7 bits a byte, low bits first."""
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


# ---------------------------------------------------------------------------
# 1. A batch that ends in its first step leaves no slot idle
# ---------------------------------------------------------------------------

def test_queue_drains_when_every_request_ends_in_its_first_step(pb):
    """48 one-token requests, 4 slots: every admitted batch finishes in the
    step it joins. Aging is off and the queue timeout an hour away, so the
    only thing that can admit the next four is the loop noticing the slots
    the last four freed. It once slept until the next timed event instead."""
    server, c = serve(pb, ["--max_batch_size=4", "--priority_aging=0", "--max_queue_wait=1h"])
    try:
        req = c.request(prompt="Once upon a time", max_new_tokens=1)
        results = run_concurrently([lambda: c.generate(req, timeout=30) for _ in range(48)])
        for r in results:
            assert r.code is None, r
            assert r.usage.completion_tokens == 1, r
        wait_idle(c)
    finally:
        stop(server, c)


# ---------------------------------------------------------------------------
# 2. Large prompts: refused before they are tokenized, never block streams
# ---------------------------------------------------------------------------

# Bytes: under the 4 MiB message limit. tools/tsan.sh sets a quarter of it:
# under ThreadSanitizer the tokenizer runs many times slower, and a quarter
# still takes seconds to tokenize there.
BIG = int(os.environ.get("COALESCE_E2E_BIG_TEXT_BYTES", 3_900_000))


def big_text(seed):
    words = ["Once", "upon", "a", "time", "little", "girl", "named", "Lily", "sun", "the"]
    out, i, size = [], seed, 0
    while size < BIG:
        out.append(words[i % len(words)])
        size += len(out[-1]) + 1
        i = (i * 7 + 3) % 1000003
    return " ".join(out)[:BIG]


def big_channel(server, pb):
    """A channel for 3.9 MB texts and their tokens, and its Tokenize call."""
    ch = grpc.insecure_channel(server.address, options=[
        ("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    return ch, ch.unary_unary("/coalesce.v1.Generator/Tokenize",
                              request_serializer=pb.g.TokenizeRequest.SerializeToString,
                              response_deserializer=pb.g.TokenizeResponse.FromString)


@pytest.mark.parametrize("model", ["llama2c", "tokenizer.json"])
def test_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(pb, model):
    """A 3.9 MB prompt cannot fit a 512-token context. Refusing it must take
    a fraction of the time that tokenizing it takes (Tokenize, which must
    tokenize all of it, measured in the same run)."""
    flags = None
    if model == "tokenizer.json":
        flags = ["--model=" + os.path.join(MODELS, "stories260K-hf")]
    server, c = serve(pb, ["--max_request_bytes=8388608"], flags)
    ch, tokenize = big_channel(server, pb)
    try:
        text = big_text(1)
        generate = ch.unary_stream("/coalesce.v1.Generator/Generate",
                                   request_serializer=pb.g.GenerateRequest.SerializeToString,
                                   response_deserializer=pb.g.GenerateResponse.FromString)
        full, refuse = [], []
        for _ in range(3):
            t0 = time.monotonic()
            n = len(tokenize(pb.g.TokenizeRequest(text=text, add_special_tokens=True),
                             timeout=120).token_ids)
            full.append(time.monotonic() - t0)
            assert n > 512
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(generate(pb.g.GenerateRequest(prompt=text, max_new_tokens=8), timeout=120))
            refuse.append(time.monotonic() - t0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "exceeds the context length" in e.value.details(), e.value.details()
        # Both times include sending 3.9 MB; the best of three of each.
        print("tokenize %.3f s, refuse %.3f s" % (min(full), min(refuse)))
        assert min(refuse) < min(full) / 2, (full, refuse)
        assert c.metrics().get("coalesce_requests_rejected_total", reason="too_long") == 3
    finally:
        ch.close()
        stop(server, c)


SPAMMER = r"""
import sys, threading, time, grpc
sys.path.insert(0, sys.argv[1])
from e2e_protos import load_stubs
pb = load_stubs(sys.argv[2])
text, end = open(sys.argv[3]).read(), time.monotonic() + float(sys.argv[5])
ch = grpc.insecure_channel(sys.argv[4], options=[
    ("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 64 << 20)])
tok = ch.unary_unary("/coalesce.v1.Generator/Tokenize",
                     request_serializer=pb.g.TokenizeRequest.SerializeToString,
                     response_deserializer=pb.g.TokenizeResponse.FromString)
done = []
def spam():
    while time.monotonic() < end:
        tok(pb.g.TokenizeRequest(text=text), timeout=120)
        done.append(1)
threads = [threading.Thread(target=spam) for _ in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(done))
"""


def test_tokenizing_large_texts_does_not_stall_other_streams(pb, tmp_path):
    """Three clients keep the server tokenizing 3.9 MB texts (Tokenize must
    tokenize all of it) while a victim streams generations. The victim's
    longest wait for a message must stay well under the time one such text
    takes to tokenize, measured first in the same run. On gRPC's own threads
    the tokenizing froze every stream for that long."""
    server, c = serve(pb, ["--max_request_bytes=8388608"])
    ch, tokenize = big_channel(server, pb)
    try:
        text = big_text(2)
        alone = []
        for _ in range(2):
            t0 = time.monotonic()
            tokenize(pb.g.TokenizeRequest(text=text), timeout=120)
            alone.append(time.monotonic() - t0)
        one = min(alone)
        (tmp_path / "text").write_text(text)
        desc = tmp_path / "c.desc"
        from e2e_protos import compile_descriptors
        given = os.environ.get("COALESCE_E2E_DESCRIPTORS")
        if given:
            desc = given
        else:
            compile_descriptors(str(desc))
        seconds = max(4.0, 4 * one)
        # The attacker is another process: its Python must not slow the victim's.
        spammer = subprocess.Popen(die_with_parent([sys.executable, "-c", SPAMMER, HERE, str(desc),
                                                    str(tmp_path / "text"), server.address,
                                                    str(seconds)]),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(min(1.0, one))  # the first texts are being tokenized
        gaps, streams = [], 0
        end = time.monotonic() + seconds - 1.5 * min(1.0, one)
        while time.monotonic() < end:
            r = c.generate(c.request(prompt="Once upon a time", max_new_tokens=200))
            assert r.code is None, r
            gaps.append(max(b - a for a, b in zip([0.0] + r.times, r.times)))
            streams += 1
        out, err = spammer.communicate(timeout=120)
        assert spammer.returncode == 0, err.decode()
        print("tokenize alone %.3f s; attack %d texts; victim %d streams, longest gap %.3f s"
              % (one, int(out), streams, max(gaps)))
        assert int(out) >= 3, "the attack did not run"
        assert max(gaps) < one / 3, (one, sorted(gaps)[-5:])
        wait_idle(c)
    finally:
        ch.close()
        stop(server, c)


# ---------------------------------------------------------------------------
# 3. Compressed requests
# ---------------------------------------------------------------------------

def test_compressed_request_is_refused_before_it_is_inflated(pb):
    """A 128 MiB request compresses to about 128 KiB of gzip. Three at once
    once took the server to gigabytes; now they are refused without being
    inflated, and the server's peak memory does not move."""
    server, c = serve(pb, ["--device=null"])
    try:
        before = status_kib(server, "VmHWM")
        bomb = pb.g.GenerateRequest(prompt="a" * (128 << 20), max_new_tokens=4).SerializeToString()
        ch = grpc.insecure_channel(server.address, compression=grpc.Compression.Gzip,
                                   options=[("grpc.max_send_message_length", 1 << 30)])
        try:
            gen = ch.unary_stream("/coalesce.v1.Generator/Generate",
                                  request_serializer=lambda b: b, response_deserializer=lambda b: b)

            def send():
                try:
                    list(gen(bomb, timeout=60))
                except grpc.RpcError as e:
                    return e.code(), e.details()
                return None, None
            results = run_concurrently([send, send, send])
        finally:
            ch.close()
        for code, details in results:
            assert code == grpc.StatusCode.UNIMPLEMENTED, (code, details)
            assert "gzip" in details and "disabled" in details, details
        grown = status_kib(server, "VmHWM") - before
        print("3 x %d MiB compressed to %d KiB: peak memory grew by %d KiB"
              % (128, len(gzip.compress(bomb)) >> 10, grown))
        assert grown < 32 << 10, "peak memory grew by %d KiB" % grown
        res = c.generate(c.request(prompt="Once upon a time", max_new_tokens=4))
        assert res.code is None and len(res.ids) == 4, res
    finally:
        stop(server, c)


# ---------------------------------------------------------------------------
# 4. A busy port
# ---------------------------------------------------------------------------

def test_a_busy_port_is_a_start_up_error(pb):
    """gRPC would share a port with another process (SO_REUSEPORT), and new
    connections would be split between two servers."""
    server, c = serve(pb, [])
    try:
        second = subprocess.run(
            die_with_parent([SERVER, "--model=synthetic:tiny", "--device=null",
                             "--host=127.0.0.1", "--port=%d" % server.port, "--metrics_port=0"]),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, (second.returncode, second.stderr)
        assert re.search(r"cannot listen on 127\.0\.0\.1:%d: Address already in use"
                         % server.port, second.stderr), second.stderr
        assert "serving" not in second.stderr
        info = c.info()
        assert info.name != "synthetic:tiny", "the first server no longer answers"
    finally:
        stop(server, c)


# ---------------------------------------------------------------------------
# 5. Requests that do not parse
# ---------------------------------------------------------------------------

BAD_REQUESTS = [
    # (method, stream, payload, words the message must contain)
    ("Generate", True, field(1, b"Hi \xff there") + varint_field(3, 4),
     ["GenerateRequest", "field prompt", "UTF-8", "byte 3"]),
    ("Generate", True, field(1, b"Hi") + field(5, b"ok") + field(5, b"\xc0\xaf")
     + varint_field(3, 4), ["field stop[1]", "UTF-8"]),
    ("Generate", True, field(1, b"Hi") + field(6, b"id-\xed\xa0\x80") + varint_field(3, 4),
     ["field request_id", "UTF-8"]),
    ("Tokenize", False, field(1, b"\xf5\x80\x80\x80"), ["TokenizeRequest", "field text"]),
    ("Generate", True, b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
     ["GenerateRequest", "not a protobuf message"]),
    ("Generate", True, field(1, b"Once upon a time")[:-4], ["GenerateRequest", "truncated"]),
    ("Generate", True, bytes([4 << 3 | 2, 5]) + b"\x08\xff\xff\xff\xff",
     ["field sampling", "SamplingParams"]),
    ("Detokenize", False, b"\x0a\x05\x01\x02", ["DetokenizeRequest", "not a protobuf"]),
    ("GetModelInfo", False, b"\x07garbage", ["GetModelInfoRequest", "not a protobuf"]),
    # A token id beyond 32 bits: protobuf would keep its low 32 bits (2^40 is
    # token 0).
    ("Generate", True, field(2, varint(5) + varint(1 << 40)) + varint_field(3, 4),
     ["GenerateRequest", "field prompt_token_ids[1] is 1099511627776", "32 bits"]),
    ("Detokenize", False, field(1, varint(1 << 40)), ["field token_ids[0] is 1099511627776"]),
    ("Generate", True, field(1, b"Hi") + varint_field(3, 4) + field(4, field(11, varint(1 << 40))),
     ["field sampling.stop_token_ids[0]"]),
    # The health service parses its requests the same way.
    ("/grpc.health.v1.Health/Check", False, b"\x07garbage",
     ["grpc.health.v1.HealthCheckRequest", "not a protobuf"]),
    ("/grpc.health.v1.Health/Watch", True, field(1, b"\xff"),
     ["HealthCheckRequest", "field service", "UTF-8"]),
]


def test_unparseable_requests_get_invalid_argument_naming_the_problem(pb):
    server, c = serve(pb, [])
    try:
        background = c.generate_call(c.request(prompt="Once upon a time", max_new_tokens=400))
        first = next(iter(background))
        for method, stream, payload, words in BAD_REQUESTS:
            code, details = raw_call(c, method, payload, stream)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, code, details)
            for w in words:
                assert w in details, (method, payload, details)
        # Well-formed requests still work, and the stream that ran meanwhile
        # was not disturbed.
        rest = list(background)
        assert rest[-1].finish_reason in (1, 3), rest[-1]  # LENGTH or EOS
        assert (len(first.token_ids) + sum(len(m.token_ids) for m in rest)
                == rest[-1].usage.completion_tokens)
        assert c.tokenize("Hi", False)
        m = wait_idle(c)
        assert m.get("coalesce_requests_rejected_total", reason="invalid") >= 6
    finally:
        stop(server, c)


def test_a_flood_of_bad_requests_writes_a_bounded_log(pb):
    """Each bad request once wrote an unthrottled protobuf error line."""
    server, c = serve(pb, [])
    try:
        start = server.log_len()
        payload = field(1, b"\xff\xfe") + varint_field(3, 4)
        for _ in range(300):
            code, _ = raw_call(c, "Generate", payload, True)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        bomb_channel = grpc.insecure_channel(server.address, compression=grpc.Compression.Gzip)
        gzip_call = bomb_channel.unary_unary("/coalesce.v1.Generator/Tokenize",
                                             request_serializer=lambda b: b,
                                             response_deserializer=lambda b: b)
        for _ in range(100):
            with pytest.raises(grpc.RpcError):
                gzip_call(field(1, b"x" * 100), timeout=10)
        bomb_channel.close()
        time.sleep(0.5)
        lines = server.log(start).splitlines()
        assert len(lines) <= 20, "%d log lines for 400 bad requests:\n%s" % (
            len(lines), "\n".join(lines[:30]))
    finally:
        stop(server, c)


# ---------------------------------------------------------------------------
# 6-7. Shutdown
# ---------------------------------------------------------------------------

def test_streams_running_at_the_end_of_the_grace_period_get_their_final_message(pb):
    """Eight streams far longer than the 1 s grace period: each ends with the
    final message the API promises (FINISH_REASON_CANCELLED, usage counting
    every token it received), not an UNAVAILABLE error."""
    server, c = serve(pb, ["--grace_period=1s", "--max_batch_size=8"],
                      ["--model=synthetic:15m"])
    try:
        calls = [c.generate_call(c.request(prompt="Hello", max_new_tokens=2000)) for _ in range(8)]
        its = [iter(call) for call in calls]
        received = [list(m.token_ids) for m in (next(it) for it in its)]
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        lasts = []
        for it, ids in zip(its, received):
            last = None
            try:
                for m in it:
                    ids.extend(m.token_ids)
                    last = m
            except grpc.RpcError as e:
                pytest.fail("stream failed at the end of the grace period: %s %s"
                            % (e.code(), e.details()))
            lasts.append(last)
        for last, ids in zip(lasts, received):
            assert last is not None
            assert last.finish_reason == 4, last  # FINISH_REASON_CANCELLED
            assert last.usage.completion_tokens == len(ids) < 2000, (last.usage, len(ids))
            assert last.usage.prompt_tokens > 0
        rc = server.proc.wait(15)
        assert rc == 0
        assert time.monotonic() - t0 < 1 + 5 + 4, "exit %.1f s after SIGTERM" % (
            time.monotonic() - t0)
        assert "grace period over" in server.log()
    finally:
        stop(server, c)


def test_an_open_health_watch_does_not_hold_shutdown(pb):
    """Clients with client-side health checking keep a Watch open. With
    nothing generating, SIGTERM must not wait out the 30 s grace period: the
    Watch sees NOT_SERVING and ends."""
    server, c = serve(pb, ["--grace_period=30s"])
    try:
        health = pb.health.HealthCheckResponse
        watches = [c.health_watch(name, timeout=60) for name in ("", "coalesce.v1.Generator")]
        its = [iter(w) for w in watches]
        for it in its:
            assert next(it).status == health.SERVING
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for it in its:
            assert next(it).status == health.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                next(it)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert server.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        stop(server, c)


# ---------------------------------------------------------------------------
# 8. Smaller
# ---------------------------------------------------------------------------

def test_health_answers_for_the_generator_service(pb):
    server, c = serve(pb, [])
    try:
        health = pb.health.HealthCheckResponse
        assert c.health("") == health.SERVING
        assert c.health("coalesce.v1.Generator") == health.SERVING
        with pytest.raises(grpc.RpcError) as e:
            c.health("coalesce.v1.Nope")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "coalesce.v1.Generator" in e.value.details()
        watch = iter(c.health_watch("coalesce.v1.Nope", timeout=5))
        assert next(watch).status == health.SERVICE_UNKNOWN
    finally:
        stop(server, c)


def test_a_request_id_cannot_forge_log_lines(pb):
    """ASCII controls, and the Unicode ones a log viewer or terminal acts on
    too: NEL, the line and paragraph separators (each breaks a line for
    Python's splitlines and many viewers), the C1 CSI, and a right-to-left
    override that shows the rest of the line reversed."""
    server, c = serve(pb, ["--log_level=debug"])
    try:
        forged = "2026-01-01T00:00:00.000Z E forged"
        unicode = ["\u2028", "\u2029", "\x85", "\x9b", "\u202e"]
        request_id = "evil\n" + forged + "\r\x1b[2J" + "".join(u + forged for u in unicode)
        call = c.generate_call(c.request(prompt="Once upon a time", max_new_tokens=400,
                                         request_id=request_id))
        next(iter(call))
        call.cancel()
        assert wait_for(lambda: "evil\\n" + forged in server.log(), 5), server.log()
        assert "\\u2028" + forged in server.log(), server.log()
        for line in server.log().splitlines():
            assert not line.startswith(forged), line
            assert "\x1b" not in line and "\r" not in line, repr(line)
            for u in unicode:
                assert u not in line, repr(line)
        wait_idle(c)
    finally:
        stop(server, c)


def test_a_client_that_stops_reading_loses_its_slot(pb):
    """The engine keeps generating for a client that reads nothing. After
    --stream_stall_timeout (1 s here) its stream ends and its batch slot and
    KV blocks are free, though its connection is still open and alive;
    another client meanwhile streams undisturbed."""
    server, c = serve(pb, ["--stream_stall_timeout=1s"], ["--model=synthetic:15m"])
    stalled = None
    try:
        before = wait_idle(c)
        payload = c.request(prompt="Hello", max_new_tokens=1900).SerializeToString()
        stalled = StalledClient(server.address, payload)
        assert wait_for(lambda: c.metrics().get("coalesce_requests_running") == 1, 10)
        other = c.generate(c.request(prompt="Hi there", max_new_tokens=300))
        assert other.code is None and len(other.ids) == 300, other
        assert wait_for(lambda: c.metrics().get("coalesce_stalled_streams_total") == 1, 15), \
            "the stalled stream was not ended"
        after = wait_idle(c)
        generated = (after.get("coalesce_generated_tokens_total")
                     - before.get("coalesce_generated_tokens_total") - 300)
        assert generated < 1900, "the stalled stream ran to its end (%d tokens)" % generated
        assert (after.get("coalesce_requests_total", status="cancelled")
                == before.get("coalesce_requests_total", status="cancelled") + 1)
        assert stalled.reset.wait(10), "the stalled stream was not closed"
        assert "read nothing of its stream for 1s" in server.log()
    finally:
        if stalled is not None:
            stalled.close()
        stop(server, c)


# ---------------------------------------------------------------------------
# 9. Connections that hold descriptors: half-open, too many, slow
# ---------------------------------------------------------------------------

def open_raw(port, send=b"", source="127.0.0.1"):
    """A TCP connection to 127.0.0.1:port from `source`, having sent `send`."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    if send:
        s.sendall(send)
    return s


def test_half_open_connections_are_closed_at_the_handshake_timeout(pb):
    """A connection that sends nothing, only part of the HTTP/2 preface, or
    the preface without SETTINGS once held its descriptor and about 26 KB
    until keepalive gave up on it (40 s; over TLS 120 s, test_tls_e2e.py).
    With --handshake_timeout=1s each is closed after about a second."""
    server, c = serve(pb, ["--handshake_timeout=1s"])
    try:
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        socks = [open_raw(server.port), open_raw(server.port, preface[:10]),
                 open_raw(server.port, preface)]
        times = [time_to_close(s, 8)[0] for s in socks]
        print("half-open connections closed after %s s" % ["%.2f" % t if t else t for t in times])
        for t in times:
            assert t is not None and t < 4, times
        for s in socks:
            s.close()
        # A real client is unaffected.
        assert c.generate(c.request(prompt="Once upon a time", max_new_tokens=4)).code is None
    finally:
        stop(server, c)


def test_a_peer_over_its_connection_limit_is_refused(pb):
    """One client address could open connections until the process ran out of
    descriptors. With --max_connections_per_peer=4 the fifth from one address
    is reset at once, another address is not affected, and a connection that
    closes frees its place."""
    server, c = serve(pb, ["--max_connections_per_peer=4", "--handshake_timeout=60s"])
    try:
        assert c.info().name  # the client's own connection is the first
        held = [open_raw(server.port) for _ in range(3)]
        for s in held:
            # Taken: the server sends its SETTINGS and keeps the connection.
            closed, data = time_to_close(s, 0.5)
            assert closed is None and data, (closed, data)
        over = open_raw(server.port)
        closed, data = time_to_close(over, 5)
        assert closed is not None and closed < 2 and not data, (closed, data)
        over.close()
        other = open_raw(server.port, source="127.0.0.2")
        closed, data = time_to_close(other, 0.5)
        assert closed is None and data, "another address was refused"
        other.close()
        assert wait_for(lambda: "refused a connection from 127.0.0.1" in server.log(), 5), \
            server.log()
        assert c.metrics().get("coalesce_connections_refused_total") == 1
        # A closed connection frees its place (once gRPC has closed its end).
        held.pop().close()
        deadline = time.monotonic() + 5
        while True:
            again = open_raw(server.port)
            closed, data = time_to_close(again, 0.5)
            if closed is None or time.monotonic() > deadline:
                break
            again.close()
        assert closed is None and data, (closed, data)
        # The client's own connection was never touched.
        assert c.generate(c.request(prompt="Once upon a time", max_new_tokens=4)).code is None
        for s in held + [again]:
            s.close()
    finally:
        stop(server, c)


def test_slow_metrics_clients_do_not_hold_up_a_scrape(pb):
    """Connections to /metrics that never finish their request each held one
    of its 4 threads for 10 s, so that 4 such clients delayed every scrape by
    10 s. Twelve of them now delay a scrape by about 2 s at most."""
    server, c = serve(pb, [])
    try:
        slow = [open_raw(server.metrics_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                for _ in range(12)]
        time.sleep(0.2)
        t0 = time.monotonic()
        text = coalesce_harness.read_metrics_text(server.metrics_port, timeout_s=30)
        took = time.monotonic() - t0
        print("a scrape beside 12 slow clients took %.2f s" % took)
        assert "coalesce_requests_running" in text
        assert took < 5, took
        for s in slow:
            s.close()
    finally:
        stop(server, c)


def test_metrics_endpoint_answers_pipelined_requests(pb):
    server, c = serve(pb, [])
    try:
        s = socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10)
        req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        s.sendall(req * 3)
        data = b""
        while data.count(b"\ncoalesce_requests_running ") < 3:
            try:
                chunk = s.recv(1 << 16)
            except socket.timeout:
                break
            if not chunk:
                break
            data += chunk
        s.close()
        assert data.count(b"HTTP/1.1 200") == 3, data[:300]
        assert data.count(b"\ncoalesce_requests_running ") == 3
    finally:
        stop(server, c)
