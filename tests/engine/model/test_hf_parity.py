"""Parity of the engine's Hugging Face loader + CPU forward pass with transformers.

Small randomly initialised models (fixed seeds) of each supported family are
saved with save_pretrained into a temporary folder; coalesce-logits loads each
folder and prints the float32 logits of 40 greedy steps for three prompts,
each prompt alone and all three batched. transformers, loading the same folder
in float32, must agree:

- logits: teacher-forced on the engine's tokens (one forward pass over prompt +
  generated tokens), so a near-tie cannot make the two sides compare different
  contexts;
- greedy tokens: transformers' own greedy loop must pick the same 40 tokens;
- batching: the batched run must equal the alone runs bit for bit (the CPU
  backend is batch-invariant by construction).

Environment: COALESCE_LOGITS (the coalesce-logits binary; set by ctest),
COALESCE_MODELS_DIR (for stories260K-hf, optional). Run this file with an
interpreter that has torch and transformers (tests/requirements.txt); without
them it reports itself skipped. The measured differences are printed (-s).
"""

import json
import os
import subprocess

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

STEPS = 40
# Token ids < 64 so that every test vocabulary has them.
PROMPTS = [
    [1, 5, 9, 23, 7],
    [1, 42],
    [1, 3, 3, 3, 60, 61, 62, 63, 13, 17, 2],
]
# float32 on both sides, summed in different orders: our kernels use 8 FMA
# lanes per dot product, torch's BLAS its own blocking. Each product of length
# k carries about sqrt(k) * 6e-8 relative error, compounded over the layers
# and attention; measured, the worst difference is ~1e-6 relative to the
# largest logit. 1e-4 relative (the same bound golden_test uses against
# run.c) leaves a wide margin while still catching any real mistake (a wrong
# RoPE layout or scaling, a missing bias or a wrong norm moves logits by 1e-2
# or more).
RELATIVE_TOLERANCE = 1e-4

# Shared shape of the random models: 4 query heads of 16, 2 KV heads (GQA),
# 2 layers.
BASE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and theta 10000 the pair wavelengths are 6.3, 19.9,
    # 63, ...: pair 0 stays, pair 1 is interpolated, the rest divided by 8.
    "original_max_position_embeddings": 32,
}

# name -> (config class name, extra config, dtype to save in, save_pretrained kwargs)
CASES = {
    "llama_gqa_tied": ("LlamaConfig", dict(tie_word_embeddings=True), torch.float32, {}),
    "llama3_scaling_untied": (
        "LlamaConfig",
        dict(tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING, rope_theta=10000.0),
        torch.float32,
        {},
    ),
    "llama_attention_bias": (
        "LlamaConfig",
        dict(attention_bias=True, tie_word_embeddings=False),
        torch.float32,
        {},
    ),
    "mistral": (
        "MistralConfig",
        dict(sliding_window=96, tie_word_embeddings=False, rope_theta=1e6),
        torch.float32,
        {},
    ),
    "qwen2_bias_untied": ("Qwen2Config", dict(tie_word_embeddings=False), torch.float32, {}),
    "qwen2_bias_tied": ("Qwen2Config", dict(tie_word_embeddings=True), torch.float32, {}),
    # One KV head shared by three query heads of 32 (multi-query attention).
    "qwen2_mqa_three_heads": (
        "Qwen2Config",
        dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
             tie_word_embeddings=False),
        torch.float32,
        {},
    ),
    "llama_bf16": ("LlamaConfig", dict(tie_word_embeddings=False), torch.bfloat16, {}),
    "llama_f16": ("LlamaConfig", dict(tie_word_embeddings=True), torch.float16, {}),
    # About 50 KB per shard: the checkpoint is split over ~12 files and the
    # index file is what the loader reads.
    "llama_sharded": (
        "LlamaConfig",
        dict(tie_word_embeddings=False),
        torch.float32,
        dict(max_shard_size="50KB"),
    ),
}


def logits_binary():
    path = os.environ.get("COALESCE_LOGITS")
    if not path:
        pytest.fail("set COALESCE_LOGITS to the coalesce-logits binary (ctest does)")
    return path


