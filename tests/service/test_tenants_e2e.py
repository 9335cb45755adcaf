"""End-to-end tests of tenants (--api_keys_file) against the real server on
stories260K with a real grpcio client: no key or a wrong one is
UNAUTHENTICATED on every Generator call while health and reflection stay open;
a key names its tenant in the metrics; a tenant over its streams or its tokens
per minute gets RESOURCE_EXHAUSTED with the retry pushback trailer, and
nobody else is disturbed; a call reserves the most tokens it can use and gets
back what it did not use, so bursts cannot overdraw a budget; a tenant's
cached prompts are reachable only by itself and its prefix-cache group; a
priority above the tenant's maximum is capped; the file is re-read when it
changes; no key reaches the log.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_tenants_e2e.py
"""

import hashlib
import json
import os
import random
import subprocess
import threading
import time

import grpc
import pytest

from coalesce_harness import read_metrics_text
from e2e_support import SERVER, Client, Server, parse_metrics, wait_for

PROMPT = [1, 403, 407, 261]
KEYS = {"alpha": "alpha-key-9a1b2c", "beta": "beta-key-3d4e5f", "gamma": "gamma-key-6a7b8c",
        "other": "other-key-0f0f0f", "delta": "delta-key-1e2f3a", "org-a": "org-a-key-4b5c6d",
        "org-b": "org-b-key-7e8f9a"}


def tenant(name, **limits):
    return dict(name=name, key_sha256=hashlib.sha256(KEYS[name].encode()).hexdigest(), **limits)


def write_keys(path, tenants):
    tmp = path + ".new"
    with open(tmp, "w") as f:
        json.dump({"tenants": tenants}, f)
    os.replace(tmp, path)


TENANTS = [tenant("alpha", max_streams=1, max_priority=0), tenant("beta", tokens_per_minute=60),
           tenant("other", max_priority=10), tenant("delta", tokens_per_minute=2000),
           tenant("org-a", prefix_cache_group="org"), tenant("org-b", prefix_cache_group="org")]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("keys") / "keys.json")
    write_keys(path, TENANTS)
    return path


@pytest.fixture(scope="module")
def srv(pb, keys_file):
    server = Server(["--api_keys_file=" + keys_file, "--batch_window=0"])
    client = Client(server).bind(pb)
    yield client
    client.close()
    server.kill()


def as_tenant(client, name):
    client.metadata = [("authorization", "Bearer " + KEYS[name])] if name else None
    return client


def test_no_key_or_a_wrong_one_is_unauthenticated_but_health_is_open(srv):
    for metadata, words in [(None, "needs an API key"),
                            ([("authorization", "Bearer nope")], "unknown API key"),
                            ([("authorization", KEYS["alpha"])], "must be \"Bearer KEY\"")]:
        srv.metadata = metadata
        res = srv.generate(srv.request(ids=PROMPT, max_new_tokens=4))
        assert res.code == grpc.StatusCode.UNAUTHENTICATED, res
        assert words in res.details
        for call in (srv.info, lambda: srv.tokenize("hi", True), lambda: srv.detokenize([5])):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    srv.metadata = None
    assert srv.metrics().get("coalesce_requests_rejected_total", reason="unauthenticated") == 3
    assert srv.health() == srv.pb.health.HealthCheckResponse.SERVING
    assert srv.health("coalesce.v1.Generator") == srv.pb.health.HealthCheckResponse.SERVING
    assert "coalesce.v1.Generator" in srv.list_services()  # reflection too


