"""End-to-end tests of prefix caching (--prefix_caching) against the real
server: with caching on, every output is the same as with caching off, token
for token, while the shared parts of prompts are taken from the cache, for
prefixes that end inside a block and on a block boundary, under eviction
pressure with preemptions, after a request cancelled in the middle of its
prefill, and with cache salts; Usage.cached_prompt_tokens and the metrics say
what was reused.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_prefix_cache_e2e.py
"""

import random
import time

import grpc
import pytest

from e2e_support import caching_on_and_off, run_concurrently, start_server, wait_for, wait_idle

BLOCK = 4
# Small steps, so that prompts are prefilled in several chunks.
FLAGS = ["--kv_block_size=%d" % BLOCK, "--batch_window=0", "--max_batch_size=8",
         "--max_batch_tokens=24"]


def ids(seed, n):
    r = random.Random(seed)
    return [1] + [r.randrange(3, 512) for _ in range(n - 1)]


P_INSIDE = ids(1, 23)    # ends inside block 5 (positions 20..23)
P_BOUNDARY = ids(2, 24)  # ends exactly at the end of block 5


@pytest.fixture(scope="module")
def servers(pb):
    yield from caching_on_and_off(pb, FLAGS)


def req(client, prompt, n=12, salt=None, **kw):
    r = client.request(ids=prompt, max_new_tokens=n, **kw)
    if salt is not None:
        r.cache_salt = salt
    return r


def cases():
    """(prompt, sampling) pairs over both prefixes, greedy and seeded."""
    out = []
    for prefix in (P_INSIDE, P_BOUNDARY):
        for k, suffix in enumerate(([7, 8, 9], [10], [11, 12, 13, 14, 15], [16] * 9)):
            sampling = {} if k % 2 == 0 else dict(temperature=0.8, top_p=0.9, seed=100 + k)
            out.append((prefix + suffix, sampling))
    return out


def test_outputs_equal_caching_off_and_prefixes_are_reused(servers):
    on, off = servers
    before = on.metrics()
    expected = [off.generate(req(off, p, **s)) for p, s in cases()]
    got = [on.generate(req(on, p, **s)) for p, s in cases()]
    for (p, _), e, g in zip(cases(), expected, got):
        assert e.code is None and g.code is None, (e, g)
        assert g.ids == e.ids and g.text == e.text, "prompt of %d tokens" % len(p)
        assert e.usage.cached_prompt_tokens == 0
    # In each group of four, the first computes its prompt; the others find
    # the whole blocks of the shared prefix: 5 of P_INSIDE (20 tokens), and
    # all 6 of P_BOUNDARY (24), since each has at least one token more.
    cached = [g.usage.cached_prompt_tokens for g in got]
    assert cached == [0, 20, 20, 20, 0, 24, 24, 24], cached
    after = wait_idle(on)
    looked_up = sum(len(p) for p, _ in cases())
    assert (after.get("coalesce_prefix_cache_lookup_tokens_total")
            - before.get("coalesce_prefix_cache_lookup_tokens_total")) == looked_up
    assert (after.get("coalesce_prefix_cache_hit_tokens_total")
            - before.get("coalesce_prefix_cache_hit_tokens_total")) == sum(cached)
    assert after.get("coalesce_prefix_cache_blocks") > 0
    # Cached blocks nobody holds count as free: idle means nothing used.
    assert after.get("coalesce_kv_cache_blocks", state="used") == 0


def test_concurrent_requests_with_shared_prefixes_equal_caching_off(servers):
    on, off = servers
    expected = [off.generate(req(off, p, **s)) for p, s in cases()]
    got = run_concurrently([lambda p=p, s=s: on.generate(req(on, p, **s)) for p, s in cases()])
    for e, g in zip(expected, got):
        assert g.code is None, g
        assert g.ids == e.ids
    wait_idle(on)


def test_a_next_turn_reuses_the_conversation_so_far(servers):
    on, off = servers
    first = ids(3, 30)
    a = on.generate(req(on, first, n=20))
    second = first + a.ids + [5, 6, 7]
    b = on.generate(req(on, second, n=10))
    e = off.generate(req(off, second, n=10))
    assert b.ids == e.ids
    # The first turn computed its prompt and all but its last generated
    # token: (30 + 19) // 4 whole blocks.
    assert b.usage.cached_prompt_tokens == (30 + 19) // BLOCK * BLOCK


