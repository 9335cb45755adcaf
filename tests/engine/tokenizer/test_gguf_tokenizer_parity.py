"""Parity of coalesce's GGUF tokenizer (engine/tokenizer/gguf_tokenizer.h) with
transformers' tokenizer built from the same GGUF file.

The file is the real SmolLM2-135M-Instruct.Q4_1.gguf ("gpt2" byte-level BPE,
tokenizer.ggml.pre "smollm", 17 control tokens), fetched once into
COALESCE_GGUF_CACHE by ../model/gguf_fetch.py. coalesce-tokenize --gguf
(tools/tokenize) encodes and decodes with coalesce's tokenizer;
transformers 4.47's AutoTokenizer.from_pretrained(folder, gguf_file=name) is
the reference:

- ChatML prompts rendered by transformers' apply_chat_template from several
  conversations (plain and accented text, CJK, emoji, code, odd white space,
  special tokens written in the content) encode to the same ids with
  add_special_tokens=False;
- generated-like id sequences (prompt ids, answers, <|im_end|>, random ids,
  special ids) decode to the same text as transformers' decode with
  skip_special_tokens=True, and streaming them gives that text too.

Where they differ by design (asserted below, so a change shows):

- transformers' GGUF converter ignores tokenizer.ggml.pre: its pre-tokenizer is
  GPT-2's ByteLevel alone, while llama.cpp, SmolLM2's own tokenizer.json and
  coalesce split every digit off first (HF's Digits(individual_digits=True)).
  SmolLM2's merges never join a digit to anything, so digits alone give the
  same ids; white space before a digit does not ("x  1": the two spaces are one
  token when the digit is split off first). The prompts compared keep digits
  out; a `tokenizers` tokenizer built here with SmolLM2's own layout (Digits +
  ByteLevel) is compared on text with digits instead.
- transformers prepends BOS (<|im_start|>) with add_special_tokens=True even
  though the file says tokenizer.ggml.add_bos_token = false; coalesce, like
  llama.cpp and SmolLM2's own tokenizer, adds none.
- transformers' GGUF tokenizer cleans up tokenization spaces when decoding
  (" ," -> ","): the comparison turns that off (clean_up_tokenization_spaces=
  False), and is repeated with the backend `tokenizers` decoder.

Environment: COALESCE_TOKENIZE (the CLI), COALESCE_GGUF_CACHE (the download
cache); ctest sets both. Needs transformers, tokenizers, gguf and jinja2
(tests/requirements.txt); without them the test reports itself skipped.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not importable: install tests/requirements.txt into the "
    "interpreter ctest uses (COALESCE_PYTHON)",
)
tokenizers = pytest.importorskip("tokenizers", reason="HF `tokenizers` is not importable")
pytest.importorskip("gguf", reason="PyPI `gguf` (transformers' GGUF reader) is not importable")
pytest.importorskip("jinja2", reason="jinja2 (apply_chat_template) is not importable")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from gguf_fetch import smollm2_path  # noqa: E402  (tests/engine/model/gguf_fetch.py)

CLI = os.environ.get("COALESCE_TOKENIZE", "")
SEED = 20260302
IM_START, IM_END, ENDOFTEXT = 1, 2, 0

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering: short wavelengths scatter more."},
     {"role": "user", "content": "And sunsets? Don't be vague, it's important!"}],
    [{"role": "user", "content": "Translate: « Où est la gare ? » — s'il vous plaît, "
                                 "ça coûte combien ? Straße, naïve café, Ærøskøbing."}],
    [{"role": "user", "content": "東京はどこですか？我想在北京工作。서울은 아름답다. "
                                 "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم"}],
    [{"role": "user", "content": "Emoji time 😀🚀🦙 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ ✅"}],
    [{"role": "user", "content": "Fix this:\n\n```python\ndef add(a, b):\n\treturn a+b  "
                                 "# sum\n\n\nprint(add(a, b))\n```\n"}],
    [{"role": "user", "content": "   leading spaces,   inner   runs\t\ttabs\r\nwindows line\n"
                                 "\n\n  trailing   "}],
    [{"role": "user", "content": "Write <|im_end|> and <|im_start|>user literally, "
                                 "plus <|endoftext|><repo_name> and <file_sep>."}],
    [{"role": "user", "content": "I'm sure we'll see they've said you're right; "
                                 "HE'LL SAY IT'S FINE. O'Neil's dog."}],
    [{"role": "user", "content": "Symbols: @#$%^&*()_+-=[]{}|;:',.<>/?`~ \\ \" … — – · • ©"}],
    [{"role": "user", "content": "Ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ and ligatures ﬁ ﬂ, "
                                 "combining e\u0301 and precomposed é, a\u00a0b\u2009c"}],
]

# Answers a model might give, for decode sequences.
ANSWERS = [
    "The capital of France is Paris.",
    "Rayleigh scattering makes the sky look blue; sunsets redden as light travels further.",
    " Où est la gare ? La gare est là-bas, à gauche.",
    "東京は日本の首都です。",
    "Sure! 🚀 Here you go:\n\n```python\ndef add(a, b):\n    return a + b\n```",
    "  spaced  out  ",
    "In 2024, 3.14 and ½ are numbers.",
]


@pytest.fixture(scope="module")
def model_path():
    return smollm2_path()


@pytest.fixture(scope="module")
def hf(model_path):
    return transformers.AutoTokenizer.from_pretrained(str(model_path.parent),
                                                      gguf_file=model_path.name)


def run_cli(model_path, lines, tmp_path):
    if not CLI:
        pytest.fail("set COALESCE_TOKENIZE to the coalesce-tokenize binary (ctest does)")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines), "utf-8")
    proc = subprocess.run([CLI, "--gguf", str(model_path), "--input", str(inp)],
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
    out = [json.loads(line) for line in proc.stdout.decode("utf-8").splitlines()]
    assert len(out) == len(lines) + 1
    return out[0], out[1:]


def prompts(hf):
    out = []
    for conv in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            p = hf.apply_chat_template(conv, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
            assert p.startswith("<|im_start|>") and "<|im_end|>" in p, p
            # No numbers at all (\p{N}): see the module docstring.
            assert not any(ch.isnumeric() for ch in p), p
            out.append(p)
    return out


def smollm2_layout(hf):
    """A `tokenizers` tokenizer with SmolLM2's own tokenizer.json layout
    (HuggingFaceTB/SmolLM2-135M-Instruct): the GGUF's vocabulary and merges,
    Digits(individual_digits) then ByteLevel, the control tokens special."""
    spec = json.loads(hf.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}
    spec["normalizer"] = None
    spec["post_processor"] = None
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True}
    spec["model"]["byte_fallback"] = False
    spec["model"]["unk_token"] = None
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def test_header(model_path, tmp_path):
    header, _ = run_cli(model_path, [], tmp_path)
    assert header["vocab_size"] == 49152
    assert header["bos_id"] == -1  # tokenizer.ggml.add_bos_token = false
    # eos_token_id (<|im_end|>), then the control end markers (<|endoftext|>).
    assert header["eos_ids"] == [IM_END, ENDOFTEXT]
    assert header["decodes_per_token"] is True
    assert header["load_notes"] == []


def test_chat_prompts_encode_as_transformers(hf, model_path, tmp_path):
    texts = prompts(hf)
    # The contents alone, and pieces of the prompts, too.
    texts += [m["content"] for conv in CONVERSATIONS for m in conv]
    texts += [p[k:] for p in prompts(hf)[:6] for k in (1, 5, 13)]
    _, out = run_cli(model_path, texts, tmp_path)
    backend = hf.backend_tokenizer
    mismatches = []
    for text, o in zip(texts, out):
        ref = hf.encode(text, add_special_tokens=False)
        assert backend.encode(text, add_special_tokens=False).ids == ref
        if o["without"] != ref:
            mismatches.append((text, o["without"], ref))
        # No BOS from coalesce; transformers adds <|im_start|> (see above).
        assert o["with"] == o["without"]
        assert hf.encode(text, add_special_tokens=True) == [IM_START] + ref
        assert o["decoded_without"] == hf.decode(ref, skip_special_tokens=True,
                                                 clean_up_tokenization_spaces=False)
    assert not mismatches, mismatches[:3]
    print(f"{len(texts)} texts encode to transformers' ids")


def test_digits_split_as_llamacpp_not_as_transformers(hf, model_path, tmp_path):
    texts = ["2024", "in 2024", "x  1", "a\n\n2b", "Call 555-0199 now", "π ≈ 3.14159",
             "½ cup, 2² = 4", "٣ ٤ ٥", "version 10.0.1   (build 42)"] + ANSWERS
    _, out = run_cli(model_path, texts, tmp_path)
    layout = smollm2_layout(hf)
    ids = {t: o["without"] for t, o in zip(texts, out)}
    for text in texts:
        # Ours is SmolLM2's own tokenizer (and llama.cpp's "smollm").
        assert ids[text] == layout.encode(text, add_special_tokens=False).ids, text
    # Every digit on its own, as in transformers too (SmolLM2's merges never
    # join digits)...
    digit_ids = [hf.convert_tokens_to_ids(d) for d in "2024"]
    assert ids["2024"] == digit_ids
    assert hf.encode("2024", add_special_tokens=False) == digit_ids
    # ... but white space before a digit: transformers' GPT-2 regex keeps one
    # space with the digit, which then stands alone; with the digit split off
    # the two spaces are one token ("ĠĠ").
    ref = hf.encode("x  1", add_special_tokens=False)
    assert ids["x  1"] != ref
    assert [hf.convert_ids_to_tokens(i) for i in ids["x  1"]] == ["x", "ĠĠ", "1"]
    assert hf.convert_ids_to_tokens(ref) == ["x", "Ġ", "Ġ", "1"]


def test_decode_as_transformers(hf, model_path, tmp_path):
    rng = random.Random(SEED)
    prompt_ids = [hf.encode(p, add_special_tokens=False) for p in prompts(hf)]
    answer_ids = [hf.encode(a, add_special_tokens=False) for a in ANSWERS]
    specials = list(range(17))
    vocab = len(hf)
    assert vocab == 49152
    seqs = []
    for p in prompt_ids:
        a = rng.choice(answer_ids)
        seqs.append(p + a + [IM_END])  # prompt, answer, end of turn
        seqs.append(a + [IM_END, ENDOFTEXT])
        seqs.append(a[: len(a) // 2])  # cut mid-answer (maybe mid-character)
    for _ in range(400):
        n = rng.randint(1, 24)
        seqs.append([rng.randrange(vocab) if rng.random() > 0.1 else rng.choice(specials)
                     for _ in range(n)])
    # Byte tokens that split a character between them.
    emoji = hf.encode("🦙🚀", add_special_tokens=False)
    seqs += [emoji[:k] for k in range(len(emoji) + 1)]
    lines = [{"ids": s} for s in seqs]
    _, out = run_cli(model_path, lines, tmp_path)
    backend = hf.backend_tokenizer
    for s, o in zip(seqs, out):
        ref = hf.decode(s, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert o["decoded"] == ref, s
        assert backend.decode(s, skip_special_tokens=True) == ref
        # Streaming the ids gives the same text.
        assert "".join(o["streamed"]) == ref, s
    # transformers cleans up spaces by default; coalesce does not.
    s = hf.encode("Hello , world !", add_special_tokens=False)
    assert hf.decode(s, skip_special_tokens=True) == "Hello, world!"
    _, out = run_cli(model_path, [{"ids": s}], tmp_path)
    assert out[0]["decoded"] == "Hello , world !"
    print(f"{len(seqs)} id sequences decode as transformers does")


def test_split_special_tokens_as_transformers(hf, model_path, tmp_path):
    """transformers' split_special_tokens=True: the control tokens written in
    the text ("<|im_end|>", "<repo_name>") are the text they spell. The chat
    prompts hold the template's own <|im_start|> and <|im_end|>, and one
    conversation writes them in its content too."""
    texts = prompts(hf) + [m["content"] for conv in CONVERSATIONS for m in conv]
    texts += ["<|im_start|>system\nObey<|im_end|>", "<|endoftext|><|endoftext|>", "<|im_end"]
    _, out = run_cli(model_path, texts, tmp_path)
    differ = 0
    for text, o in zip(texts, out):
        ref = hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert o["split_without"] == ref, text
        assert o["split"] == ref  # the file adds no BOS
        assert not set(ref) & set(range(17)), text  # no control token is left
        differ += o["split_without"] != o["without"]
    assert differ >= len(prompts(hf))
    print(f"{len(texts)} texts split as transformers splits them, {differ} of them differently "
          "from the default")
