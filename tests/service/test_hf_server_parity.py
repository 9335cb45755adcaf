"""Greedy tokens through the real server against Hugging Face transformers, for
randomly initialised models of two families (Llama with GQA, Qwen2 with q/k/v
biases) saved with save_pretrained: alone and with the requests batched. And
stories260K-hf's log-probabilities (prompt, generated, top) against
transformers' log_softmax (tests/service/logprob_check.py). The
logits themselves are compared in tests/engine/model/test_hf_parity.py (the API
carries tokens, not logits); this checks that the server runs the same model.

Needs torch and transformers (tests/requirements.txt): run it with the venv of
tools/make-venv.sh; ctest does, as hf_server_parity.
"""

import os
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from e2e_support import (MODELS, run_concurrently, start_server,  # noqa: E402
                         with_sampling_controls)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine", "model"))
from test_hf_parity import hf_greedy, randomize  # noqa: E402

STEPS = 32
PROMPTS = [[1, 5, 9, 23, 7], [1, 42], [1, 3, 3, 3, 60, 61, 62, 63, 13, 17, 300], [1, 400, 401]]

FAMILIES = {
    "llama_gqa": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2_bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
}


def make_folder(tmp_path, name):
    """A model with stories260K's 512-token vocabulary, so the folder can use
    its tokenizer.json (the server needs one; requests send token ids)."""
    config_class, extra = FAMILIES[name]
    seed = sorted(FAMILIES).index(name) + 11
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    folder = tmp_path / name
    model.save_pretrained(str(folder), safe_serialization=True)
    shutil.copy(os.path.join(MODELS, "stories260K-hf", "tokenizer.json"), folder)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32, attn_implementation="eager").eval()
    return folder, reference


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_server_greedy_equals_transformers(pb, tmp_path, name):
    folder, reference = make_folder(tmp_path, name)
    torch.set_num_threads(1)
    expected = []
    for prompt in PROMPTS:
        tokens = hf_greedy(reference, prompt, STEPS)
        # The server stops at EOS (2); compare up to and including it.
        expected.append(tokens[:tokens.index(2) + 1] if 2 in tokens else tokens)

    server, client = start_server(["--batch_window=50ms"], model_flags=["--model=%s" % folder])
    try:
        client.bind(pb)
        reqs = [client.request(ids=p, max_new_tokens=STEPS) for p in PROMPTS]
        for req, want in zip(reqs, expected):
            alone = client.generate(req)
            assert alone.code is None, alone
            assert alone.ids == want, "alone"
        together = run_concurrently([lambda r=r: client.generate(r) for r in reqs])
        for res, want in zip(together, expected):
            assert res.code is None and res.ids == want, "batched"
        m = client.metrics()
        assert m.get("coalesce_batch_size_sum") > m.get("coalesce_batch_size_count")
    finally:
        client.close()
        server.kill()


LOGPROB_PROMPTS = [[1, 403, 407, 261, 378, 436, 259, 280, 424, 289, 405], [1, 42],
                   [1, 3, 3, 3, 60, 61, 62, 63, 13, 17, 300, 301, 302, 303, 304, 305, 306, 307]]