def test_a_key_names_its_tenant_in_the_metrics(srv):
    as_tenant(srv, "alpha")
    before = srv.metrics()
    res = srv.generate(srv.request(ids=PROMPT, max_new_tokens=6))
    assert res.code is None and len(res.ids) == 6, res
    assert srv.info().vocab_size == 512
    after = srv.metrics()

    def get(m, name, **labels):
        try:
            return m.get(name, **labels)
        except AssertionError:
            return 0.0

    assert (get(after, "coalesce_tenant_requests_total", tenant="alpha", status="ok")
            == get(before, "coalesce_tenant_requests_total", tenant="alpha", status="ok") + 1)
    assert (get(after, "coalesce_tenant_tokens_total", tenant="alpha", kind="generated")
            == get(before, "coalesce_tenant_tokens_total", tenant="alpha", kind="generated") + 6)
    assert (get(after, "coalesce_tenant_tokens_total", tenant="alpha", kind="prompt")
            == get(before, "coalesce_tenant_tokens_total", tenant="alpha", kind="prompt") + 4)
    # The request's first token is in its tenant's histogram, and in no other's.
    ttft = "coalesce_tenant_time_to_first_token_seconds_count"
    assert get(after, ttft, tenant="alpha") == get(before, ttft, tenant="alpha") + 1
    assert get(after, ttft, tenant="beta") == get(before, ttft, tenant="beta")
    assert (get(after, "coalesce_time_to_first_token_seconds_count")
            == get(before, "coalesce_time_to_first_token_seconds_count") + 1)


def test_the_command_line_clients_send_a_key_from_a_file_or_the_environment(srv, tmp_path):
    """coalesce-cli, coalesce-bench and coalesce-eval: --api_key_file, or
    COALESCE_API_KEY; without either, the server refuses them."""
    tools = os.path.dirname(SERVER)
    key_file = tmp_path / "key"
    key_file.write_text("  %s  \n" % KEYS["other"])  # surrounding whitespace is not the key
    server = "--server=" + srv.server.address
    env = {k: v for k, v in os.environ.items() if k != "COALESCE_API_KEY"}

    def ok_requests():
        try:
            return srv.metrics().get("coalesce_tenant_requests_total", tenant="other", status="ok")
        except AssertionError:
            return 0.0

    def run(cmd, key_env=None):
        e = dict(env, COALESCE_API_KEY=key_env) if key_env else env
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=e)

    before = ok_requests()
    cli = [os.path.join(tools, "coalesce-cli"), server, "--prompt=Once", "--max_new_tokens=3"]
    bench = [os.path.join(tools, "coalesce-bench"), server, "--requests=3", "--concurrency=1",
             "--warmup=0s", "--prompt_tokens=8", "--max_new_tokens=3", "--progress=false",
             "--format=none"]
    for cmd in (cli + ["--api_key_file=%s" % key_file], bench + ["--api_key_file=%s" % key_file]):
        r = run(cmd)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    r = run(cli, key_env=KEYS["other"])
    assert r.returncode == 0, r.stderr
    assert ok_requests() == before + 5

    # coalesce-eval calls GetModelInfo and Tokenize too: those need the key as well.
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. She liked to play in the sun.\n")
    eval_cmd = [os.path.join(tools, "coalesce-eval"), server, "--text=%s" % text, "--format=json"]
    r = run(eval_cmd + ["--api_key_file=%s" % key_file])
    assert r.returncode == 0, (r.stdout, r.stderr)

    refused = run(cli)
    assert refused.returncode != 0 and "needs an API key" in refused.stderr, refused.stderr
    refused = run(eval_cmd)
    assert refused.returncode != 0 and "needs an API key" in refused.stderr, refused.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    bad = run(cli + ["--api_key_file=%s" % empty])
    assert bad.returncode == 2 and "no key in it" in bad.stderr, bad.stderr


def test_over_its_streams_a_tenant_waits_and_others_go_on(srv, pb, keys_file):
    as_tenant(srv, "alpha")
    long = srv.request(ids=PROMPT, max_new_tokens=400)
    long.sampling.ignore_eos = True
    # Its first tokens say the long call holds alpha's one stream (a second
    # call sent earlier could take it first), and 399 more keep it held while
    # a second is refused.
    stream = srv.generate_call(long)
    long_ids = list(next(stream).token_ids)
    second = srv.generate(srv.request(ids=PROMPT, max_new_tokens=2))
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED, second
    assert "1 streams open, its limit" in second.details
    assert int(second.trailing["grpc-retry-pushback-ms"]) > 0
    # Another tenant is not disturbed.
    other = Client(srv.server).bind(pb)
    as_tenant(other, "other")
    assert other.generate(other.request(ids=PROMPT, max_new_tokens=4)).code is None
    other.close()
    for msg in stream:
        long_ids.extend(msg.token_ids)
    assert len(long_ids) == 400
    assert wait_for(lambda: srv.generate(srv.request(ids=PROMPT, max_new_tokens=2)).code is None,
                    10)


