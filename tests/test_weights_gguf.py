"""The GGUF reader on synthetic files: typed metadata, every tensor type, lossless Q4_0/Q4_1/Q8_0 repacking,
re-quantization, and precise errors for corrupt files.

Files are written with ``gguf.GGUFWriter`` (round trips) or byte by byte with :func:`build_gguf` (files that lie).
Values are compared element by element with ``gguf.quants.dequantize`` on the same bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFValueType as V

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.weights import GGUFFile, QuantizedArray, open_weights
from mlx_engine.weights import quant

RNG_SEED = 1234


# ------------------------------------------------------------------------------------------------------- helpers


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T | None]], kv=(), alignment: int | None = None,
               arch: str = "llama") -> Path:
    """Write a GGUF file with ``gguf.GGUFWriter``. ``tensors``: name -> (array, raw ggml type or None); for a raw type
    the array is the uint8 block data ``[..., row_bytes]``. ``kv``: (key, value, value type, sub type) tuples."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, val, vtype, sub in kv:
        w.add_key_value(key, val, vtype, sub_type=sub)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def build_gguf(kv=(), tensors=(), *, magic=b"GGUF", version=3, alignment=32, n_kv=None, n_tensors=None,
               pad_data=True) -> bytes:
    """A GGUF file byte by byte, so that any field can lie.

    kv: (key, value type, packed value bytes). tensors: (name, ggml dims, type, declared offset or None, data bytes).
    Data is always laid out one tensor after the other (aligned); a declared offset of None states that position.
    """
    out = bytearray(magic + struct.pack("<I", version))
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kv) if n_kv is None else n_kv)
    for key, vtype, payload in kv:
        out += gstr(key) + struct.pack("<I", vtype) + payload
    pos = 0
    blobs = []
    for name, dims, ttype, offset, data in tensors:
        out += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ttype, pos if offset is None else offset)
        blobs.append(data + b"\0" * (-len(data) % alignment))
        pos += len(blobs[-1])
    out += b"\0" * (-len(out) % alignment)
    out += b"".join(blobs)
    if not pad_data and blobs:
        out = out[:len(out) - (-len(tensors[-1][4]) % alignment)]
    return bytes(out)


def f32_tensor(name: str, shape: tuple[int, ...], seed: int = 0, offset=None):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return (name, tuple(reversed(shape)), int(T.F32), offset, a.tobytes()), a


def quantized(shape: tuple[int, ...], qtype: T, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(float32 source, uint8 blocks) for a type gguf can quantize."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x, gq.quantize(x, qtype)


def random_blocks(shape: tuple[int, ...], qtype: T, seed: int = 0) -> np.ndarray:
    """Random bytes in the block layout of ``qtype`` for a tensor of logical ``shape`` (any type gguf knows)."""
    block, size = GGML_QUANT_SIZES[qtype]
    nbytes = shape[-1] // block * size
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (*shape[:-1], nbytes), dtype=np.uint8)