def test_logprobs_equal_transformers_log_softmax(pb):
    """stories260K-hf: prompt and generated log-probabilities (top 5 too),
    greedy and sampled, alone and batched, against transformers."""
    from logprob_check import check_alone_and_batched, scored
    folder = os.path.join(MODELS, "stories260K-hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    torch.set_num_threads(1)
    server, client = start_server(["--batch_window=50ms", "--max_batch_tokens=16"],
                                  model_flags=["--model=%s" % folder])
    try:
        client.bind(pb)
        reqs = [scored(client.request(ids=prompt, max_new_tokens=24,
                                      temperature=0.9 if i == 1 else None, seed=5))
                for i, prompt in enumerate(LOGPROB_PROMPTS)]
        _, worst = check_alone_and_batched(torch, reference, client, LOGPROB_PROMPTS, reqs,
                                           run_concurrently)
        print("stories260K-hf: worst log-probability difference %.3g" % worst)
    finally:
        client.close()
        server.kill()


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens
    (those after the first `prompt_length`), which transformers does not
    have: logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""

    def __init__(self, prompt_length, frequency, presence):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_length:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def controlled_greedy(model, prompt, steps, controls):
    """Greedy decoding with transformers' own logits processors for the
    controls (sequence_bias for logit_bias, RepetitionPenaltyLogitsProcessor,
    MinNewTokensLengthLogitsProcessor for min_tokens) and OpenAIPenalties,
    in generate()'s order; stops as the server does (EOS unless ignored,
    stop_token_ids, steps). Recomputes the whole sequence each step."""
    lp = transformers.generation.logits_process
    ends = list(controls.get("stop_token_ids", [])) + ([] if controls.get("ignore_eos") else [2])
    processors = transformers.LogitsProcessorList()
    if controls.get("logit_bias"):
        processors.append(lp.SequenceBiasLogitsProcessor(
            {(t,): b for t, b in controls["logit_bias"].items()}))
    if controls.get("repetition_penalty", 1.0) != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"]))
    if controls.get("min_tokens") and ends:
        processors.append(lp.MinNewTokensLengthLogitsProcessor(
            len(prompt), controls["min_tokens"], ends))
    if controls.get("frequency_penalty") or controls.get("presence_penalty"):
        processors.append(OpenAIPenalties(len(prompt), controls.get("frequency_penalty", 0.0),
                                          controls.get("presence_penalty", 0.0)))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            input_ids = torch.tensor([ids])
            scores = processors(input_ids, model(input_ids).logits[:, -1].float())
            ids.append(int(torch.argmax(scores[0])))  # first maximum: lowest id
            if ids[-1] in ends:
                break
    return ids[len(prompt):]


CONTROLLED = [
    ([1, 403, 407, 261], dict(repetition_penalty=2.0)),
    ([1, 42], dict(repetition_penalty=0.7)),
    ([1, 3, 3, 3, 60, 61], dict(frequency_penalty=0.9, presence_penalty=0.4)),
    ([1, 400, 401], dict(frequency_penalty=-0.5, presence_penalty=1.5, repetition_penalty=1.2)),
    # EOS, raised, comes right after min_tokens.
    ([1, 403, 407, 261], dict(logit_bias={2: 25.0, 280: 4.0, 289: -100.0}, min_tokens=6)),
    ([1, 42], dict(logit_bias={2: 20.0}, ignore_eos=True)),
    # 267 comes second without min_tokens.
    ([1, 400, 401], dict(stop_token_ids=[267, 426], min_tokens=3, repetition_penalty=1.3)),
]


def test_sampling_controls_equal_transformers_processors(pb):
    """stories260K-hf, greedy: each control against transformers' logits
    processor for it (OpenAI's penalties written out above), alone and
    batched; every control changes the tokens; and min_p keeps only what
    transformers' MinPLogitsWarper keeps, where sampling without it does not."""
    folder = os.path.join(MODELS, "stories260K-hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    torch.set_num_threads(1)
    steps = 24
    expected = [controlled_greedy(reference, p, steps, c) for p, c in CONTROLLED]
    plain = [controlled_greedy(reference, p, steps, {}) for p, _ in CONTROLLED]
    for i, (want, base) in enumerate(zip(expected, plain)):
        assert want != base, "case %d: the controls change nothing" % i
    server, client = start_server(["--batch_window=50ms"], model_flags=["--model=%s" % folder])
    try:
        client.bind(pb)
        reqs = [with_sampling_controls(client.request(ids=p, max_new_tokens=steps), c)
                for p, c in CONTROLLED]
        for i, (req, want) in enumerate(zip(reqs, expected)):
            alone = client.generate(req)
            assert alone.code is None, alone
            assert alone.ids == want, "case %d alone" % i
        together = run_concurrently([lambda r=r: client.generate(r) for r in reqs])
        for i, (res, want) in enumerate(zip(together, expected)):
            assert res.code is None and res.ids == want, "case %d batched" % i
        length, stop, eos = 1, 2, 3  # FinishReason
        stopped = together[-1]
        assert stopped.finish == stop and stopped.ids[-1] in (267, 426) and len(stopped.ids) > 3
        assert stopped.usage.completion_tokens == len(stopped.ids)
        assert together[-3].finish == eos and len(together[-3].ids) == 7
        assert together[-2].finish == length
        assert 2 in together[-2].ids[:-1]  # EOS, sent and gone past

        # min_p: every sampled token is among those MinPLogitsWarper keeps
        # after TemperatureLogitsWarper, recomputed on the server's tokens.
        lp = transformers.generation.logits_process
        warpers = transformers.LogitsProcessorList(
            [lp.TemperatureLogitsWarper(1.5), lp.MinPLogitsWarper(0.1)])

        def outside(min_p):
            reqs = []
            for seed in range(6):
                r = client.request(ids=[1, 403, 407], max_new_tokens=16, temperature=1.5, seed=seed)
                r.sampling.min_p = min_p
                reqs.append(r)
            count = 0
            for res in run_concurrently([lambda r=r: client.generate(r) for r in reqs]):
                assert res.code is None, res
                ids = [1, 403, 407] + res.ids
                with torch.no_grad():
                    logits = reference(torch.tensor([ids])).logits[0].float()
                for pos in range(3, len(ids)):
                    kept = warpers(torch.tensor([ids[:pos]]), logits[pos - 1:pos].clone())
                    count += bool(torch.isinf(kept[0, ids[pos]]))
            return count

        assert outside(0.1) == 0
        assert outside(0.0) > 0
    finally:
        client.close()
        server.kill()