def test_a_call_that_has_ended_holds_nothing_of_its_tenant(srv):
    # The final status goes out only after the call has freed its stream and
    # paid its tokens: one call after another in a tight loop never finds
    # alpha's one stream still held.
    as_tenant(srv, "alpha")
    for i in range(100):
        result = srv.generate(srv.request(ids=PROMPT, max_new_tokens=1))
        assert result.code is None, (i, result)


def test_over_its_tokens_per_minute_a_tenant_is_told_when_to_retry(srv):
    as_tenant(srv, "beta")
    r = srv.request(ids=PROMPT, max_new_tokens=50)
    r.sampling.ignore_eos = True
    first = srv.generate(r)
    assert first.code is None and len(first.ids) == 50, first
    used = 54
    # The next may use 4 + 40 tokens: more than what is left of the 60.
    refused = srv.generate(srv.request(ids=PROMPT, max_new_tokens=40))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert "used its 60 tokens per minute (this request may use 44); retry in" in refused.details
    # 60 - used left (a little more by now), 44 wanted, at one token a second.
    assert 0 < int(refused.trailing["grpc-retry-pushback-ms"]) <= (44 - (60 - used)) * 1000
    assert srv.metrics().get("coalesce_requests_rejected_total", reason="tenant_limit") >= 1


def test_a_call_reserves_its_most_tokens_so_a_burst_cannot_overdraw(srv):
    """The probe's experiment (tokens_per_minute 2000): two n=16 x 200-token
    calls used to be admitted while the budget was positive, 3.2x the budget
    in one burst. A call now reserves its prompt plus max_new_tokens for each
    sample when it is admitted and gets back what it did not use."""
    as_tenant(srv, "delta")
    big = srv.request(ids=PROMPT, max_new_tokens=200, n=16)
    for _ in range(2):
        res = srv.generate(big)
        assert res.code == grpc.StatusCode.RESOURCE_EXHAUSTED, res
        assert ("may use 3204 tokens (its prompt and max_new_tokens for each of its samples) but "
                "tenant delta's budget is 2000 tokens per minute") in res.details
        assert res.trailing["grpc-retry-pushback-ms"] == "-1"  # no wait would do
    # A call that stops at its first token gets back what it reserved.
    first = srv.generate(srv.request(ids=PROMPT, max_new_tokens=1))
    assert first.code is None, first
    early = srv.request(ids=PROMPT, max_new_tokens=200, n=4)
    early.sampling.stop_token_ids.append(first.ids[0])
    res = srv.generate(early)
    assert res.code is None and len(res.ids) == 4, res
    # 2000 - 5 - 8 left: room for two calls that may each use 804, not three.
    full = srv.request(ids=PROMPT, max_new_tokens=200, n=4)
    full.sampling.ignore_eos = True
    for _ in range(2):
        res = srv.generate(full)
        assert res.code is None and len(res.ids) == 800, res
    res = srv.generate(full)
    assert res.code == grpc.StatusCode.RESOURCE_EXHAUSTED, res
    assert "(this request may use 804); retry in" in res.details
    # 804 wanted, 2000 - 5 - 8 - 1608 = 379 left (and what refilled since
    # the first call, 33 a second): at most 12.75 s.
    assert 3_000 <= int(res.trailing["grpc-retry-pushback-ms"]) <= 12_750


def cache_prompt(seed):
    r = random.Random(seed)
    return [1] + [r.randrange(3, 512) for _ in range(47)]


