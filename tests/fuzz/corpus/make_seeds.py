"""Writes the seed inputs of the Hugging Face and GGUF fuzz targets
(tools/fuzz.sh passes corpus/<target> to each): small valid model folders for
hf_model_fuzz, small tokenizer.json files and texts for hf_tokenizer_fuzz, and
small GGUF files for gguf_fuzz, in the input formats those targets read.
Without seeds the fuzzer would take hours to produce a safetensors header
whose tensors tile the data and match config.json, or a GGUF tensor table
whose offsets are aligned and inside the file. Run from anywhere:
python3 tests/fuzz/corpus/make_seeds.py
"""

import json
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------
# hf_model_fuzz: 2-byte little-endian config length, config.json, safetensors
# ---------------------------------------------------------------------------

SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def safetensors(tensors):
    """tensors: [(name, dtype, shape)], data a counting pattern."""
    header, data = {}, bytearray()
    for i, (name, dtype, shape) in enumerate(tensors):
        n = 1
        for d in shape:
            n *= d
        begin = len(data)
        if dtype == "F32":
            data += struct.pack(f"<{n}f", *[(i + k % 7) / 8 for k in range(n)])
        elif dtype == "F16":
            data += struct.pack(f"<{n}e", *[(i + k % 7) / 8 for k in range(n)])
        else:  # BF16: the top half of the float32
            data += b"".join(struct.pack("<f", (i + k % 7) / 8)[2:] for k in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, len(data)]}
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # as the safetensors crate pads it
    return struct.pack("<Q", len(text)) + text + bytes(data)


def model_tensors(config, dtypes, extra=()):
    d, h = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * (d // heads)
    v = config["vocab_size"]
    qkv_bias = config["architectures"] == ["Qwen2ForCausalLM"] or config.get("attention_bias")
    o_bias = config.get("attention_bias")
    out = [("model.embed_tokens.weight", [v, d]), ("model.norm.weight", [d])]
    if not config.get("tie_word_embeddings"):
        out.append(("lm_head.weight", [v, d]))
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", [d]), (p + "self_attn.q_proj.weight", [d, d]),
                (p + "self_attn.k_proj.weight", [kv, d]), (p + "self_attn.v_proj.weight", [kv, d]),
                (p + "self_attn.o_proj.weight", [d, d]),
                (p + "post_attention_layernorm.weight", [d]),
                (p + "mlp.gate_proj.weight", [h, d]), (p + "mlp.up_proj.weight", [h, d]),
                (p + "mlp.down_proj.weight", [d, h])]
        if qkv_bias:
            out += [(p + "self_attn.q_proj.bias", [d]), (p + "self_attn.k_proj.bias", [kv]),
                    (p + "self_attn.v_proj.bias", [kv])]
        if o_bias:
            out.append((p + "self_attn.o_proj.bias", [d]))
    out += list(extra)
    return [(name, dtypes[i % len(dtypes)], shape) for i, (name, shape) in enumerate(out)]


def model_seed(config, dtypes, extra=()):
    text = json.dumps(config, separators=(",", ":")).encode()
    return struct.pack("<H", len(text)) + text + safetensors(model_tensors(config, dtypes, extra))


BASE = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4,
        "max_position_embeddings": 16}
