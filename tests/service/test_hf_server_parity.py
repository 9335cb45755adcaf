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

from e2e_support import MODELS, run_concurrently, start_server  # noqa: E402

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