def expect_error(path: Path, *fragments: str) -> WeightsError:
    with pytest.raises(WeightsError) as ei:
        with open_weights(path) as wf:
            for n in wf.names():
                wf.load(n)
    msg = str(ei.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return ei.value


# ------------------------------------------------------------------------------------------------------ metadata


SCALARS = [
    ("t.u8", 200, V.UINT8), ("t.i8", -100, V.INT8), ("t.u16", 60000, V.UINT16), ("t.i16", -30000, V.INT16),
    ("t.u32", 4_000_000_000, V.UINT32), ("t.i32", -2_000_000_000, V.INT32), ("t.f32", 0.1, V.FLOAT32),
    ("t.bool_t", True, V.BOOL), ("t.bool_f", False, V.BOOL), ("t.u64", 2**63 + 5, V.UINT64),
    ("t.i64", -(2**62), V.INT64), ("t.f64", 0.1, V.FLOAT64), ("t.str", "héllo ✓ 日本", V.STRING),
    ("t.empty_str", "", V.STRING),
]
ARRAYS = [
    ("t.tokens", ["<s>", "Ġhello", "▁wörld", "", "<0x0A>", "😀"], V.STRING),
    ("t.merges", ["Ġ t", "i n", "Ġ Ġ"], V.STRING),
    ("t.scores", [0.0, -1.5, 3.25, -1000.0], V.FLOAT32),
    ("t.types", [1, 3, 6, 1], V.INT32),
    ("t.u64s", [0, 2**64 - 1], V.UINT64),
    ("t.u8s", [0, 255, 7], V.UINT8),
    ("t.bools", [True, False, True], V.BOOL),
    ("t.f64s", [1e300, -2.5], V.FLOAT64),
]


@pytest.fixture(scope="module")
def meta_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "meta.gguf"
    kv = [(k, v, t, None) for k, v, t in SCALARS]
    kv += [(k, v, V.ARRAY, t) for k, v, t in ARRAYS]
    kv.append(("t.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY))
    _, x = f32_tensor("x", (4,))
    return write_gguf(path, {"x": (x, None)}, kv)


def test_metadata_scalars_are_typed(meta_file: Path):
    with GGUFFile(meta_file) as wf:
        m = wf.metadata
        assert m["general.architecture"] == "llama"
        for key, val, vtype in SCALARS:
            got = m[key]
            if vtype == V.FLOAT32:
                assert type(got) is float and got == float(np.float32(val)), key
            elif vtype == V.FLOAT64:
                assert type(got) is float and got == val, key
            elif vtype == V.BOOL:
                assert type(got) is bool and got is val, key
            elif vtype == V.STRING:
                assert type(got) is str and got == val, key
            else:
                assert type(got) is int and got == val, key
            assert wf.metadata_type(key) == vtype.name
        assert m.get_int("t.u32") == 4_000_000_000
        assert m.get_float("t.f32") == pytest.approx(0.1)
        assert m.get_bool("t.bool_t") is True
        assert m.get_str("t.str") == "héllo ✓ 日本"
        with pytest.raises(WeightsError, match="t.str"):
            m.get_int("t.str")
        with pytest.raises(WeightsError, match="missing"):
            m.get_int("t.nope")
        assert m.get_int("t.nope", 7) == 7


def test_metadata_arrays_are_typed(meta_file: Path):
    with GGUFFile(meta_file) as wf:
        m = wf.metadata
        assert m["t.tokens"] == ARRAYS[0][1] and all(type(s) is str for s in m["t.tokens"])
        assert m["t.merges"] == ["Ġ t", "i n", "Ġ Ġ"]
        scores = m["t.scores"]
        assert isinstance(scores, np.ndarray) and scores.dtype == np.float32
        np.testing.assert_array_equal(scores, np.array([0.0, -1.5, 3.25, -1000.0], np.float32))
        assert m["t.types"].dtype == np.int32 and m["t.types"].tolist() == [1, 3, 6, 1]
        assert m["t.u64s"].dtype == np.uint64 and m["t.u64s"].tolist() == [0, 2**64 - 1]
        assert m["t.u8s"].dtype == np.uint8 and m["t.u8s"].tolist() == [0, 255, 7]
        assert m["t.bools"].dtype == np.bool_ and m["t.bools"].tolist() == [True, False, True]
        assert m["t.f64s"].dtype == np.float64 and m["t.f64s"].tolist() == [1e300, -2.5]
        assert [a.tolist() for a in m["t.nested"]] == [[1, 2], [3]]
        assert wf.metadata_type("t.tokens") == "ARRAY[STRING]"
        assert wf.metadata_type("t.scores") == "ARRAY[FLOAT32]"
        assert m.get_list("t.tokens")[1] == "Ġhello"
        assert len(m.get_list("t.scores")) == 4


def test_metadata_matches_gguf_reader(meta_file: Path):
    """Every field as gguf.GGUFReader decodes it (its ``contents()``), nested arrays aside (it flattens them)."""
    reader = gguf.GGUFReader(meta_file)
    with GGUFFile(meta_file) as wf:
        keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert list(wf.metadata) == keys
        for k in keys:
            if k == "t.nested":
                continue
            got = wf.metadata[k]
            got = got.tolist() if isinstance(got, np.ndarray) else got
            assert got == reader.fields[k].contents(), k


# ------------------------------------------------------------------------------------------------------- tensors


LOSSLESS = [(T.Q4_0, 4), (T.Q4_1, 4), (T.Q8_0, 8), (T.Q5_0, 5), (T.Q5_1, 5), (T.Q4_K, 4), (T.Q5_K, 5), (T.Q6_K, 6),
            (T.Q3_K, 3), (T.Q2_K, 2)]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K)
SUB_BLOCKS = (T.Q6_K, T.Q3_K, T.Q2_K)  # 16-element sub-blocks: groups of 16


def k_quant_blocks(shape: tuple[int, ...], qtype: T, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize them) with finite, small d (and dmin)."""
    raw = random_blocks(shape, qtype, seed).copy()
    b = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    rng = np.random.default_rng(seed + 1)
    fields = quant.BLOCKS[qtype.name].fields
    for name in ("d", "dmin"):
        if name in fields:
            at = fields[name][1]
            b[:, at:at + 2] = rng.uniform(1e-3, 2e-2, (b.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype,bits", LOSSLESS, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("shape", [(1, 256), (5, 512), (64, 768)])
def test_lossless_types_roundtrip_exactly(tmp_path: Path, qtype: T, bits: int, shape):
    if qtype in K_QUANTS:
        blocks = k_quant_blocks(shape, qtype, seed=shape[0])
    else:
        blocks = quantized(shape, qtype, seed=shape[0])[1]
    path = write_gguf(tmp_path / "q.gguf", {"w": (blocks, qtype)})
    group = 16 if qtype in SUB_BLOCKS else 32
    with GGUFFile(path) as wf:
        assert wf.shape("w") == shape
        assert wf.type_name("w") == qtype.name
        q = wf.load("w")
        assert isinstance(q, QuantizedArray)
        assert (q.bits, q.group_size, q.shape) == (bits, group, shape)
        assert q.weight.dtype == np.uint32 and q.weight.shape == (shape[0], shape[1] * bits // 32)
        assert q.scales.shape == (shape[0], shape[1] // group)
        # Q6_K and Q3_K are symmetric (signed scales, a zero point 2**(bits - 1)): no biases
        assert q.biases is None if qtype in (T.Q6_K, T.Q3_K) else q.biases.shape == q.scales.shape
        assert q.biases is None or q.scales.dtype == q.biases.dtype
        # the 32-element types have f16 d (and m) and a bias -8d, -16d or -128d: float16 holds them exactly; the
        # K-quants' d * sc (an f16 times an integer of up to 8 bits) would in general need float32, so they keep
        # their two levels: the integers, and d (and -dmin) per 256 elements; in about their file's bytes (Q3_K's
        # 6-bit and Q2_K's 4-bit sub-scales held as bytes)
        if qtype in K_QUANTS:
            signed = qtype in (T.Q6_K, T.Q3_K)
            assert q.scales.dtype == (np.int8 if signed else np.uint8)
            assert q.super_scales.shape == (shape[0], shape[1] // 256, 1 if signed else 2)
            limit = {T.Q4_K: 1.03, T.Q5_K: 1.03, T.Q6_K: 1.0, T.Q3_K: 1.04, T.Q2_K: 1.2}[qtype]
            assert q.nbytes <= limit * blocks.nbytes
            assert q.expanded().scales.dtype == np.float32
            np.testing.assert_array_equal(q.expanded().dequantize(symmetric=signed), gq.dequantize(blocks, qtype))
        else:
            assert q.scales.dtype == np.float16 and q.super_scales is None
        with np.errstate(all="ignore"):
            ref = gq.dequantize(blocks, qtype)
        # exact: a scale and a bias per 32 elements, each exact in float32, and scale * q exact too
        np.testing.assert_array_equal(q.dequantize(), ref)
        np.testing.assert_array_equal(wf.raw("w"), blocks)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mlx(bits: int):
    """pack / unpack are MLX's layout for every bit width (3, 5 and 6 are a bitstream across words)."""
    import mlx.core as mx

    w = mx.random.normal((6, 128), key=mx.random.key(bits))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    q = quant.unpack(np.array(packed), bits)
    np.testing.assert_array_equal(quant.pack(q, bits), np.array(packed))
    a = QuantizedArray(np.array(packed), np.array(scales), np.array(biases), 32, bits)
    np.testing.assert_allclose(a.dequantize(), np.array(mx.dequantize(packed, scales, biases, group_size=32,
                                                                      bits=bits)), rtol=0, atol=1e-6)


def test_compact_scales_only_when_exact():
    w = np.zeros((1, 1), np.uint32)
    exact = quant.compact_scales(QuantizedArray(w, np.array([[0.5]], np.float32), np.array([[-4.0]], np.float32), 32, 8))
    assert exact.scales.dtype == np.float16 and exact.biases.dtype == np.float16
    inexact = QuantizedArray(w, np.array([[0.1]], np.float32), np.array([[-4.0]], np.float32), 32, 8)
    assert quant.compact_scales(inexact) is inexact
    overflow = QuantizedArray(w, np.array([[1.0]], np.float32), np.array([[-70000.0]], np.float32), 32, 8)
    assert quant.compact_scales(overflow) is overflow


def test_q4_nibble_layout_is_mlx_layout(tmp_path: Path):
    """Element i of a block sits at bits 4 * (i % 8) of word i // 8: a ramp 0..15, 15..0 shows any mix-up."""
    q = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.uint8)
    qs = (q[:16] | (q[16:] << 4)).astype(np.uint8)  # GGUF: elements 0-15 low nibbles, 16-31 high nibbles
    block = np.float16(0.5).tobytes() + np.float16(-1.0).tobytes() + qs.tobytes()
    blocks = np.frombuffer(block, np.uint8).reshape(1, 20)
    path = write_gguf(tmp_path / "q.gguf", {"w": (blocks, T.Q4_1)})
    with GGUFFile(path) as wf:
        a = wf.load("w")
    words = a.weight[0]
    for i in range(32):
        assert (int(words[i // 8]) >> (4 * (i % 8))) & 0xF == q[i]
    assert a.scales.tolist() == [[0.5]] and a.biases.tolist() == [[-1.0]]
    np.testing.assert_array_equal(quant.unpack(a.weight, 4)[0], q)


def test_q8_0_is_offset_by_128(tmp_path: Path):
    qs = np.array([-128, -1, 0, 1, 127] + [5] * 27, np.int8)
    block = np.float16(0.25).tobytes() + qs.tobytes()
    path = write_gguf(tmp_path / "q.gguf", {"w": (np.frombuffer(block, np.uint8).reshape(1, 34), T.Q8_0)})
    with GGUFFile(path) as wf:
        a = wf.load("w")
    np.testing.assert_array_equal(quant.unpack(a.weight, 8)[0], qs.astype(np.int16) + 128)
    assert a.scales.tolist() == [[0.25]] and a.biases.tolist() == [[-32.0]]
    np.testing.assert_array_equal(a.dequantize()[0], qs.astype(np.float32) * np.float32(0.25))


def _plain(dtype) -> np.ndarray:
    rng = np.random.default_rng(3)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((3, 5)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (3, 5), dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64])
def test_plain_types_come_back_as_stored(tmp_path: Path, dtype):
    a = _plain(dtype)
    path = write_gguf(tmp_path / "p.gguf", {"a": (a, None), "v": (a[0].copy(), None)})
    with GGUFFile(path) as wf:
        got = wf.load("a")
        assert got.dtype == dtype and got.shape == (3, 5)
        np.testing.assert_array_equal(got, a)
        np.testing.assert_array_equal(wf.load("v"), a[0])
        assert not got.flags.writeable  # a view of the read-only mapping
    np.testing.assert_array_equal(got, a)  # still valid after close


def test_bf16_becomes_float32(tmp_path: Path):
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    raw = gq.quantize(x, T.BF16)
    path = write_gguf(tmp_path / "b.gguf", {"b": (raw, T.BF16)})
    with GGUFFile(path) as wf:
        got = wf.load("b")
        assert got.dtype == np.float32 and got.shape == (4, 8)
        np.testing.assert_array_equal(got, gq.dequantize(raw, T.BF16))
        assert np.abs(got - x).max() <= np.abs(x).max() * 2**-8


def test_shapes_are_numpy_order_in_1_to_4_dims(tmp_path: Path):
    shapes = {"a": (7,), "b": (3, 5), "c": (2, 3, 4), "d": (2, 1, 3, 2)}
    arrays = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s) for k, s in shapes.items()}
    x3, q3 = quantized((2, 3, 64), T.Q8_0)
    path = write_gguf(tmp_path / "s.gguf", {**{k: (v, None) for k, v in arrays.items()}, "q3": (q3, T.Q8_0)})
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as wf:
        assert wf.names() == ["a", "b", "c", "d", "q3"]
        for k, s in shapes.items():
            assert wf.shape(k) == s
            np.testing.assert_array_equal(wf.load(k), arrays[k])
        for t in reader.tensors:  # ggml order reversed
            assert wf.shape(t.name) == tuple(int(d) for d in reversed(t.shape.tolist()))
            assert wf.info(t.name).offset == t.data_offset
            assert wf.info(t.name).nbytes == t.n_bytes
        # a 3-D Q8_0 tensor (a mixture of experts' stack) stays quantized, as a stack of MLX matrices, exactly
        got = wf.load("q3")
        assert isinstance(got, QuantizedArray) and got.shape == (2, 3, 64) and got.weight.shape == (2, 3, 16)
        assert got.scales.shape == got.biases.shape == (2, 3, 2)
        np.testing.assert_array_equal(got.dequantize(), gq.dequantize(q3, T.Q8_0))
        with pytest.raises(ValueError, match="not cut"):
            got.slice(0, 0, 1)


def _readable_types() -> list[T]:
    return [t for t in T if t in GGML_QUANT_SIZES and GGML_QUANT_SIZES[t][0] > 1 or t == T.BF16]


@pytest.mark.parametrize("qtype", _readable_types(), ids=lambda t: t.name)
def test_every_block_type_matches_gguf_dequantize(tmp_path: Path, qtype: T):
    """Random bytes in each block layout; the loaded float32 equals gguf.quants.dequantize of the same bytes
    (NaN for NaN where a random scale is not finite). Types without a dequantizer raise WeightsError."""
    block = GGML_QUANT_SIZES[qtype][0]
    shape = (3, 2 * max(block, 32)) if qtype != T.BF16 else (3, 8)
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0):  # lossless: use finite scales (covered exactly elsewhere)
        _, raw = quantized(shape, qtype)
    else:
        raw = random_blocks(shape, qtype)
    path = write_gguf(tmp_path / "t.gguf", {"t": (raw, qtype)})
    with GGUFFile(path) as wf:
        assert wf.type_name("t") == qtype.name and wf.shape("t") == shape
        if qtype in (T.Q8_1, T.Q1_0):
            with pytest.raises(WeightsError, match=qtype.name):
                wf.load("t")
            return
        got = wf.load("t")
        got = got.dequantize() if isinstance(got, QuantizedArray) else got
        assert got.dtype == np.float32 and got.shape == shape
        if qtype == T.Q8_K:  # gguf has no Q8_K dequantizer: d * q (ggml-quants.c, dequantize_row_q8_K)
            b = np.frombuffer(raw.tobytes(), quant.Q8_K_BLOCK)
            with np.errstate(all="ignore"):
                ref = (b["qs"].astype(np.float32) * b["d"][:, None]).reshape(shape)
        else:
            with np.errstate(all="ignore"):
                ref = gq.dequantize(raw, qtype)
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("qtype", [T.TQ2_0, T.IQ3_S], ids=lambda t: t.name)
@pytest.mark.parametrize("bits", [4, 8])
def test_requantize(tmp_path: Path, qtype: T, bits: int):
    shape = (6, 512)
    if qtype == T.TQ2_0:
        raw = quantized(shape, qtype)[1]
    else:  # IQ3_S ({f16 d; ...}, a lattice, no affine grid): random bytes with a finite, small d
        raw = random_blocks(shape, qtype).copy()
        raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, :2] = np.array([0.01], np.float16).view(np.uint8)
    path = write_gguf(tmp_path / "r.gguf", {"w": (raw, qtype), "v": (np.ones(4, np.float32), None)})
    with GGUFFile(path) as wf:
        f = wf.load("w")
        q = wf.load("w", requantize=bits)
        assert isinstance(q, QuantizedArray) and (q.bits, q.group_size, q.shape) == (bits, 32, shape)
        ref = quant.quantize_affine(f, bits, 32)
        np.testing.assert_array_equal(q.weight, ref.weight)
        np.testing.assert_array_equal(q.scales, ref.scales)
        np.testing.assert_array_equal(q.biases, ref.biases)
        err = np.abs(q.dequantize() - f).max()
        span = (f.max() - f.min())
        assert err <= span / ((1 << bits) - 1)
        assert isinstance(wf.load("v", requantize=bits), np.ndarray)  # not a quantized type: unchanged
        with pytest.raises(InvalidRequestError):
            wf.load("w", requantize=3)


