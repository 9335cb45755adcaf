"""Parity of the engine's GGUF model loader (engine/model/gguf_model.h) + CPU
forward pass with transformers' GGUF loading.

transformers (4.47) reads a GGUF file with `from_pretrained(dir,
gguf_file=name)`: it dequantizes every tensor with PyPI's gguf (which
engine/model/gguf_quant.h matches bit for bit, test_gguf_parity.py) and
undoes llama.cpp's q/k row permutation for llama (not for qwen2, whose rows
the converter leaves in rotate-half order). coalesce-logits (tools/hf_logits)
loads the same file through LoadModel and prints the float32 logits of
greedy decoding, each prompt alone and all prompts batched. They must agree:

- logits: teacher-forced on the engine's tokens (one forward pass over prompt
  + generated tokens), within RELATIVE_TOLERANCE of the largest logit;
- greedy tokens: transformers' own greedy loop must pick the same tokens;
- batching: the batched run must equal the alone runs bit for bit.

Models:

- SmolLM2-135M-Instruct.Q4_1.gguf (llama, tied embeddings; Q4_1, Q8_0 and F32
  tensors), fetched once by gguf_fetch.py, on three real chat prompts
  (transformers' tokenizer from the same file applies the chat template) for
  STEPS steps, dequantized at load and with its matrices kept quantized (as
  the server runs it). The France prompt must answer "The capital of France is
  Paris." Then the Hugging Face folder transformers saves from it
  (save_pretrained) must load in the engine and give the same tokens and the
  same logits, bit for bit: both are the same float32 weights, q/k permuted
  by transformers one way and back by hf_model.cc.
- small random llama and qwen2 files written here with gguf.GGUFWriter (F32,
  F16, Q8_0 and Q4_1 tensors; qwen2 with q/k/v biases), which check the two
  RoPE layouts against transformers' reading of them without the real model
  (a qwen2 file whose q/k rows were not permuted at load would be off by far
  more than the tolerance). They get a llama2.c tokenizer.bin written here
  (--tokenizer), the engine needing a tokenizer to load a model.

Environment: COALESCE_LOGITS (the coalesce-logits binary), COALESCE_GGUF_CACHE
(the download cache); ctest sets both. Needs torch, transformers and gguf
(tests/requirements.txt); without them the test reports itself skipped. The
measured differences are printed (-s).
"""

import json
import os
import struct
import subprocess
import time

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf_fetch import smollm2_path  # noqa: E402  (beside this file)
from test_hf_parity import compare_runs  # noqa: E402  (beside this file)

STEPS = 48
# float32 on both sides, summed in different orders (our kernels' 8 FMA lanes
# per dot product, torch's BLAS blocking): measured on SmolLM2's 30 layers the
# worst difference is ~3e-6 of the largest logit. 1e-4 (the bound of
# test_hf_parity.py and golden_test) leaves a wide margin and still catches
# any real mistake: a wrong RoPE layout, a transposed or swapped tensor, a
# missing bias or a wrong epsilon moves logits by 1e-2 or more.
RELATIVE_TOLERANCE = 1e-4

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea, please."}],
]
FRANCE_ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # transformers' greedy
FRANCE_ANSWER = "The capital of France is Paris."


def logits_binary():
    path = os.environ.get("COALESCE_LOGITS")
    if not path:
        pytest.fail("set COALESCE_LOGITS to the coalesce-logits binary (ctest does)")
    return path


