"""The readers on the two real GGUF models, checked against the ``gguf`` package and MLX.

- smollm2:135m (``SmolLM2-135M-Instruct.Q4_1.gguf``): Q4_1, Q8_0 and F32 tensors, llama architecture.
- gemma3:270m (``gemma-3-270m-q4_k_m.gguf``): Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors, gemma3 architecture.

Every tensor is compared element by element with ``gguf.quants.dequantize`` applied to the bytes that
``gguf.GGUFReader`` (an independent parser) finds: exactly equal for every type (Q4_0, Q4_1, Q8_0, Q5_0, Q4_K... through
our lossless MLX repacking; the others are decoded by the same gguf functions). The model files come from the ``smollm2_gguf`` and
``gemma3_gguf`` fixtures (tests/conftest.py, through the model store).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from mlx_engine.weights import GGUFFile, QuantizedArray, open_weights
from mlx_engine.weights import quant
from mlx_engine.weights.gguf import LOSSLESS_TYPES

ROWS_PER_CHUNK = 8192


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma3_reader(gemma3_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(gemma3_gguf)


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request) -> tuple[Path, gguf.GGUFReader]:
    return request.getfixturevalue(f"{request.param}_gguf"), request.getfixturevalue(f"{request.param}_reader")


def _rows(a: "np.ndarray | QuantizedArray", r0: int, r1: int) -> np.ndarray:
    if isinstance(a, QuantizedArray):
        return a.slice(0, r0, r1).dequantize()
    return a.reshape(-1, a.shape[-1])[r0:r1]


def _reference_rows(t, r0: int, r1: int) -> np.ndarray:
    """gguf's own dequantization of rows r0:r1 of a GGUFReader tensor, float32 ``[r1 - r0, cols]``."""
    data = t.data.reshape(-1, t.data.shape[-1])[r0:r1]
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float32)
    return gq.dequantize(data, t.tensor_type)


# ------------------------------------------------------------------------------------------------------ metadata


def test_smollm2_metadata(smollm2_gguf: Path):
    with open_weights(smollm2_gguf) as wf:
        m = wf.metadata
        assert m.get_str("general.architecture") == "llama"
        assert type(m["llama.context_length"]) is int and m["llama.context_length"] == 8192
        assert (m["llama.block_count"], m["llama.embedding_length"], m["llama.feed_forward_length"]) == (30, 576, 1536)
        assert (m["llama.attention.head_count"], m["llama.attention.head_count_kv"]) == (9, 3)
        assert m["llama.rope.dimension_count"] == 64 and m["llama.vocab_size"] == 49152
        assert type(m["llama.rope.freq_base"]) is float and m["llama.rope.freq_base"] == 100000.0
        assert m.get_float("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
        assert wf.metadata_type("llama.context_length") == "UINT32"
        tokens = m["tokenizer.ggml.tokens"]
        assert isinstance(tokens, list) and len(tokens) == 49152 and all(type(t) is str for t in tokens)
        assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        merges = m["tokenizer.ggml.merges"]
        assert len(merges) == 48900 and merges[0] == "Ġ t"
        tt = m["tokenizer.ggml.token_type"]
        assert isinstance(tt, np.ndarray) and tt.dtype == np.int32 and tt.shape == (49152,)
        assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "smollm"
        assert (m["tokenizer.ggml.bos_token_id"], m["tokenizer.ggml.eos_token_id"]) == (1, 2)
        assert m["tokenizer.ggml.add_bos_token"] is False
        assert "<|im_start|>" in m.get_str("tokenizer.chat_template")
        assert m["general.languages"] == ["en"]


def test_gemma3_metadata(gemma3_gguf: Path):
    with open_weights(gemma3_gguf) as wf:
        m = wf.metadata
        assert m.get_str("general.architecture") == "gemma3"
        assert type(m["gemma3.context_length"]) is int and m["gemma3.context_length"] == 32768
        assert m.get_int("gemma3.attention.sliding_window") == 512
        assert (m["gemma3.attention.key_length"], m["gemma3.attention.value_length"]) == (256, 256)
        assert (m["gemma3.block_count"], m["gemma3.embedding_length"]) == (18, 640)
        assert m["gemma3.rope.freq_base"] == 1_000_000.0
        tokens = m["tokenizer.ggml.tokens"]
        assert len(tokens) == 262144 and tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
        scores = m["tokenizer.ggml.scores"]
        assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and scores.shape == (262144,)
        assert m["tokenizer.ggml.token_type"].dtype == np.int32
        assert m["tokenizer.ggml.add_bos_token"] is True
        assert "tokenizer.chat_template" not in m
        assert m["general.tags"] == ["gemma3", "gemma", "google", "text-generation"]


def test_metadata_matches_gguf_reader(model):
    path, reader = model
    with GGUFFile(path) as wf:
        keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert list(wf.metadata) == keys
        assert wf.version == reader.fields["GGUF.version"].contents()
        for k in keys:
            got = wf.metadata[k]
            got = got.tolist() if isinstance(got, np.ndarray) else got
            assert got == reader.fields[k].contents(), k


# ------------------------------------------------------------------------------------------------------- tensors


def test_tensor_table_matches_gguf_reader(model):
    path, reader = model
    with GGUFFile(path) as wf:
        assert wf.names() == [t.name for t in reader.tensors]
        assert wf.data_offset == reader.data_offset
        for t in reader.tensors:
            info = wf.info(t.name)
            assert info.type_name == t.tensor_type.name
            assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
            assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)