MODELS = {
    "llama-tied-f32": model_seed(
        {"architectures": ["LlamaForCausalLM"], **BASE, "tie_word_embeddings": True,
         "bos_token_id": 1, "eos_token_id": [2, 3]}, ["F32"]),
    "llama-bias-llama3-rope-f16": model_seed(
        {"architectures": ["LlamaForCausalLM"], **BASE, "attention_bias": True,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
        ["F16", "F32"], [("model.layers.0.self_attn.rotary_emb.inv_freq", [2])]),
    "qwen2-bf16": model_seed(
        {"architectures": ["Qwen2ForCausalLM"], **BASE, "num_hidden_layers": 2,
         "use_sliding_window": False, "sliding_window": 8, "rope_theta": 1000000.0},
        ["BF16", "F32", "F16"]),
    "mistral-window": model_seed(
        {"architectures": ["MistralForCausalLM"], **BASE, "num_key_value_heads": 2,
         "sliding_window": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5}, ["BF16"]),
}

# ---------------------------------------------------------------------------
# hf_tokenizer_fuzz: 0x00, tokenizer.json, NUL, text; or 0x01, text
# ---------------------------------------------------------------------------


def added(i, content, **flags):
    token = {"id": i, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False}
    token.update(flags)
    return token


SENTENCEPIECE = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [added(0, "<unk>", special=True), added(1, "<s>", special=True),
                     added(2, "</s>", special=True), added(11, "[INST]", lstrip=True, rstrip=True)],
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "pre_tokenizer": None,
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                  {"Sequence": {"id": "A", "type_id": 0}}],
                       "pair": [],
                       "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "fuse_unk": True,
              "byte_fallback": True,
              "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4,
                        "\u2581": 5, "a": 6, "b": 7, "\u2581a": 8, "ab": 9, "\u2581ab": 10},
              "merges": ["\u2581 a", "a b", "\u2581a b"]},
}

BYTE_LEVEL = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [added(6, "<|endoftext|>", special=True),
                     added(7, "fix", normalized=True, single_word=True)],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "NFC"}]},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
                                               " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]},
    "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                       "use_regex": False},
    "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                "use_regex": False},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "ignore_merges": True,
              "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120a": 4, "\u0120ab": 5},
              "merges": [["a", "b"], ["\u0120", "a"], ["\u0120a", "b"]]},
}

METASPACE = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [added(0, "<unk>", special=True), added(6, "<mask>", special=True,
                                                           single_word=True)],
    "normalizer": {"type": "NFD"},
    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                      "split": True},
    "post_processor": None,
    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                "split": True},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": False,
              "continuing_subword_prefix": None, "end_of_word_suffix": None,
              "vocab": {"<unk>": 0, "\u2581": 1, "a": 2, "\u2581a": 3, "e": 4, "\u0301": 5},
              "merges": ["\u2581 a"]},
}

TEXT = "Hello w\u00f6rld <s> [INST] ab\u00e9 e\u0301 \uac00\u1100\u1161 \ufb01x 12 \U0001f600\n\t"
TOKENIZERS = {
    "sentencepiece": b"\x00" + json.dumps(SENTENCEPIECE).encode() + b"\x00" + TEXT.encode(),
    "byte-level-nfkc": b"\x00" + json.dumps(BYTE_LEVEL).encode() + b"\x00" + TEXT.encode(),
    "metaspace-nfd": b"\x00" + json.dumps(METASPACE).encode() + b"\x00" + TEXT.encode(),
    "text": b"\x01" + TEXT.encode(),
    "text-code": b"\x01def f(x):\n    return x + 1  # caf\xc3\xa9 \xe2\x80\x94 <|endoftext|></s>",
}

# ---------------------------------------------------------------------------
# gguf_fuzz: GGUF files (engine/model/gguf_file.h describes the layout)
# ---------------------------------------------------------------------------

GGUF_SCALARS = {"u8": (0, "B"), "i8": (1, "b"), "u16": (2, "H"), "i16": (3, "h"), "u32": (4, "I"),
                "i32": (5, "i"), "f32": (6, "f"), "bool": (7, "?"), "u64": (10, "Q"),
                "i64": (11, "q"), "f64": (12, "d")}
GGUF_STRING, GGUF_ARRAY = 8, 9
# ggml type id -> (block size, bytes per block), the types gguf_fuzz dequantizes.
GGML_TYPES = {"F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2), "Q4_0": (2, 32, 18),
              "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
              "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
              "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}


def gguf_string(s):
    data = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(data)) + data