def run_engine(model, prompts, steps, tokenizer=None, keep_quantized=False):
    command = [logits_binary(), "--model", str(model), "--steps", str(steps), "--threads", "2"]
    if tokenizer is not None:
        command += ["--tokenizer", str(tokenizer)]
    if keep_quantized:
        command += ["--keep_quantized", "true"]
    for prompt in prompts:
        command += ["--prompt", ",".join(map(str, prompt))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def hf_greedy(model, prompt, steps):
    """transformers' greedy choice at each step, decoding with its KV cache
    as generate() would (generate() itself fails with this torch; it would
    also stop at EOS)."""
    out = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), past_key_values=transformers.DynamicCache(),
                       use_cache=True)
        for _ in range(steps):
            out.append(int(torch.argmax(result.logits[0, -1])))  # first maximum: lowest id
            result = model(torch.tensor([[out[-1]]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return out


def check_parity(engine, model, prompts, steps, label):
    """test_hf_parity's comparison, with the KV-cached greedy loop above."""
    return compare_runs(engine, model, prompts, steps, label, greedy=hf_greedy,
                        tolerance=RELATIVE_TOLERANCE)


# ---------------------------------------------------------------------------
# SmolLM2-135M-Instruct Q4_1
# ---------------------------------------------------------------------------

def test_smollm2_matches_transformers(tmp_path):
    started = time.monotonic()
    torch.set_num_threads(2)
    path = smollm2_path()
    folder, name = str(path.parent), path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in CHATS]

    engine = run_engine(path, prompts, STEPS)
    info = engine["model"]
    assert info["architecture"] == "llama" and info["vocab_size"] == 49152, info
    assert info["max_seq_len"] == 8192 and info["bos_token_id"] == 1, info
    assert info["eos_token_ids"] == [2], info
    check_parity(engine, model, prompts, STEPS, "SmolLM2-135M-Instruct.Q4_1.gguf")

    france = engine["alone"][0]["tokens"]
    assert france[:len(FRANCE_ANSWER_IDS)] == FRANCE_ANSWER_IDS, france
    assert tokenizer.decode(france[:len(FRANCE_ANSWER_IDS)], skip_special_tokens=True) == (
        FRANCE_ANSWER)
    for p, alone in enumerate(engine["alone"]):
        print(f"prompt {p}: {alone['tokens']}\n  {tokenizer.decode(alone['tokens'])!r}")

    # The Q4_1 and Q8_0 matrices kept in their blocks, as the server runs the
    # file on the CPU (each sub-block's scale applied to its sum of integers
    # times activations: engine/cpu/quant_matmul.h): transformers' logits
    # within the same tolerance, its greedy tokens, batched equal to alone
    # bit for bit.
    kept = run_engine(path, prompts, STEPS, keep_quantized=True)
    worst = check_parity(kept, model, prompts, STEPS, "SmolLM2 Q4_1 kept quantized")
    print(f"kept quantized: transformers' tokens, logits within {worst:.3g} of the largest")

    # The Hugging Face folder transformers makes of the same file.
    saved = tmp_path / "smollm2-hf"
    model.save_pretrained(str(saved))
    tokenizer.save_pretrained(str(saved))
    from_folder = run_engine(saved, prompts, STEPS)
    for p in range(len(prompts)):
        assert from_folder["alone"][p]["tokens"] == engine["alone"][p]["tokens"], (
            f"prompt {p}: the saved folder decodes differently")
        assert from_folder["alone"][p]["logits"] == engine["alone"][p]["logits"], (
            f"prompt {p}: the saved folder's logits differ from the GGUF file's")
    print(f"save_pretrained folder: same tokens and bit-identical logits; "
          f"test took {time.monotonic() - started:.1f} s")


# ---------------------------------------------------------------------------
# Small random files: both architectures and RoPE layouts
# ---------------------------------------------------------------------------

RANDOM_STEPS = 24
RANDOM_PROMPTS = [[1, 5, 9, 23, 7], [1, 42], [1, 3, 3, 3, 60, 61, 62, 63, 13, 17, 2]]
DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 160, 2, 4, 2, 320


def write_tokenizer_bin(path, vocab):
    """A llama2.c tokenizer.bin: <unk>, <s>, </s>, the 256 byte tokens, then
    filler pieces."""
    pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % i for i in range(256)]
    pieces += [b"t%d" % i for i in range(len(pieces), vocab)]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(map(len, pieces))))
        for piece in pieces:
            f.write(struct.pack("<fi", 0.0, len(piece)) + piece)


