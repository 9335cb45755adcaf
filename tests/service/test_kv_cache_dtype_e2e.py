"""End-to-end tests of --kv_cache_dtype on the CPU, against the real server:
the same --kv_cache_memory holds more tokens in bf16 and int8 (the start-up
log and coalesce_kv_cache_capacity_tokens say how many); an int8 cache far
too small for the load preempts and recomputes without changing any output,
forked samples included; and the types the CPU does not hold are refused at
start-up with exit code 2. (Every server here runs on the CPU, whatever
COALESCE_SERVER_FLAGS say: the CUDA backend holds only its weights' type.)

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_kv_cache_dtype_e2e.py
"""

import subprocess

import pytest

from e2e_support import (MODEL_BIN, SERVER, SERVER_FLAGS, TOKENIZER_BIN, run_concurrently,
                         start_server, wait_idle)

PROMPTS = ["Once upon a time", "The little dog", "Tim and Sam", "The sun was hot",
           "Lily had a red ball", "One day, a bird", "Mom said", "The big tree"]


@pytest.mark.parametrize("dtype,blocks", [("fp32", 30), ("bf16", 60), ("int8", 80)])
def test_the_same_memory_holds_more_tokens(pb, dtype, blocks):
    """stories260K: 5 layers, kv_dim 32 in 4 KV heads of 8. A block of 16
    tokens takes 20480 bytes in fp32, 10240 in bf16 and 2 x 5 x 16 x (32 +
    4 x 4) = 7680 in int8, so 600 KiB hold 30, 60 and 80 blocks."""
    server, client = start_server(["--device=cpu", "--kv_cache_dtype=" + dtype,
                                   "--kv_cache_memory=600KiB", "--kv_block_size=16"])
    try:
        client.bind(pb)
        log = server.log()
        assert "KV cache: %d blocks of 16 tokens (%s, " % (blocks, dtype) in log, log
        m = wait_idle(client)
        assert m.get("coalesce_kv_cache_capacity_tokens", dtype=dtype) == blocks * 16
        res = client.generate(client.request(prompt="Once upon a time", max_new_tokens=40))
        assert res.code is None and len(res.ids) == 40, res
    finally:
        server.kill()


@pytest.fixture(scope="module")
def small_int8_cache(pb):
    """30 int8 blocks of 16 tokens (225 KiB) hold 480 tokens, about two of the
    250-token requests below, as the float32 cache of test_pressure_e2e does."""
    server, client = start_server(["--device=cpu", "--kv_cache_dtype=int8",
                                   "--kv_cache_memory=225KiB", "--kv_block_size=16",
                                   "--max_batch_size=16", "--max_batch_tokens=64",
                                   "--batch_window=0"])
    client.bind(pb)
    yield client
    server.kill()


def test_int8_cache_preempts_without_changing_outputs(small_int8_cache):
    """An int8 token is a pure function of its own K and V, so a preempted
    sequence that recomputes its cache gets the same bytes back, and a batch
    changes nothing: every request decodes together as it does alone."""
    c = small_int8_cache
    assert "KV cache: 30 blocks of 16 tokens (int8, " in c.server.log()
    reqs = [c.request(prompt=p, max_new_tokens=240) for p in PROMPTS]
    reqs += [c.request(prompt=p, max_new_tokens=240, temperature=0.9, top_p=0.95, seed=7 + i)
             for i, p in enumerate(PROMPTS[:4])]
    solo = [c.generate(r) for r in reqs]
    for s in solo:
        assert s.code is None and len(s.ids) > 50, s
    before = wait_idle(c)

    together = run_concurrently([lambda r=r: c.generate(r) for r in reqs])

    for r, s, t in zip(reqs, solo, together):
        assert t.code is None, t
        assert t.ids == s.ids, "output changed under preemption for %r" % r.prompt
    after = wait_idle(c)
    assert after.get("coalesce_preemptions_total") > before.get("coalesce_preemptions_total")
    assert after.get("coalesce_kv_cache_usage_ratio") == 0


def test_int8_forked_samples_equal_the_same_seeds_alone(small_int8_cache):
    """n samples share the prompt's blocks and copy its partly filled last one
    (CopyBlocks, which copies the int8 scales too): sample i equals a request
    of its own with seed + i."""
    c = small_int8_cache
    prompt = "Lily had a red ball and"  # not a whole number of blocks
    forked = c.generate(c.request(prompt=prompt, max_new_tokens=30, temperature=0.9, seed=11, n=3))
    assert forked.code is None, forked
    assert sorted(forked.samples) == [0, 1, 2]
    for i in range(3):
        alone = c.generate(c.request(prompt=prompt, max_new_tokens=30, temperature=0.9,
                                     seed=11 + i))
        assert alone.code is None, alone
        assert forked.samples[i].ids == alone.ids, "sample %d" % i


@pytest.mark.parametrize("value,words", [
    ("fp8", "--kv_cache_dtype=fp8: e4m3 is a CUDA type"),
    ("int4", "--kv_cache_dtype=int4: expected auto, fp32, bf16, fp16, int8"),
])
def test_what_the_cpu_does_not_hold_is_refused_at_start_up(value, words):
    out = subprocess.run([SERVER, "--model=" + MODEL_BIN, "--tokenizer=" + TOKENIZER_BIN]
                         + SERVER_FLAGS + ["--device=cpu", "--kv_cache_dtype=" + value,
                                           "--port=0", "--metrics_port=-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert words in out.stderr, out.stderr
