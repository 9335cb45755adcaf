"""End-to-end tests of --quantize on the CPU, against the real server:
stories260K's float32 matrices quantized at load (the log and the backend
line say so); a request's tokens do not depend on its batch-mates, as with
float32 weights; the answers differ from the float32 model's somewhere, so
the quantized weights are in use; and what cannot be quantized is refused at
start-up with exit code 2, naming the flag. Float32 weights laid out as the
product's panels (--float_panels) give the model's rows' answers. (Every
server here runs on the CPU, whatever COALESCE_SERVER_FLAGS say.)

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_quantize_e2e.py
"""

import re
import subprocess

import pytest

from e2e_support import (MODEL_BIN, SERVER, SERVER_FLAGS, TOKENIZER_BIN, run_concurrently,
                         start_server)

PROMPTS = ["Once upon a time", "The little dog", "Tim and Sam", "The sun was hot",
           "Lily had a red ball", "One day, a bird", "Mom said", "The big tree"]


def greedy_answers(client, together):
    """Each prompt's greedy tokens: all at once (batched) or one by one."""
    def one(prompt):
        res = client.generate(client.request(prompt=prompt, max_new_tokens=48))
        assert res.code is None, res
        return res.ids
    if together:
        return run_concurrently([lambda p=p: one(p) for p in PROMPTS])
    return [one(p) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_at_load_and_batch_invariant(pb, kind):
    server, client = start_server(["--device=cpu", "--quantize=" + kind])
    try:
        client.bind(pb)
        log = server.log()
        # stories260K: dim 64 (whole blocks), hidden 172 (not): w2 stays float32.
        assert "--quantize=%s: 31 matrices" % kind.upper() in log, log
        assert "5 left float32" in log, log
        assert "backend: cpu: %s weights" % kind.upper() in log, log
        alone = greedy_answers(client, together=False)
        batched = greedy_answers(client, together=True)
        assert batched == alone
    finally:
        server.kill()
    server, client = start_server(["--device=cpu"])
    try:
        client.bind(pb)
        float32 = greedy_answers(client, together=False)
    finally:
        server.kill()
    assert float32 != alone, "quantizing changed no answer: are the quantized weights used?"


def test_int8_activations_keep_a_request_independent_of_its_batch(pb):
    """--int8_activations: the quantized matrices multiply int8 activations
    (on a processor with AVX2; elsewhere the server warns and stays
    exact). Either way a request's tokens do not depend on its batch-mates."""
    server, client = start_server(["--device=cpu", "--quantize=q8_0", "--int8_activations"])
    try:
        client.bind(pb)
        log = server.log()
        # The rest fp32: w2, as panels where the processor's product is AVX2.
        assert (re.search(r"Q8_0 weights \(0\.2 MB; the rest fp32(, its matrices as panels: "
                          r"[0-9.]+ MB)?\) with int8 activations", log)
                or "this processor has no AVX2" in log), log
        alone = greedy_answers(client, together=False)
        assert greedy_answers(client, together=True) == alone
        assert all(len(ids) == 48 for ids in alone)
    finally:
        server.kill()


def test_float_panels_change_no_answer(pb):
    """--float_panels: float32 matrices laid out as the product's panels give
    the answers the model's rows give, alone and batched, and the log says
    which layout the backend holds."""
    answers = {}
    for value in ("true", "false"):
        server, client = start_server(["--device=cpu", "--float_panels=" + value])
        try:
            client.bind(pb)
            log = server.log()
            assert ("backend: cpu: fp32 weights as panels" in log) == (value == "true"), log
            answers[value] = (greedy_answers(client, together=False),
                              greedy_answers(client, together=True))
        finally:
            server.kill()
    assert answers["true"][0] == answers["true"][1]
    assert answers["true"] == answers["false"]


@pytest.mark.parametrize("flags,words", [
    (["--device=cpu", "--quantize=q4_k"], "--quantize=q4_k: expected none, q8_0 or q4_0"),
    (["--device=null", "--quantize=q8_0"], "--quantize=q8_0: quantized weights are for the CPU"),
    (["--device=cpu", "--float_panels=maybe"], "--float_panels=maybe: expected auto, true or false"),
])
def test_what_cannot_be_quantized_is_refused_at_start_up(flags, words):
    out = subprocess.run([SERVER, "--model=" + MODEL_BIN, "--tokenizer=" + TOKENIZER_BIN]
                         + SERVER_FLAGS + flags + ["--port=0", "--metrics_port=-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert words in out.stderr, out.stderr