def gguf_value(kind, value):
    """(type id, bytes) of a value: kind is a GGUF_SCALARS name, "string",
    or ("array", item kind) with a list of values."""
    if kind == "string":
        return GGUF_STRING, gguf_string(value)
    if isinstance(kind, tuple):
        item_type = None
        body = b""
        for item in value:
            item_type, data = gguf_value(kind[1], item)
            body += data
        if item_type is None:
            item_type = gguf_value(kind[1], [] if isinstance(kind[1], tuple) else 0)[0]
        return GGUF_ARRAY, struct.pack("<IQ", item_type, len(value)) + body
    type_id, fmt = GGUF_SCALARS[kind]
    return type_id, struct.pack("<" + fmt, value)


def gguf_file(metadata, tensors, version=3, alignment=32):
    """metadata: [(key, kind, value)]; tensors: [(name, type name, dims)],
    their data a byte pattern with f16 scales that are finite."""
    out = struct.pack("<4sIQQ", b"GGUF", version, len(tensors), len(metadata))
    for key, kind, value in metadata:
        type_id, data = gguf_value(kind, value)
        out += gguf_string(key) + struct.pack("<I", type_id) + data
    data, infos = b"", b""
    for i, (name, type_name, dims) in enumerate(tensors):
        type_id, block_size, block_bytes = GGML_TYPES[type_name]
        n = 1
        for d in dims:
            n *= d
        size = n // block_size * block_bytes
        data += b"\0" * (-len(data) % alignment)
        infos += gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id,
                                                  len(data))
        # Bytes 0x10..0x3b repeating: as f16, 0x3b3a.. to 0x1110.. are finite.
        data += bytes(0x10 + (i + k) % 44 for k in range(size))
    out += infos
    out += b"\0" * (-len(out) % alignment)
    return out + data


GGUF_METADATA = [
    ("general.architecture", "string", "llama"),
    ("general.name", "string", "seed \u00e9\u6771"),
    ("llama.block_count", "u32", 2),
    ("llama.rope.freq_base", "f32", 10000.0),
    ("u8", "u8", 255), ("i8", "i8", -1), ("u16", "u16", 65535), ("i16", "i16", -2),
    ("i32", "i32", -3), ("u64", "u64", 2**64 - 1), ("i64", "i64", -4), ("f64", "f64", 0.5),
    ("bool", "bool", True),
    ("tokenizer.ggml.tokens", ("array", "string"), ["<unk>", "<s>", "</s>", "a", ""]),
    ("tokenizer.ggml.token_type", ("array", "i32"), [2, 3, 3, 1, 1]),
    ("tokenizer.ggml.scores", ("array", "f32"), [0.0, 0.0, 0.0, -1.5, -2.5]),
    ("flags", ("array", "bool"), [True, False]),
    ("nested", ("array", ("array", "u16")), [[1, 2], [], [3]]),
]
GGUF_TENSORS = [("f32", "F32", [8, 2]), ("f16", "F16", [4]), ("bf16", "BF16", [2, 2, 2]),
                ("q4_0", "Q4_0", [32, 2]), ("q4_1", "Q4_1", [32]), ("q5_0", "Q5_0", [32]),
                ("q5_1", "Q5_1", [32]), ("q8_0", "Q8_0", [64]), ("q2_k", "Q2_K", [256]),
                ("q3_k", "Q3_K", [256]), ("q4_k", "Q4_K", [256]), ("q5_k", "Q5_K", [256]),
                ("q6_k", "Q6_K", [256, 1, 1, 1])]
GGUF = {
    "metadata-only": gguf_file(GGUF_METADATA, []),
    "every-type": gguf_file(GGUF_METADATA[:4], GGUF_TENSORS),
    "version-2": gguf_file(GGUF_METADATA[:2], GGUF_TENSORS[:4], version=2),
    "alignment-64": gguf_file(GGUF_METADATA[:2] + [("general.alignment", "u32", 64)],
                              GGUF_TENSORS[3:6], alignment=64),
}

