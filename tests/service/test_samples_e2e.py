"""End-to-end tests of several samples per request (GenerateRequest.n)
against the real server: sample i equals a request with seed + i, token for
token, text and finish reason included, for prompts whose shared part ends
inside a block and on a block boundary, with and without prefix caching;
every message names its sample and every sample ends once; coalesce-cli --n
prints each sample; the prompt is
computed once (coalesce_prompt_tokens_total); the request counts once in
coalesce_requests_total; bad n is refused; cancelling or a deadline ends every
sample and leaves nothing held, while other requests go on.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_samples_e2e.py
"""

import os
import random
import subprocess
import time

import grpc
import pytest

from e2e_support import SERVER, caching_on_and_off, run_concurrently, wait_idle

BLOCK = 4
FLAGS = ["--kv_block_size=%d" % BLOCK, "--batch_window=0", "--max_batch_size=8"]
SEED = 2**64 - 2  # sample i's seed, seed + i, wraps around


def ids(seed, n):
    r = random.Random(seed)
    return [1] + [r.randrange(3, 512) for _ in range(n - 1)]


@pytest.fixture(scope="module")
def servers(pb):
    yield from caching_on_and_off(pb, FLAGS)


def sampled(client, prompt, seed, n=None, max_new_tokens=12, stop=(".",)):
    return client.request(ids=prompt, max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.95,
                          seed=seed, stop=stop, n=n)


def test_each_sample_equals_a_request_with_its_seed(servers):
    reasons = set()
    for length in (7, 9, 33):  # shared part: 6 (inside a block), 8, 32
        prompt = ids(length, length)
        for client in servers:
            alone = [client.generate(sampled(client, prompt, (SEED + i) % 2**64))
                     for i in range(4)]
            request = sampled(client, prompt, SEED, n=4)
            request.request_id = "four"
            got = client.generate(request)
            assert got.code is None, got
            assert sorted(got.samples) == [0, 1, 2, 3]
            for i, a in enumerate(alone):
                s = got.samples[i]
                assert a.code is None, a
                assert (s.ids, s.text, s.finish) == (a.ids, a.text, a.finish), (
                    "prompt %d, sample %d" % (length, i))
                assert s.finals == 1
                assert s.usage.prompt_tokens == length
                assert s.usage.completion_tokens == len(s.ids)
                reasons.add(s.finish)
            # Each sample's last message is its only one with a finish
            # reason, and none of its messages follows it.
            seen_final = set()
            for msg in got.msgs:
                assert msg.index not in seen_final, msg
                assert msg.request_id == "four"
                if msg.finish_reason:
                    seen_final.add(msg.index)
            assert len({tuple(a.ids) for a in alone}) >= 2, "the seeds should matter"
            wait_idle(client)
    # Some samples stopped at "." and others ran to max_new_tokens.
    assert len(reasons) == 2, reasons


def test_the_prompt_is_computed_once_and_the_request_counts_once(servers):
    _, off = servers  # no cache: every request computes its whole prompt
    prompt = ids(40, 30)
    before = wait_idle(off)
    got = off.generate(sampled(off, prompt, 5, n=6, stop=()))
    assert got.code is None, got
    after = wait_idle(off)
    # The prompt but its last token once, then each sample its last token
    # (its copy of the partly filled block needs no recomputation on the CPU).
    assert (after.get("coalesce_prompt_tokens_total")
            - before.get("coalesce_prompt_tokens_total")) == len(prompt) - 1 + 6
    assert (after.get("coalesce_requests_total", status="ok")
            - before.get("coalesce_requests_total", status="ok")) == 1
    assert (after.get("coalesce_generated_tokens_total")
            - before.get("coalesce_generated_tokens_total")) == sum(
                len(s.ids) for s in got.samples.values())


def test_greedy_samples_are_all_the_greedy_output(servers):
    on, _ = servers
    prompt = ids(41, 12)
    one = on.generate(on.request(ids=prompt, max_new_tokens=16))
    many = on.generate(on.request(ids=prompt, max_new_tokens=16, n=3))
    assert [many.samples[i].ids for i in range(3)] == [one.ids] * 3
    # The prompt but its last token: two whole blocks, cached by the first.
    assert [many.samples[i].usage.cached_prompt_tokens for i in range(3)] == [8] * 3


@pytest.mark.parametrize("n,words", [(-1, "n must be 1 to 16"), (17, "n must be 1 to 16"),
                                     (9, "max_batch_size")])
def test_bad_n_is_refused(servers, n, words):
    on, _ = servers
    r = on.generate(sampled(on, ids(42, 5), 1, n=n))
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT, r
    assert words in r.details
    # 0 means 1.
    zero = on.generate(sampled(on, ids(42, 5), 1, n=0))
    assert zero.code is None and sorted(zero.samples) == [0]


def test_cancelling_ends_every_sample_and_others_go_on(servers):
    on, _ = servers
    long_req = on.request(ids=ids(43, 20), max_new_tokens=400, n=4)
    other = on.request(ids=ids(44, 10), max_new_tokens=60)
    call = on.generate_call(long_req)
    it = iter(call)
    first = next(it)
    assert 0 <= first.index < 4

    def cancel_soon():
        time.sleep(0.05)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(it)
        return e.value.code()

    code, res = run_concurrently([cancel_soon, lambda: on.generate(other)])
    assert code == grpc.StatusCode.CANCELLED
    assert res.code is None and len(res.ids) == 60
    m = wait_idle(on)
    assert m.get("coalesce_requests_running") == 0


def test_a_deadline_ends_every_sample(servers):
    on, _ = servers
    request = on.request(ids=ids(45, 20), max_new_tokens=490, n=8)
    # A deadline a quarter of what the whole request takes here, so that it
    # falls while the samples run, on a slow machine or a GPU.
    start = time.monotonic()
    whole = on.generate(request)
    took = time.monotonic() - start
    assert whole.code is None and sorted(whole.samples) == list(range(8)), whole
    r = on.generate(request, timeout=took / 4)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, (took, r)
    wait_idle(on)


FINISH_NAMES = {1: "LENGTH", 2: "STOP", 3: "EOS"}  # the proto's FinishReason


def test_the_cli_prints_each_sample(servers):
    on, _ = servers
    cli = os.path.join(os.path.dirname(SERVER), "coalesce-cli")
    out = subprocess.run([cli, "--server=" + on.server.address, "--prompt=Once upon a time",
                          "--n=3", "--temperature=1", "--seed=7", "--max_new_tokens=12"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for i in range(3):
        alone = on.generate(on.request(prompt="Once upon a time", max_new_tokens=12,
                                       temperature=1.0, seed=7 + i))
        finish = FINISH_NAMES[alone.finish]
        expected = "--- sample %d (finish %s)\nOnce upon a time%s\n" % (i, finish, alone.text)
        assert expected in out.stdout, out.stdout