def test_every_tensor_matches_gguf_dequantize(model):
    """All tensors of the model, element by element, against gguf.quants.dequantize; exact equality."""
    path, reader = model
    seen = Counter()
    with GGUFFile(path) as wf:
        for t in reader.tensors:
            a = wf.load(t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            kind = t.tensor_type.name
            seen[kind] += 1
            if kind in LOSSLESS_TYPES and len(shape) == 2:
                assert isinstance(a, QuantizedArray), t.name
                group = 16 if kind in quant.SUBBLOCK_TYPES else 32
                assert (a.shape, a.group_size, a.bits) == (shape, group, quant.REPACK_BITS[kind])
            else:
                assert isinstance(a, np.ndarray) and a.shape == shape, t.name
                assert a.dtype == (np.float16 if kind == "F16" else np.float32), t.name
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            for r0 in range(0, rows, ROWS_PER_CHUNK):
                r1 = min(rows, r0 + ROWS_PER_CHUNK)
                np.testing.assert_array_equal(_rows(a, r0, r1), _reference_rows(t, r0, r1), err_msg=t.name)
    expected = {"smollm2": {"Q4_1", "Q8_0", "F32"}, "gemma3": {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}}
    assert set(seen) in expected.values()


def test_smollm2_packing_matches_mx_load(smollm2_gguf: Path):
    """Our lossless repacking gives the same words, scales and biases as MLX's own GGUF loader (mx.load)."""
    mx = pytest.importorskip("mlx.core")
    ref = mx.load(str(smollm2_gguf))
    n = 0
    with GGUFFile(smollm2_gguf) as wf:
        for name in wf.names():
            a = wf.load(name)
            if not isinstance(a, QuantizedArray):
                np.testing.assert_array_equal(a, np.array(ref[name]), err_msg=name)
                continue
            base = name[: -len(".weight")]
            np.testing.assert_array_equal(a.weight, np.array(ref[name]), err_msg=name)
            np.testing.assert_array_equal(a.scales.astype(np.float32), np.array(ref[base + ".scales"].astype(mx.float32)),
                                          err_msg=name)
            np.testing.assert_array_equal(a.biases.astype(np.float32), np.array(ref[base + ".biases"].astype(mx.float32)),
                                          err_msg=name)
            n += 1
    assert n == 211  # 210 Q4_1 + the Q8_0 embedding


def test_gemma3_q6_k_is_lossless_and_regroups_for_mlx(gemma3_gguf: Path):
    """Q6_K (16-element sub-blocks) loads in groups of 16 with its two levels of scales, in its file's bytes and
    exactly gguf's floats; for MLX's kernels (GPUs) it re-quantizes to 4 or 8 bits in groups of 32 exactly as the
    mx.quantize formula quantizes those floats."""
    with GGUFFile(gemma3_gguf) as wf:
        q6 = [n for n in wf.names() if wf.type_name(n) == "Q6_K"]
        assert q6
        for name in q6[:3]:
            f = gguf.quants.dequantize(wf.raw(name), gguf.GGMLQuantizationType.Q6_K)
            q = wf.load(name)
            assert isinstance(q, QuantizedArray) and (q.group_size, q.bits) == (16, 6)
            assert q.nbytes == wf.nbytes(name)
            np.testing.assert_array_equal(q.dequantize(symmetric=True), f)
            for bits in (4, 8):
                r = quant.regroup(q, bits)
                ref = quant.quantize_affine(f, bits)
                assert r.shape == f.shape and (r.bits, r.group_size) == (bits, 32)
                np.testing.assert_array_equal(r.weight, ref.weight)
                np.testing.assert_array_equal(r.scales, ref.scales)
                err = np.abs(r.dequantize() - f).reshape(f.shape[0], -1, 32).max(-1)
                span = np.ptp(f.reshape(f.shape[0], -1, 32), axis=-1)
                assert (err <= span / ((1 << bits) - 1) + 1e-6).all(), name  # within one quantization step


def test_load_is_fast(smollm2_gguf: Path, gemma3_gguf: Path, record_property):
    """Not a benchmark, a guard against pathologically slow parsing (the gguf package's reader takes ~10 s on gemma3's
    header). Limits are ~10x what this 2-core CPU machine measures."""
    for path, limit in ((smollm2_gguf, 10.0), (gemma3_gguf, 20.0)):
        t0 = time.perf_counter()
        with open_weights(path) as wf:
            t_open = time.perf_counter() - t0
            for n in wf.names():
                wf.load(n)
        total = time.perf_counter() - t0
        record_property(f"{path.name} open_s", round(t_open, 3))
        record_property(f"{path.name} load_s", round(total, 3))
        assert total < limit, f"{path.name}: open {t_open:.2f}s, open+load {total:.2f}s"


# ------------------------------------------------------------------------------------------------- MLX backend


def _backend(path: Path, **kw):
    from mlx_engine.mlx.backend import MLXBackend

    probe = MLXBackend()
    probe.clear_cache()
    probe.reset_peak_memory()
    t0 = time.perf_counter()
    b = MLXBackend(path, dtype="float32", **kw)
    return b, b.peak_memory() - b.memory_before_load, time.perf_counter() - t0  # the load's own peak


@pytest.mark.parametrize("keep_quantized", [True, False], ids=["quantized", "dequantized"])
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_mlx_backend_loads_real_models(which: str, keep_quantized: bool, request, record_property):
    pytest.importorskip("mlx.core")
    from mlx_engine.mlx.tensor import MLXQuantizedTensor

    path = request.getfixturevalue(f"{which}_gguf")
    reader = request.getfixturevalue(f"{which}_reader")
    backend, peak, seconds = _backend(path, quantized=keep_quantized)
    try:
        nbytes = backend.weights_nbytes()
        record_property("load_s", round(seconds, 3))
        record_property("peak_over_weights", round(peak / nbytes, 4))
        # MLX's peak during the load stays within 15 % of the weights it ends up holding
        assert peak <= 1.15 * nbytes, f"peak {peak} bytes for {nbytes} bytes of weights ({peak / nbytes:.3f}x)"
        assert backend.metadata["general.architecture"] == ("llama" if which == "smollm2" else "gemma3")
        by_type = {t.name: t.tensor_type.name for t in reader.tensors}
        assert backend.tensor_types == by_type
        quantized = {n for n, t in backend.weights.items() if isinstance(t, MLXQuantizedTensor)}
        lossless = {t.name for t in reader.tensors if t.tensor_type.name in LOSSLESS_TYPES and len(t.shape) == 2}
        # quantized types with no exact affine form (none in these files) are re-quantized where weights stay quantized
        requantized = {t.name for t in reader.tensors if t.tensor_type.name not in LOSSLESS_TYPES | {"F32", "F16"}
                       and len(t.shape) == 2}
        assert quantized == (lossless | requantized if keep_quantized else set())
        for t in reader.tensors:
            w = backend.weights[t.name]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            assert tuple(w.shape) == shape, t.name
            if t.name not in lossless and t.tensor_type.name != "F32" and t.name != "token_embd.weight":
                continue  # the dequantized K-quants were compared above; keep the test short
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            step = ROWS_PER_CHUNK if t.name == "token_embd.weight" else rows
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                got = (w.take(backend.new_context().arange(r0, r1), axis=0) if len(shape) == 2 else w).numpy()
                np.testing.assert_array_equal(got.reshape(r1 - r0, -1), _reference_rows(t, r0, r1),
                                              err_msg=t.name)
    finally:
        backend.close()