def test_salts_keep_requests_apart(servers):
    on, _ = servers
    prompt = ids(4, 40)
    first = on.generate(req(on, prompt, n=4, salt="tenant-a"))
    assert first.usage.cached_prompt_tokens == 0
    assert on.generate(req(on, prompt, n=4, salt="tenant-b")).usage.cached_prompt_tokens == 0
    assert on.generate(req(on, prompt, n=4)).usage.cached_prompt_tokens == 0
    again = on.generate(req(on, prompt, n=4, salt="tenant-a"))
    assert again.usage.cached_prompt_tokens == 36 and again.ids == first.ids
    assert on.generate(req(on, prompt, n=4, salt="tenant-b")).usage.cached_prompt_tokens == 36


def test_a_salt_that_is_too_long_is_refused(servers):
    on, _ = servers
    r = on.generate(req(on, ids(5, 8), salt="x" * 257))
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt must be at most 256 bytes, got 257" in r.details
    assert on.generate(req(on, ids(5, 8), salt="x" * 256)).code is None


def test_cancelled_mid_prefill_leaves_the_cache_consistent(servers):
    on, off = servers
    prompt = ids(6, 480)  # 20 steps of prefill at 24 tokens a step
    call = on.generate_call(req(on, prompt, n=8))
    time.sleep(0.02)
    call.cancel()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(on)
    got = on.generate(req(on, prompt, n=8))
    assert got.ids == off.generate(req(off, prompt, n=8)).ids
    # Whatever whole blocks the cancelled prefill computed were reused.
    assert 0 <= got.usage.cached_prompt_tokens < len(prompt)
    assert got.usage.cached_prompt_tokens % BLOCK == 0
    wait_idle(on)


def test_eviction_pressure_and_preemption_do_not_change_outputs(pb):
    """stories260K takes 1280 bytes of KV cache per token: 50 KiB is 40
    tokens, 10 blocks of 4. Twelve concurrent requests over three prefixes
    evict cached blocks and preempt each other; every output equals its run
    with caching off."""
    flags = FLAGS + ["--kv_cache_memory=50KiB", "--log_level=debug", "--log_steps"]
    on_server, on = start_server(flags)
    off_server, off = start_server(flags + ["--prefix_caching=false"])
    try:
        on.bind(pb)
        off.bind(pb)
        prefixes = [ids(10 + i, 9 + 2 * i) for i in range(3)]
        prompts = [prefixes[i % 3] + [20 + i] * (1 + i % 3) for i in range(12)]
        reqs = [(p, 14) for p in prompts]
        expected = [off.generate(req(off, p, n=n)) for p, n in reqs]
        for rounds in range(2):
            got = run_concurrently([lambda p=p, n=n: on.generate(req(on, p, n=n))
                                    for p, n in reqs])
            for p, e, g in zip(prompts, expected, got):
                assert e.code is None and g.code is None, (e, g)
                assert g.ids == e.ids, "output changed for a prompt of %d tokens" % len(p)
        # Whether a concurrent request found its prefix still cached depends
        # on the order they came in; one after another, the second of two
        # requests over one prefix finds its two whole blocks.
        wait_idle(on)
        on.generate(req(on, prompts[0], n=14))
        again = on.generate(req(on, prompts[3], n=14))
        assert again.ids == expected[3].ids
        assert again.usage.cached_prompt_tokens == 8
        m = wait_idle(on)
        assert m.get("coalesce_preemptions_total") > 0
        assert m.get("coalesce_prefix_cache_evictions_total") > 0
        assert m.get("coalesce_prefix_cache_hit_tokens_total") >= 8
        assert m.get("coalesce_kv_cache_blocks", state="free") == 10
    finally:
        on_server.kill()
        off_server.kill()


def test_the_start_up_log_says_whether_caching_is_on(servers):
    on, off = servers
    assert wait_for(lambda: "prefix_caching on" in "".join(on.server.log_lines()), 5)
    assert wait_for(lambda: "prefix_caching off" in "".join(off.server.log_lines()), 5)