def randomize(model, seed):
    """Replaces transformers' init (std 0.02, zero biases, unit norms), under
    which logits are nearly flat and biases and norms would go untested, with
    weights that give peaked logits and non-trivial attention."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * torch.randn(p.shape, generator=generator)
            elif name.endswith(".bias"):
                value = 0.5 * torch.randn(p.shape, generator=generator)
            elif "embed_tokens" in name or "lm_head" in name:
                value = 0.5 * torch.randn(p.shape, generator=generator)
            elif "q_proj" in name or "k_proj" in name:
                value = 0.15 * torch.randn(p.shape, generator=generator)
            else:
                value = 0.08 * torch.randn(p.shape, generator=generator)
            p.copy_(value)


def make_model(tmp_path, name):
    config_class, extra, dtype, save_kwargs = CASES[name]
    seed = sorted(CASES).index(name) + 1
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**BASE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    folder = tmp_path / name
    model.to(dtype).save_pretrained(str(folder), safe_serialization=True, **save_kwargs)
    return folder


def run_engine(folder):
    command = [logits_binary(), "--model", str(folder), "--steps", str(STEPS), "--threads", "2"]
    for prompt in PROMPTS:
        command += ["--prompt", ",".join(map(str, prompt))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def reference_model(folder):
    # Weights saved as F16/BF16 are upcast exactly, as the engine does.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(model, prompt, steps):
    """transformers' greedy choice at each step, recomputing the whole sequence
    each time (no cache, no generate(): generate would stop at EOS)."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            out.append(int(torch.argmax(logits)))  # first maximum: lowest id
            ids.append(out[-1])
    return out


def compare_runs(engine, model, prompts, steps, label, greedy=None, tolerance=RELATIVE_TOLERANCE):
    """Compares coalesce-logits' output `engine` (prompts run alone and
    batched) with transformers' `model`: batched equal to alone bit for bit,
    logits within `tolerance` of the largest (teacher-forced on the engine's tokens),
    and the greedy tokens `greedy(model, prompt, steps)` picks (hf_greedy by
    default). Prints and returns the worst relative logit difference."""
    greedy = greedy or hf_greedy
    worst = 0.0
    for p, prompt in enumerate(prompts):
        alone, batched = engine["alone"][p], engine["batched"][p]
        # Batch invariance: exact, not approximate.
        assert batched["tokens"] == alone["tokens"], f"{label} prompt {p}: batched tokens differ"
        assert batched["logits"] == alone["logits"], f"{label} prompt {p}: batched logits differ"

        tokens = alone["tokens"]
        ours = torch.tensor(alone["logits"], dtype=torch.float32)  # [steps, vocab]
        with torch.no_grad():
            full = model(torch.tensor([prompt + tokens[:-1]])).logits[0]
        reference = full[len(prompt) - 1 :]  # the logits after each step's input
        assert reference.shape == ours.shape == (steps, model.config.vocab_size)
        scale = max(1.0, float(reference.abs().max()))
        diff = (ours - reference).abs().max(dim=1).values / scale  # [steps]
        worst = max(worst, float(diff.max()))
        bad = int(torch.argmax(diff))
        assert float(diff[bad]) <= tolerance, (
            f"{label} prompt {p}: step {bad} logits differ by {float(diff[bad]):.3g} "
            f"relative to {scale:.3g}"
        )

        expected = greedy(model, prompt, steps)
        if tokens != expected:
            step = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
            top2 = torch.topk(reference[step], 2).values
            pytest.fail(
                f"{label} prompt {p}: greedy token {step} is {tokens[step]}, transformers "
                f"picks {expected[step]} (reference top-2 gap {float(top2[0] - top2[1]):.3g})"
            )
    print(f"\n{label}: max |logit difference| / max |logit| = {worst:.3g} over "
          f"{len(prompts)} prompts x {steps} steps (tolerance {tolerance:g})")
    return worst


def check_parity(folder, label):
    engine = run_engine(folder)
    model = reference_model(folder)
    torch.set_num_threads(2)
    compare_runs(engine, model, PROMPTS, STEPS, label)
    return engine


@pytest.mark.parametrize("name", sorted(CASES))
def test_random_model_matches_transformers(tmp_path, name):
    folder = make_model(tmp_path, name)
    engine = check_parity(folder, name)
    info = engine["model"]
    if name == "mistral":
        assert info["max_seq_len"] == 96, "context must be clamped to the sliding window"
    if name == "llama_sharded":
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("model-*.safetensors"))) > 2
    assert info["eos_token_ids"] == [2] and info["bos_token_id"] == 1


def test_stories260k_hf_matches_transformers():
    models = os.environ.get("COALESCE_MODELS_DIR")
    if not models or not os.path.isdir(os.path.join(models, "stories260K-hf")):
        pytest.skip("COALESCE_MODELS_DIR/stories260K-hf not found")
    check_parity(os.path.join(models, "stories260K-hf"), "stories260K-hf")