@pytest.mark.parametrize("qtype", SUB_BLOCKS, ids=lambda t: t.name)
@pytest.mark.parametrize("bits", [4, 8])
def test_sub_block_types_regroup_for_mlx(tmp_path: Path, qtype: T, bits: int):
    """Groups of 16 run in our CPU kernels only; for MLX's (GPUs) a weight re-quantizes to groups of 32 exactly as
    quantize_affine (MLX's formula) quantizes its exact values."""
    shape = (6, 512)
    path = write_gguf(tmp_path / "r.gguf", {"w": (k_quant_blocks(shape, qtype), qtype)})
    with GGUFFile(path) as wf:
        q = wf.load("w", requantize=8)
    assert q.group_size == 16 and q.bits == {T.Q6_K: 6, T.Q3_K: 3, T.Q2_K: 2}[qtype]
    f = q.dequantize(symmetric=q.biases is None)
    r = quant.regroup(q, bits)
    ref = quant.quantize_affine(f, bits, 32)
    assert (r.bits, r.group_size, r.shape) == (bits, 32, shape)
    for a, b in ((r.weight, ref.weight), (r.scales, ref.scales), (r.biases, ref.biases)):
        np.testing.assert_array_equal(a, b)
    stack = q.stacked((2,))
    assert stack.shape == (2, 3, 512) and quant.regroup(stack, bits).shape == (2, 3, 512)
    np.testing.assert_array_equal(quant.regroup(stack, bits).weight.reshape(6, -1), ref.weight)
    assert quant.regroup(r, 8) is r  # groups of 32 already


