"""End-to-end tests of log-probabilities (GenerateRequest.logprobs,
top_logprobs, prompt_logprobs) against the real server on stories260K: one
entry per token, the greedy token the most likely, probabilities that add up,
the prompt scored once and never from the prefix cache, the same tokens with
and without them, and bad top_logprobs refused. Their values against
transformers: test_hf_server_parity.py and test_gguf_server_parity.py.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_logprobs_e2e.py
"""

import math

import grpc
import pytest

from e2e_support import start_server, wait_idle

PROMPT = [1, 403, 407, 261, 378, 436, 259, 280, 424, 289, 405, 261, 378, 436, 259, 280, 424]


@pytest.fixture(scope="module")
def srv(pb):
    server, client = start_server(["--kv_block_size=4", "--batch_window=0"])
    client.bind(pb)
    yield client
    client.close()
    server.kill()


def scored(client, n=None, top=3, **kw):
    r = client.request(ids=PROMPT, max_new_tokens=12, n=n, **kw)
    r.logprobs = True
    r.prompt_logprobs = True
    r.top_logprobs = top
    return r


def test_every_token_has_its_logprob_and_greedy_takes_the_most_likely(srv):
    res = srv.generate(scored(srv))
    assert res.code is None, res
    for msg in res.msgs:
        assert len(msg.logprobs) == len(msg.token_ids)
        for token, lp in zip(msg.token_ids, msg.logprobs):
            assert lp.token_id == token
            assert len(lp.top) == 3
            assert (lp.top[0].token_id, lp.top[0].logprob) == (token, lp.logprob)
            assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
            assert sum(math.exp(t.logprob) for t in lp.top) <= 1.0 + 1e-5
            assert lp.logprob <= 0.0
    # The prompt: once, in the first message, one per token after the first.
    assert len(res.msgs[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(not m.prompt_logprobs for m in res.msgs[1:])
    assert [lp.token_id for lp in res.msgs[0].prompt_logprobs] == PROMPT[1:]
    top_texts = {t.token_id: t.text for lp in res.msgs[0].prompt_logprobs for t in lp.top}
    for token_id, text in top_texts.items():
        assert text == srv.detokenize([token_id])


def test_the_prompt_is_scored_in_full_even_when_cached(srv):
    first = srv.generate(scored(srv))
    plain = srv.generate(srv.request(ids=PROMPT, max_new_tokens=12))
    assert plain.usage.cached_prompt_tokens > 0  # the blocks are cached...
    again = srv.generate(scored(srv))
    assert again.usage.cached_prompt_tokens == 0  # ...but scoring computes them
    assert ([(lp.token_id, lp.logprob) for lp in again.msgs[0].prompt_logprobs]
            == [(lp.token_id, lp.logprob) for lp in first.msgs[0].prompt_logprobs])
    assert again.ids == first.ids == plain.ids
    wait_idle(srv)


def test_logprobs_change_no_token_and_samples_share_the_prompt_s(srv):
    sampled = dict(temperature=0.9, top_p=0.95, seed=77)
    with_lp = srv.generate(scored(srv, **sampled))
    without = srv.generate(srv.request(ids=PROMPT, max_new_tokens=12, **sampled))
    assert with_lp.ids == without.ids
    three = srv.generate(scored(srv, n=3, **sampled))
    assert three.code is None, three
    assert sum(1 for m in three.msgs if m.prompt_logprobs) == 1
    carrying = [m for m in three.msgs if m.prompt_logprobs][0]
    assert carrying.index == 0 and carrying is three.msgs[0]
    assert three.samples[0].ids == with_lp.ids
    for i in range(3):
        n_lp = sum(len(m.logprobs) for m in three.msgs if m.index == i)
        assert n_lp == len(three.samples[i].ids)


@pytest.mark.parametrize("top", [-1, 21])
def test_top_logprobs_out_of_range_is_refused(srv, top):
    r = srv.generate(scored(srv, top=top))
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT, r
    assert "top_logprobs must be 0 to 20" in r.details