# Whole models, for LoadGgufModel and LoadGgufTokenizer: a llama with a
# SentencePiece vocabulary and a qwen2 with a byte-level BPE one (dim 32, one
# layer, 2 heads of 16, 1 KV head), their tensors in several types.
GGUF_TINY_HPARAMS = [("block_count", "u32", 1), ("embedding_length", "u32", 32),
                     ("feed_forward_length", "u32", 64), ("attention.head_count", "u32", 2),
                     ("attention.head_count_kv", "u32", 1), ("context_length", "u32", 64),
                     ("attention.layer_norm_rms_epsilon", "f32", 1e-5),
                     ("rope.freq_base", "f32", 10000.0)]


def gguf_tiny_model(arch, vocab_metadata, vocab_size, biases):
    metadata = [("general.architecture", "string", arch)]
    metadata += [(f"{arch}.{key}", kind, value) for key, kind, value in GGUF_TINY_HPARAMS]
    tensors = [("token_embd.weight", "F32", [32, vocab_size]),
               ("blk.0.attn_norm.weight", "F32", [32]),
               ("blk.0.attn_q.weight", "Q8_0", [32, 32]),
               ("blk.0.attn_k.weight", "Q4_0", [32, 16]),
               ("blk.0.attn_v.weight", "Q4_1", [32, 16]),
               ("blk.0.attn_output.weight", "F16", [32, 32]),
               ("blk.0.ffn_norm.weight", "F32", [32]),
               ("blk.0.ffn_gate.weight", "Q5_0", [32, 64]),
               ("blk.0.ffn_up.weight", "Q5_1", [32, 64]),
               ("blk.0.ffn_down.weight", "BF16", [64, 32]),
               ("output_norm.weight", "F32", [32])]
    if biases:
        tensors += [("blk.0.attn_q.bias", "F32", [32]), ("blk.0.attn_k.bias", "F32", [16]),
                    ("blk.0.attn_v.bias", "F32", [16])]
    return gguf_file(metadata + vocab_metadata, tensors)


SPM_TOKENS = ["<unk>", "<s>", "</s>", "<0x0A>", "\u2581", "a", "b", "\u2581a", "ab", "<user>"]
SPM_VOCAB = [
    ("tokenizer.ggml.model", "string", "llama"),
    ("tokenizer.ggml.tokens", ("array", "string"), SPM_TOKENS),
    ("tokenizer.ggml.scores", ("array", "f32"), [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5,
                                                 -0.7, 0.0]),
    ("tokenizer.ggml.token_type", ("array", "i32"), [2, 3, 3, 6, 1, 1, 1, 1, 1, 4]),
    ("tokenizer.ggml.bos_token_id", "u32", 1), ("tokenizer.ggml.eos_token_id", "u32", 2),
    ("tokenizer.ggml.unknown_token_id", "u32", 0),
]
BPE_TOKENS = ["<|endoftext|>", "a", "b", "1", "\u0120", "ab", "\u0120a", "<|im_end|>"]
BPE_VOCAB = [
    ("tokenizer.ggml.model", "string", "gpt2"),
    ("tokenizer.ggml.pre", "string", "qwen2"),
    ("tokenizer.ggml.tokens", ("array", "string"), BPE_TOKENS),
    ("tokenizer.ggml.token_type", ("array", "i32"), [3, 1, 1, 1, 1, 1, 1, 3]),
    ("tokenizer.ggml.merges", ("array", "string"), ["a b", "\u0120 a"]),
    ("tokenizer.ggml.eos_token_id", "u32", 7),
    ("tokenizer.chat_template", "string", "{% for m in messages %}{{ m.content }}{% endfor %}"),
]
GGUF["llama-model"] = gguf_tiny_model("llama", SPM_VOCAB, len(SPM_TOKENS), biases=False)
GGUF["qwen2-model"] = gguf_tiny_model("qwen2", BPE_VOCAB, len(BPE_TOKENS), biases=True)


def main():
    for target, seeds in (("hf_model_fuzz", MODELS), ("hf_tokenizer_fuzz", TOKENIZERS),
                          ("gguf_fuzz", GGUF)):
        (HERE / target).mkdir(exist_ok=True)
        for name, data in seeds.items():
            (HERE / target / name).write_bytes(data)


if __name__ == "__main__":
    main()