def test_lossless_types_ignore_requantize(tmp_path: Path):
    _, raw = quantized((2, 64), T.Q4_0)
    path = write_gguf(tmp_path / "q.gguf", {"w": (raw, T.Q4_0)})
    with GGUFFile(path) as wf:
        a, b = wf.load("w"), wf.load("w", requantize=8)
    assert b.bits == 4
    np.testing.assert_array_equal(a.weight, b.weight)


# --------------------------------------------------------------------------------------- quantizer and packing


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits: int):
    q = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64), dtype=np.uint8)
    w = quant.pack(q, bits)
    assert w.dtype == np.uint32 and w.shape == (5, 64 * bits // 32)
    np.testing.assert_array_equal(quant.unpack(w, bits), q)
    for j in (0, 1, 7, 8, 33, 63):  # MLX's bit layout
        per = 32 // bits
        assert (int(w[2, j // per]) >> (bits * (j % per))) & ((1 << bits) - 1) == q[2, j]


def _quantizer_inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(RNG_SEED)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    x[0] = 0.0  # all-zero groups
    x[1] = 3.0  # constant positive groups
    x[2] = -2.5  # constant negative
    x[3, :32] = np.linspace(-1, 1, 32)  # symmetric
    x[4] = np.abs(x[4])  # non-negative
    x[5] = -np.abs(x[5]) * 100  # non-positive, large
    x[6] *= 1e-6  # tiny
    return [x, rng.uniform(-3, 1, (9, 128)).astype(np.float32)]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_quantize_affine_matches_mx_quantize(bits: int, group_size: int):
    mx = pytest.importorskip("mlx.core")
    for x in _quantizer_inputs():
        ours = quant.quantize_affine(x, bits, group_size)
        # MLX's CPU quantizer: its CUDA one rounds some degenerate groups otherwise (seen: a scale of -1e-7 for 1/6)
        w, s, b = mx.quantize(mx.array(x), group_size=group_size, bits=bits, stream=mx.cpu)
        np.testing.assert_array_equal(ours.weight, np.array(w))
        np.testing.assert_array_equal(ours.scales, np.array(s))
        np.testing.assert_array_equal(ours.biases, np.array(b))
        deq = np.array(mx.dequantize(w, s, b, group_size=group_size, bits=bits, stream=mx.cpu))
        np.testing.assert_array_equal(ours.dequantize(), deq)


def test_fp8_and_bf16_conversions():
    e4m3 = quant.fp8_e4m3fn_to_float32(np.array([0x00, 0x38, 0xB8, 0x7E, 0x01, 0x7F, 0x08, 0x80], np.uint8))
    assert e4m3[:5].tolist() == [0.0, 1.0, -1.0, 448.0, 2.0 ** -9] and np.isnan(e4m3[5])
    assert e4m3[6] == 2.0 ** -6 and e4m3[7] == 0.0 and np.signbit(e4m3[7])
    e5m2 = quant.fp8_e5m2_to_float32(np.array([0x3C, 0x7B, 0x7C, 0xFC, 0x01], np.uint8))
    assert e5m2[:4].tolist() == [1.0, 57344.0, np.inf, -np.inf] and e5m2[4] == 2.0 ** -16
    e8m0 = quant.fp8_e8m0_to_float32(np.array([127, 128, 0, 255], np.uint8))
    assert e8m0[:3].tolist() == [1.0, 2.0, 2.0 ** -127] and np.isnan(e8m0[3])
    x = np.array([1.0, -2.5, 3.140625], np.float32)
    np.testing.assert_array_equal(quant.bf16_to_float32((x.view(np.uint32) >> 16).astype(np.uint16)), x)


# ---------------------------------------------------------------------------------------- alignment and layout


def test_custom_alignment_and_layout(tmp_path: Path):
    _, a = f32_tensor("a", (3,))
    _, q = quantized((2, 64), T.Q4_1)
    path = write_gguf(tmp_path / "al.gguf", {"a": (a, None), "q": (q, T.Q4_1)}, alignment=64)
    with GGUFFile(path) as wf:
        assert wf.alignment == 64 and wf.metadata["general.alignment"] == 64
        assert wf.data_offset % 64 == 0
        assert all(wf.info(n).offset % 64 == 0 for n in wf.names())
        np.testing.assert_array_equal(wf.load("a"), a)
        np.testing.assert_array_equal(wf.load("q").dequantize(), gq.dequantize(q, T.Q4_1))


def test_version_2_is_read(tmp_path: Path):
    t, a = f32_tensor("a", (4,))
    path = tmp_path / "v2.gguf"
    path.write_bytes(build_gguf([("k", V.UINT32, struct.pack("<I", 7))], [t], version=2))
    with GGUFFile(path) as wf:
        assert wf.version == 2 and wf.metadata["k"] == 7
        np.testing.assert_array_equal(wf.load("a"), a)


def test_empty_tensor_and_no_tensors(tmp_path: Path):
    path = tmp_path / "e.gguf"
    path.write_bytes(build_gguf([("k", V.STRING, gstr("v"))], [("z", (0, 3), int(T.F32), None, b"")]))
    with GGUFFile(path) as wf:
        assert wf.load("z").shape == (3, 0)
    path.write_bytes(build_gguf([("k", V.STRING, gstr("v"))], [], pad_data=False))
    with GGUFFile(path) as wf:
        assert wf.names() == [] and wf.metadata["k"] == "v"


def test_file_handles_are_released(tmp_path: Path):
    _, a = f32_tensor("a", (4, 4))
    path = write_gguf(tmp_path / "a.gguf", {"a": (a, None)})
    wf = GGUFFile(path)
    view = wf.load("a")
    wf.close()
    wf.close()  # idempotent
    np.testing.assert_array_equal(view, a)
    with pytest.raises(WeightsError, match="closed"):
        wf.load("a")
    with pytest.raises(WeightsError, match="no tensor named 'b'"):
        GGUFFile(path).load("b")


# ------------------------------------------------------------------------------------------------------- errors


def test_missing_and_non_gguf_files(tmp_path: Path):
    expect_error(tmp_path / "nope.gguf", "no such file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    expect_error(tmp_path / "empty.gguf", "24")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + b"\0" * 60)
    expect_error(tmp_path / "bad.gguf", "magic")
    with pytest.raises(WeightsError, match="directory"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("version,fragment", [(1, "version 1"), (4, "version 4"), (0, "version 0"),
                                              (3 << 24, "big-endian")])
def test_unsupported_versions(tmp_path: Path, version: int, fragment: str):
    path = tmp_path / "v.gguf"
    path.write_bytes(build_gguf([], [], version=version) + b"\0" * 32)
    expect_error(path, fragment)


def _lie_cases():
    t, _ = f32_tensor("a", (4, 8))
    name, dims, ttype, off, data = t
    u32 = lambda v: struct.pack("<I", v)  # noqa: E731
    return {
        "truncated data": (build_gguf([], [t])[:-10], ["'a'", "past the end"]),
        "offset beyond the end": (build_gguf([], [(name, dims, ttype, 1 << 40, data)]), ["'a'", "past the end"]),
        "unaligned offset": (build_gguf([], [(name, dims, ttype, 4, data)]), ["'a'", "alignment"]),
        "overlap": (build_gguf([], [t, ("b", dims, ttype, 32, data)]), ["overlap"]),
        "unknown type": (build_gguf([], [(name, dims, 99, None, data)]), ["unknown ggml type 99"]),
        "too many dims": (build_gguf([], [(name, (1, 1, 1, 1, 32), ttype, None, data)]), ["5 dimensions"]),
        "row not a block multiple": (build_gguf([], [(name, (33, 1), int(T.Q4_0), None, b"\0" * 40)]),
                                     ["block size 32"]),
        "huge dimension": (build_gguf([], [(name, (1 << 63, 1), ttype, None, data)]), ["dimension"]),
        "dims overflow": (build_gguf([], [(name, (1 << 40, 1 << 40), ttype, None, data)]), ["past the end"]),
        "duplicate tensor": (build_gguf([], [t, (name, dims, ttype, None, data)]), ["duplicate tensor"]),
        "duplicate key": (build_gguf([("k", V.UINT32, u32(1)), ("k", V.UINT32, u32(2))], [t]), ["duplicate"]),
        "unknown value type": (build_gguf([("k", 13, u32(1))], [t]), ["unknown value type 13"]),
        "unknown array type": (build_gguf([("k", V.ARRAY, u32(42) + struct.pack("<Q", 1) + b"\0" * 8)], [t]),
                               ["unknown element type 42"]),
        "string length lie": (build_gguf([("k", V.STRING, struct.pack("<Q", 1 << 50) + b"abc")], [t]),
                              ["truncated or corrupt header"]),
        "array length lie": (build_gguf([("k", V.ARRAY, u32(V.INT32) + struct.pack("<Q", 1 << 60))], [t]),
                             ["truncated or corrupt header"]),
        "string array length lie": (build_gguf([("k", V.ARRAY, u32(V.STRING) + struct.pack("<Q", 1 << 40))], [t]),
                                    ["strings"]),
        "bad utf-8 key": (build_gguf([(b"k\xff", V.UINT32, u32(1))], [t]), ["UTF-8"]),
        "bad utf-8 value": (build_gguf([("k", V.STRING, gstr(b"\xc3\x28"))], [t]), ["UTF-8", "'k'"]),
        "kv count lie": (build_gguf([], [t], n_kv=1 << 60), ["metadata entries"]),
        "tensor count lie": (build_gguf([], [t], n_tensors=1 << 40), ["tensors"]),
        "tensor count off by one": (build_gguf([], [t], n_tensors=2), ["corrupt"]),
        "alignment not a power of two": (build_gguf([("general.alignment", V.UINT32, u32(48))], [t]),
                                         ["power of two"]),
        "alignment zero": (build_gguf([("general.alignment", V.UINT32, u32(0))], [t]), ["power of two"]),
        "alignment wrong type": (build_gguf([("general.alignment", V.UINT64, struct.pack("<Q", 32))], [t]),
                                 ["UINT32"]),
        "nested arrays too deep": (build_gguf([("k", V.ARRAY, (u32(V.ARRAY) + struct.pack("<Q", 1)) * 20)], [t]),
                                   ["nested"]),
        "header cut in a key": (build_gguf([("some.key", V.UINT32, u32(1))], [t])[:30], ["truncated"]),
    }


@pytest.mark.parametrize("case", list(_lie_cases()))
def test_corrupt_headers_raise_weights_error(tmp_path: Path, case: str):
    data, fragments = _lie_cases()[case]
    path = tmp_path / "lie.gguf"
    path.write_bytes(data)
    expect_error(path, *fragments)


def test_q8_1_and_q1_0_have_no_dequantizer(tmp_path: Path):
    path = write_gguf(tmp_path / "q.gguf", {"t": (random_blocks((1, 128), T.Q1_0), T.Q1_0)})
    with GGUFFile(path) as wf, pytest.raises(WeightsError, match="Q1_0.*cannot be dequantized"):
        wf.load("t")


# ---------------------------------------------------------------------------------------------- open_weights


def test_open_weights_dispatch(tmp_path: Path):
    _, a = f32_tensor("a", (2, 2))
    path = write_gguf(tmp_path / "m.gguf", {"a": (a, None)})
    blob = tmp_path / "sha256-0123abcd"  # ollama's blobs have no extension
    blob.write_bytes(path.read_bytes())
    for p in (path, str(path), blob):
        with open_weights(p) as wf:
            assert isinstance(wf, GGUFFile) and wf.format == "gguf"
            np.testing.assert_array_equal(wf.load("a"), a)
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(path.read_bytes())
    with open_weights(folder) as wf:
        assert wf.path == folder / "x.gguf"
    (folder / "y.gguf").write_bytes(path.read_bytes())
    with pytest.raises(WeightsError, match="several .gguf"):
        open_weights(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no weights"):
        open_weights(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(WeightsError, match="unknown weights format"):
        open_weights(tmp_path / "notes.txt")
    with pytest.raises(WeightsError, match="no such file"):
        open_weights(tmp_path / "missing")


def test_weights_package_never_imports_mlx():
    """mlx_engine/weights is host-side (NumPy, gguf): importing and using it must not load mlx."""
    import subprocess
    import sys

    code = ("import sys, mlx_engine.weights as w, mlx_engine.weights.quant as q, numpy as np; "
            "q.quantize_affine(np.ones((2, 32), np.float32), 4); "
            "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    package = Path(__file__).resolve().parents[1] / "mlx_engine" / "weights"
    for f in package.glob("*.py"):
        for line in f.read_text().splitlines():
            s = line.strip()
            assert not (s.startswith(("import mlx", "from mlx")) and not s.startswith(("import mlx_engine",
                                                                                     "from mlx_engine"))), (f, s)
