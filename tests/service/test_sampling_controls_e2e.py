"""End-to-end tests of the sampling controls (SamplingParams.logit_bias,
repetition_penalty, frequency_penalty, presence_penalty, min_p, min_tokens,
ignore_eos, stop_token_ids) against the real server on stories260K: seeded
requests with them give the same tokens alone and batched, out-of-range values
are refused with a message naming the field while another stream goes on, and
coalesce-cli passes them. Their values against transformers' logits processors:
test_hf_server_parity.py.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_sampling_controls_e2e.py
"""

import os
import subprocess
import threading

import grpc
import pytest

from e2e_support import (SERVER, run_concurrently, start_server, wait_idle,
                         with_sampling_controls)

PROMPT = [1, 403, 407, 261, 378, 436, 259, 280, 424]


@pytest.fixture(scope="module")
def srv(pb):
    server, client = start_server(["--kv_block_size=4", "--batch_window=20ms"])
    client.bind(pb)
    yield client
    client.close()
    server.kill()


def controlled(client, seed, **controls):
    r = client.request(ids=PROMPT, max_new_tokens=20, temperature=0.9, seed=seed)
    return with_sampling_controls(r, controls)


CONTROLS = [
    dict(repetition_penalty=1.4),
    dict(frequency_penalty=1.0, presence_penalty=0.5),
    dict(min_p=0.2),
    dict(logit_bias={2: 6.0, 280: -100.0}, min_tokens=10),
    dict(ignore_eos=True, stop_token_ids=[261]),
    dict(),
]


def test_seeded_requests_with_controls_are_the_same_alone_and_batched(srv):
    reqs = [controlled(srv, seed, **c) for seed, c in enumerate(CONTROLS)]
    alone = [srv.generate(r) for r in reqs]
    for res in alone:
        assert res.code is None, res
    together = run_concurrently([lambda r=r: srv.generate(r) for r in reqs * 2])
    for i, res in enumerate(together):
        assert res.code is None and res.ids == alone[i % len(reqs)].ids, i
    # They change the tokens: the same seeds without them differ.
    plain = [srv.generate(controlled(srv, seed)) for seed in range(len(CONTROLS) - 1)]
    assert all(p.ids != a.ids for p, a in zip(plain, alone))
    # The bias is felt: 280 never appears; min_tokens holds EOS off.
    assert 280 not in alone[3].ids and len(alone[3].ids) >= 10
    wait_idle(srv)


@pytest.mark.parametrize("field,value,words", [
    ("repetition_penalty", 0.0, "sampling.repetition_penalty must be in (0, 10]"),
    ("frequency_penalty", 2.5, "sampling.frequency_penalty must be in [-2, 2]"),
    ("presence_penalty", float("nan"), "sampling.presence_penalty must be in [-2, 2]"),
    ("min_p", 1.5, "sampling.min_p must be in [0, 1]"),
    ("min_tokens", 21, "sampling.min_tokens must be 0 to max_new_tokens (20), got 21"),
    ("stop_token_ids", [512], "sampling.stop_token_ids[0] = 512 is outside the vocabulary"),
    ("logit_bias", {3: 101.0}, "sampling.logit_bias[3] must be in [-100, 100]"),
    ("logit_bias", {-5: 1.0}, "sampling.logit_bias key -5 is outside the vocabulary"),
])
def test_out_of_range_controls_are_refused_and_others_go_on(srv, field, value, words):
    long = srv.request(ids=PROMPT, max_new_tokens=200)
    result = {}
    t = threading.Thread(target=lambda: result.update(res=srv.generate(long)))
    t.start()
    bad = srv.generate(controlled(srv, 1, **{field: value}))
    t.join()
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert words in bad.details
    assert result["res"].code is None and len(result["res"].ids) == 200


def test_the_cli_passes_the_controls(srv):
    cli = os.path.join(os.path.dirname(SERVER), "coalesce-cli")
    r = srv.request(prompt="Once upon a time", max_new_tokens=20, temperature=0.9, seed=5)
    r.sampling.repetition_penalty = 1.3
    r.sampling.logit_bias[280] = -100.0
    r.sampling.min_tokens = 4
    r.sampling.stop_token_ids.extend([261, 262])
    want = srv.generate(r)
    assert want.code is None, want
    out = subprocess.run([cli, "--server=" + srv.server.address, "--prompt=Once upon a time",
                          "--max_new_tokens=20", "--temperature=0.9", "--seed=5",
                          "--repetition_penalty=1.3", "--logit_bias=280:-100", "--min_tokens=4",
                          "--stop_token_ids=261,262"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time%s\n" % want.text), out.stdout
    plain = srv.generate(srv.request(prompt="Once upon a time", max_new_tokens=20,
                                     temperature=0.9, seed=5))
    assert plain.text != want.text
    for flag, words in [("--logit_bias=12", "--logit_bias: \"12\" is not id:bias"),
                        ("--stop_token_ids=x", "--stop_token_ids: \"x\" is not a token id")]:
        bad = subprocess.run([cli, "--server=" + srv.server.address, flag],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr
