"""The bench's F32 copy of a GGUF file (llama.cpp's perplexity with float activations): every tensor the F32 value
gguf's reference dequantizer gives, every metadata field kept, and no copy (with the reason) where one cannot be
made."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from mlx_engine.bench import float_reference
from mlx_engine.bench.float_reference import describe, float_copy_bytes, float_reference_perplexity, write_float_copy

T = gguf.GGMLQuantizationType


@pytest.fixture
def small_gguf(tmp_path):
    """A GGUF file of four tensors in four types (two quantized by gguf's own quantizer) and a few fields."""
    rng = np.random.default_rng(3)
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.context_length", 128)
    w.add_string("general.name", "small")
    w.add_file_type(2)  # Q4_0
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    w.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((4, 256)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("q4", gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), T.Q4_0),
                 raw_dtype=T.Q4_0)
    w.add_tensor("norm", rng.standard_normal(5).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_copy_holds_every_tensor_dequantized_and_every_field(small_gguf, tmp_path):
    dst = tmp_path / "copy.gguf"
    write_float_copy(small_gguf, dst)
    src, out = gguf.GGUFReader(small_gguf), gguf.GGUFReader(dst)
    assert [t.name for t in out.tensors] == ["q8", "q4", "norm", "half"]
    for a, b in zip(src.tensors, out.tensors):
        assert b.tensor_type == T.F32
        want = gguf.quants.dequantize(a.data, a.tensor_type).astype(np.float32)
        assert b.data.shape == want.shape == (tuple(reversed(a.shape.tolist())) if a.shape.size > 1 else (5,))
        np.testing.assert_array_equal(b.data, want)  # the dequantizer's values, to the bit
    assert out.fields["general.file_type"].contents() == 0  # all F32
    for name in ("llama.context_length", "general.name", "tokenizer.ggml.tokens", "general.architecture"):
        assert out.fields[name].contents() == src.fields[name].contents()
    assert float_copy_bytes(small_gguf) == 4 * (4 * 256 + 3 * 64 + 5 + 2 * 32) == sum(
        int(t.n_bytes) for t in out.tensors)


def test_the_perplexity_is_asked_on_a_copy_that_is_removed_after(small_gguf):
    seen = []

    def perplexity(path):
        seen.append(path)
        assert gguf.GGUFReader(path).tensors[0].tensor_type == T.F32
        return 3.25

    said = []
    value, note = float_reference_perplexity(perplexity, small_gguf, said.append)
    assert value == 3.25 and "F32 copy" in note and len(seen) == 1
    assert "writing an F32 copy of small.gguf" in said[0]
    assert not Path(seen[0]).exists() and not Path(seen[0]).parent.exists()
    line = describe(value, note, 3.26)
    assert "3.2500; ours 3.2600 (1.0031x)" in line


def test_no_copy_where_it_cannot_be_made(small_gguf, tmp_path, monkeypatch):
    def never(_path):
        raise AssertionError("no perplexity without a copy")

    value, note = float_reference_perplexity(never, tmp_path / "missing.gguf")
    assert value is None and "missing.gguf cannot be read" in note
    monkeypatch.setattr(float_reference, "MAX_COPY_BYTES", 1000)
    value, note = float_reference_perplexity(never, small_gguf)
    assert value is None and "would take 0.0 GiB (at most 0)" in note
    assert describe(value, note, 3.0).endswith(note)
    monkeypatch.setattr(float_reference, "MAX_COPY_BYTES", 1 << 30)

    def unknown(data, qtype):
        raise NotImplementedError(f"dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", unknown)
    value, note = float_reference_perplexity(never, small_gguf)
    assert value is None and "gguf cannot dequantize small.gguf" in note and "Q8_0" in note