def test_cached_prompts_stay_within_a_tenant_or_its_group(srv):
    """The probe's experiment: a tenant used to find another's prompt in the
    prefix cache (Usage.cached_prompt_tokens, and its time to first token),
    and so could test guesses about it, even through the other's cache_salt.
    Now the same text is cached across two tenants for neither, within one
    tenant it is, across a shared prefix_cache_group it is, and another
    tenant using the first's salt finds nothing."""
    def cached(name, prompt, salt=""):
        as_tenant(srv, name)
        r = srv.request(ids=prompt, max_new_tokens=1)
        r.cache_salt = salt
        res = srv.generate(r)
        assert res.code is None, res
        return res.usage.cached_prompt_tokens

    memo = cache_prompt(1)
    assert cached("other", memo) == 0
    assert cached("alpha", memo) == 0           # another tenant: nothing
    assert cached("other", memo) > 0            # the same tenant: its own blocks
    shared = cache_prompt(2)
    assert cached("org-a", shared) == 0
    assert cached("org-b", shared) > 0          # a shared group
    assert cached("other", shared) == 0         # outside it
    salted = cache_prompt(3)
    assert cached("other", salted, salt="s3cret") == 0
    assert cached("alpha", salted, salt="s3cret") == 0  # the other's salt opens nothing
    assert cached("other", salted, salt="s3cret") > 0


def test_a_changed_file_is_read_again(srv, keys_file):
    as_tenant(srv, "gamma")
    assert srv.generate(srv.request(ids=PROMPT, max_new_tokens=2)).code == \
        grpc.StatusCode.UNAUTHENTICATED
    write_keys(keys_file, TENANTS + [tenant("gamma")])
    assert wait_for(lambda: srv.generate(srv.request(ids=PROMPT, max_new_tokens=2)).code is None,
                    10)
    assert "reloaded, %d tenants" % (len(TENANTS) + 1) in srv.server.log()
    write_keys(keys_file, TENANTS)


def test_no_key_reaches_the_log(srv):
    log = srv.server.log()
    for key in KEYS.values():
        assert key not in log


def test_a_priority_above_the_tenant_s_maximum_is_capped(pb, keys_file):
    """One slot: a long request holds it while `other` (priority 0) and then
    alpha (asking 10, capped to 0) wait, each for 40 tokens; once both wait,
    the holder is cancelled. First come, first served admits `other` first,
    and alpha only once it has finished. Uncapped, alpha's 10 would go first.
    Order by each call's first token (a client may take longer to read a long
    stream than the server takes to run the next one). Nothing here depends
    on how fast the server generates: the holder asks for more tokens than it
    could make before the arrivals wait, and stops when they do."""
    server = Server(["--api_keys_file=" + keys_file, "--batch_window=0", "--max_batch_size=1"],
                    model_flags=["--model=synthetic:15m"])
    try:
        first_token, results = {}, {}

        def gauge(name):
            m = parse_metrics(read_metrics_text(server.metrics_port))
            return sum(v for (n, _), v in m.items() if n == name)

        def run(name, tokens, priority):
            c = as_tenant(Client(server).bind(pb), name)
            r = c.request(ids=PROMPT, max_new_tokens=tokens, priority=priority)
            r.sampling.ignore_eos = True
            start = time.monotonic()
            results[name] = res = c.generate(r)
            if res.times:
                first_token[name] = start + res.times[0]
            c.close()

        holder_client = as_tenant(Client(server).bind(pb), "org-a")
        r = holder_client.request(ids=PROMPT, max_new_tokens=2000)
        r.sampling.ignore_eos = True
        holder = holder_client.generate_call(r)
        next(holder)  # its first token: it holds the one slot
        first_token["org-a"] = time.monotonic()
        assert gauge("coalesce_requests_running") == 1
        first = threading.Thread(target=run, args=("other", 40, 0))
        first.start()
        assert wait_for(lambda: gauge("coalesce_requests_waiting") == 1, 30)
        second = threading.Thread(target=run, args=("alpha", 40, 10))
        second.start()
        assert wait_for(lambda: gauge("coalesce_requests_waiting") == 2, 30)
        # Both wait while the holder is still running (had it finished, one
        # of them would have been admitted and the gauge never shown 2).
        holder.cancel()
        with pytest.raises(grpc.RpcError) as cancelled:
            for _ in holder:
                pass
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        holder_client.close()
        for t in (first, second):
            t.join()
        assert all(r.code is None for r in results.values()), results
        assert all(len(r.ids) == 40 for r in results.values()), results
        assert first_token["org-a"] < first_token["other"] < first_token["alpha"], first_token
    finally:
        server.kill()
