"""Checks the log-probabilities a Generate call returned against a
transformers model's log_softmax (in double) of its logits over the same
tokens, teacher-forced: every prompt token after the first, every generated
token, and every listed top token. Used by the parity tests that run in the
venv (torch and transformers).

The bound: the engine's logits agree with transformers' within 1e-4 of the
row's largest magnitude (tests/engine/model/test_*_parity.py), and a
log-probability is a logit minus the row's log-sum-exp, so twice that
(plus float rounding) bounds it. A wrong row (an off-by-one position) or
temperature applied moves log-probabilities by far more."""

RELATIVE = 2e-4
ABSOLUTE = 1e-5


def reference(torch, model, ids):
    """(log_softmax, bound) per position: [len(ids), vocab] in double, and
    each row's tolerance."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    bound = RELATIVE * logits.abs().max(dim=-1).values + ABSOLUTE
    return torch.log_softmax(logits, dim=-1), bound


def check_entry(entry, row, bound, want_id, top):
    """One TokenLogprob against its reference row; returns its error."""
    assert entry.token_id == want_id, (entry.token_id, want_id)
    worst = abs(entry.logprob - float(row[want_id]))
    assert worst <= bound, (want_id, entry.logprob, float(row[want_id]), bound)
    assert len(entry.top) == top
    previous = None
    for t in entry.top:
        err = abs(t.logprob - float(row[t.token_id]))
        assert err <= bound, ("top", t.token_id, t.logprob, float(row[t.token_id]), bound)
        worst = max(worst, err)
        if previous is not None:
            assert t.logprob <= previous
        previous = t.logprob
    if top:
        # The most likely token is the reference's, unless two are closer
        # than the bound.
        best = int(row.argmax())
        assert entry.top[0].token_id == best or float(row[best]) - float(
            row[entry.top[0].token_id]) <= 2 * bound
    return worst


def check_call(torch, model, prompt, result, top):
    """Every log-probability of `result` (an e2e_support.Result of a call
    with logprobs and prompt_logprobs) against the model; the worst error."""
    ids = list(prompt) + list(result.ids)
    lsm, bound = reference(torch, model, ids)
    prompt_lps = [lp for m in result.msgs for lp in m.prompt_logprobs]
    assert len(prompt_lps) == len(prompt) - 1
    assert sum(1 for m in result.msgs if m.prompt_logprobs) == 1
    worst = 0.0
    for p, entry in enumerate(prompt_lps):
        worst = max(worst, check_entry(entry, lsm[p], float(bound[p]), prompt[p + 1], top))
    lps = [lp for m in result.msgs for lp in m.logprobs]
    assert len(lps) == len(result.ids)
    for k, entry in enumerate(lps):
        p = len(prompt) - 1 + k
        worst = max(worst, check_entry(entry, lsm[p], float(bound[p]), result.ids[k], top))
    return worst


def scored(request, top=5):
    """`request` asking for every log-probability, with `top` listed."""
    request.logprobs = True
    request.prompt_logprobs = True
    request.top_logprobs = top
    return request


def check_alone_and_batched(torch, model, client, prompts, reqs, run_concurrently, top=5):
    """Runs each scored request alone, then all at once, checks every result
    (check_call); returns the results run alone and the worst error."""
    worst = 0.0
    alone = []
    for prompt, req in zip(prompts, reqs):
        res = client.generate(req)
        assert res.code is None, res
        worst = max(worst, check_call(torch, model, prompt, res, top))
        alone.append(res)
    together = run_concurrently([lambda r=r: client.generate(r) for r in reqs])
    for prompt, res in zip(prompts, together):
        assert res.code is None, res
        worst = max(worst, check_call(torch, model, prompt, res, top))
    return alone, worst