def write_random_gguf(path, arch, seed, matrix_type=None):
    """A small model with random weights that give peaked logits. llama: an
    untied classifier, vocab_size from tokenizer.ggml.tokens; qwen2: q/k/v
    biases, tied, vocab_size from the key. Tensors in F32, F16, Q8_0 and
    Q4_1; with matrix_type, every matrix in that type instead (the same
    floats for the same seed)."""
    rng = np.random.default_rng(seed)
    kv = DIM // HEADS * KV_HEADS

    def normal(std, *shape):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    w.add_rope_dimension_count(DIM // HEADS)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if arch == "llama":
        w.add_token_list([f"t{i}" for i in range(VOCAB)])
    else:
        w.add_vocab_size(VOCAB)

    def add(name, array, qtype=T.F32):
        if matrix_type is not None and array.ndim == 2:
            qtype = matrix_type
        if qtype == T.F32:
            w.add_tensor(name, array)
        elif qtype == T.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", normal(0.5, VOCAB, DIM), T.Q8_0)
    add("output_norm.weight", 1 + normal(0.2, DIM))
    if arch == "llama":
        add("output.weight", normal(0.5, VOCAB, DIM), T.F16)
    for layer in range(LAYERS):
        b = f"blk.{layer}."
        add(b + "attn_norm.weight", 1 + normal(0.2, DIM))
        add(b + "attn_q.weight", normal(0.15, DIM, DIM), T.Q8_0)
        add(b + "attn_k.weight", normal(0.15, kv, DIM), T.F16)
        add(b + "attn_v.weight", normal(0.08, kv, DIM), T.Q4_1)
        add(b + "attn_output.weight", normal(0.08, DIM, DIM))
        if arch == "qwen2":
            add(b + "attn_q.bias", normal(0.5, DIM))
            add(b + "attn_k.bias", normal(0.5, kv))
            add(b + "attn_v.bias", normal(0.5, kv))
        add(b + "ffn_norm.weight", 1 + normal(0.2, DIM))
        add(b + "ffn_gate.weight", normal(0.08, HIDDEN, DIM), T.Q8_0)
        add(b + "ffn_up.weight", normal(0.08, HIDDEN, DIM))
        add(b + "ffn_down.weight", normal(0.08, DIM, HIDDEN), T.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_random_gguf_matches_transformers(tmp_path, arch):
    torch.set_num_threads(2)
    path = tmp_path / f"random-{arch}.gguf"
    write_random_gguf(path, arch, seed=7 if arch == "llama" else 8)
    tokenizer_bin = tmp_path / "tokenizer.bin"
    write_tokenizer_bin(tokenizer_bin, VOCAB)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, torch_dtype=torch.float32,
        attn_implementation="eager"
    ).eval()
    assert model.config.model_type == arch
    assert model.config.tie_word_embeddings == (arch == "qwen2")

    engine = run_engine(path, RANDOM_PROMPTS, RANDOM_STEPS, tokenizer=tokenizer_bin)
    info = engine["model"]
    assert info["architecture"] == arch and info["name"] == f"random-{arch}", info
    assert info["vocab_size"] == VOCAB and info["max_seq_len"] == 128, info
    assert info["bos_token_id"] == 1 and info["eos_token_ids"] == [2], info
    check_parity(engine, model, RANDOM_PROMPTS, RANDOM_STEPS, f"random {arch} GGUF")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantize_at_load_writes_the_blocks_gguf_writes(tmp_path, arch, qtype):
    """--quantize: the engine quantizes a float32 model at load into the
    blocks gguf.quants.quantize (ggml's reference quantization) writes for the
    same floats. So the float32 file quantized at load and the file quantized
    by gguf must give the same logits, bit for bit, and differ from the float
    model's."""
    floats, quantized = tmp_path / "f32.gguf", tmp_path / f"{qtype}.gguf"
    seed = 11 if arch == "llama" else 12
    write_random_gguf(floats, arch, seed, matrix_type=T.F32)
    write_random_gguf(quantized, arch, seed, matrix_type=getattr(T, qtype.upper()))
    tokenizer_bin = tmp_path / "tokenizer.bin"
    write_tokenizer_bin(tokenizer_bin, VOCAB)

    def run(model, *flags):
        command = [logits_binary(), "--model", str(model), "--steps", str(RANDOM_STEPS),
                   "--threads", "2", "--tokenizer", str(tokenizer_bin), *flags]
        for prompt in RANDOM_PROMPTS:
            command += ["--prompt", ",".join(map(str, prompt))]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout), done.stderr

    at_load, log = run(floats, "--quantize", qtype)
    assert f"--quantize={qtype.upper()}: " in log, log
    by_gguf, _ = run(quantized, "--keep_quantized", "true")
    float_run, _ = run(floats)
    for p in range(len(RANDOM_PROMPTS)):
        assert at_load["alone"][p]["logits"] == by_gguf["alone"][p]["logits"], (
            f"prompt {p}: quantized at load differs from gguf's {qtype} blocks")
        assert at_load["batched"][p]["logits"] == at_load["alone"][p]["logits"], p
    assert any(at_load["alone"][p]["logits"] != float_run["alone"][p]["logits"]
               for p in range(len(RANDOM_PROMPTS))), "quantizing changed nothing"
