"""The safetensors reader: single files, sharded folders, dtypes, config metadata, mlx-community quantized weights,
and precise errors for corrupt, truncated or inconsistent files. Test files are written with the ``safetensors``
package (``safetensors.numpy.save_file``) or byte by byte when they must lie."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.weights import QuantizedArray, SafetensorsFile, open_weights
from mlx_engine.weights import quant


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((10, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(8).astype(np.float64),
        "ids": rng.integers(-5, 5, (3, 2)).astype(np.int64),
        "i32": rng.integers(-5, 5, (4,)).astype(np.int32),
        "u8": rng.integers(0, 255, (4,)).astype(np.uint8),
        "i8": rng.integers(-100, 100, (2, 2)).astype(np.int8),
        "u16": rng.integers(0, 60000, (3,)).astype(np.uint16),
        "i16": rng.integers(-3000, 3000, (3,)).astype(np.int16),
        "u32": rng.integers(0, 2**32 - 1, (3,), dtype=np.uint32),
        "u64": np.array([0, 2**64 - 1], np.uint64),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def raw_file(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def expect_error(path: Path, *fragments: str, opened: Path | None = None) -> WeightsError:
    with pytest.raises(WeightsError) as ei:
        with open_weights(opened or path) as wf:
            for n in wf.names():
                wf.load(n)
    msg = str(ei.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return ei.value


# ---------------------------------------------------------------------------------------------------- reading


def test_single_file_roundtrip_all_dtypes(tmp_path: Path):
    ts = tensors()
    path = tmp_path / "model.safetensors"
    save_file(ts, str(path), metadata={"format": "pt", "note": "é"})
    with open_weights(path) as wf:
        assert isinstance(wf, SafetensorsFile) and wf.format == "safetensors"
        assert sorted(wf.names()) == sorted(ts)
        for name, a in ts.items():
            got = wf.load(name)
            assert got.dtype == a.dtype and got.shape == a.shape, name
            np.testing.assert_array_equal(got, a)
            assert wf.shape(name) == a.shape
        assert wf.type_name("model.embed_tokens.weight") == "F32"
        assert wf.type_name("model.layers.0.self_attn.q_proj.weight") == "F16"
        assert wf.type_name("ids") == "I64" and wf.type_name("mask") == "BOOL"
        assert wf.metadata["__metadata__"] == {"format": "pt", "note": "é"}
        f32 = wf.load("model.embed_tokens.weight")
        assert not f32.flags.writeable  # a view of the read-only mapping, not a copy
    np.testing.assert_array_equal(f32, ts["model.embed_tokens.weight"])  # valid after close


def test_names_in_file_order(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    save_file(tensors(), str(path))
    with open_weights(path) as wf:
        offsets = [wf.info(n).offset for n in wf.names()]
    assert offsets == sorted(offsets)


def test_bf16_becomes_float32(tmp_path: Path):
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype("<u2")
    exact = (bits.astype(np.uint32) << 16).view(np.float32)
    header = {"w": {"dtype": "BF16", "shape": [5, 3], "data_offsets": [0, bits.nbytes]}}
    path = tmp_path / "b.safetensors"
    path.write_bytes(raw_file(header, bits.tobytes()))
    with open_weights(path) as wf:
        assert wf.type_name("w") == "BF16"
        got = wf.load("w")
    assert got.dtype == np.float32 and got.shape == (5, 3)
    np.testing.assert_array_equal(got, exact)


def test_bf16_matches_torch_if_available(tmp_path: Path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    t = torch.randn(4, 6).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    save_torch({"w": t}, str(path))
    with open_weights(path) as wf:
        np.testing.assert_array_equal(wf.load("w"), t.float().numpy())


def test_fp8_dtypes(tmp_path: Path):
    b = np.array([0x38, 0xB8, 0x7E, 0x00], np.uint8)
    header = {"e4": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]},
              "e5": {"dtype": "F8_E5M2", "shape": [2, 2], "data_offsets": [4, 8]}}
    path = tmp_path / "f8.safetensors"
    path.write_bytes(raw_file(header, b.tobytes() + np.array([0x3C, 0xBC, 0x40, 0], np.uint8).tobytes()))
    with open_weights(path) as wf:
        assert wf.load("e4").tolist() == [1.0, -1.0, 448.0, 0.0]
        assert wf.load("e5").tolist() == [[1.0, -1.0], [2.0, 0.0]]


def test_config_json_becomes_metadata(tmp_path: Path):
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"w": np.ones((2, 2), np.float32)}, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    config = {"model_type": "llama", "hidden_size": 2, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [1, 2]}
    (folder / "config.json").write_text(json.dumps(config))
    for opened in (folder, folder / "model.safetensors"):
        with open_weights(opened) as wf:
            m = wf.metadata
            assert m.get_str("model_type") == "llama" and m.get_int("hidden_size") == 2
            assert m.get_float("rope_theta") == 10000.0 and m.get_bool("tie_word_embeddings") is True
            assert m["rope_scaling"] == {"type": "linear", "factor": 2.0} and m["eos_token_id"] == [1, 2]
            assert m["__metadata__"] == {"format": "mlx"}
    (folder / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match="config.json"):
        open_weights(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(WeightsError, match="not a JSON object"):
        open_weights(folder)


def write_sharded(folder: Path, n_shards: int = 3, seed: int = 0, prefix: str = "model") -> dict[str, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    all_t: dict[str, np.ndarray] = {}
    weight_map = {}
    for i in range(n_shards):
        fname = f"{prefix}-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        shard = {f"layers.{i}.{k}": rng.standard_normal((4, 3)).astype(np.float32) for k in ("a", "b")}
        save_file(shard, str(folder / fname), metadata={"format": "pt", "shard": str(i)})
        all_t.update(shard)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in all_t.values())}, "weight_map": weight_map}
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": n_shards}))
    return all_t


def test_sharded_folder(tmp_path: Path):
    folder = tmp_path / "sharded"
    all_t = write_sharded(folder)
    for opened in (folder, folder / "model.safetensors.index.json"):
        with open_weights(opened) as wf:
            assert wf.names() == list(all_t)  # shard by shard, file order within a shard
            assert len(wf.files) == 3
            for k, a in all_t.items():
                np.testing.assert_array_equal(wf.load(k), a)
            assert wf.metadata["num_hidden_layers"] == 3
            meta = wf.metadata["__metadata__"]
            assert meta["format"] == "pt" and meta["shard"] == "0"
            assert meta["total_size"] == sum(a.nbytes for a in all_t.values())


def test_diffusers_style_index_name(tmp_path: Path):
    folder = tmp_path / "transformer"
    all_t = write_sharded(folder, 2, prefix="diffusion_pytorch_model")
    with open_weights(folder) as wf:
        assert sorted(wf.names()) == sorted(all_t)


def test_single_safetensors_of_any_name(tmp_path: Path):
    folder = tmp_path / "one"
    folder.mkdir()
    save_file({"w": np.ones(3, np.float32)}, str(folder / "weights.safetensors"))
    with open_weights(folder) as wf:
        assert wf.names() == ["w"]
    save_file({"v": np.ones(3, np.float32)}, str(folder / "other.safetensors"))
    with pytest.raises(WeightsError, match="several .safetensors"):
        open_weights(folder)
    save_file({"m": np.ones(3, np.float32)}, str(folder / "model.safetensors"))
    with open_weights(folder) as wf:  # model.safetensors is the model
        assert wf.names() == ["m"]


def test_mlx_community_quantized_weights(tmp_path: Path):
    """``p.weight`` (U32) + ``p.scales`` + ``p.biases`` under a ``quantization`` config -> one QuantizedArray."""
    rng = np.random.default_rng(5)
    x4 = rng.standard_normal((6, 128)).astype(np.float32)
    x8 = rng.standard_normal((4, 64)).astype(np.float32)
    q4 = quant.quantize_affine(x4, 4, 64)
    q8 = quant.quantize_affine(x8, 8, 32)
    ts = {
        "model.layers.0.mlp.up_proj.weight": q4.weight, "model.layers.0.mlp.up_proj.scales": q4.scales.astype(np.float16),
        "model.layers.0.mlp.up_proj.biases": q4.biases.astype(np.float16),
        "lm_head.weight": q8.weight, "lm_head.scales": q8.scales, "lm_head.biases": q8.biases,
        "model.norm.weight": np.ones(128, np.float32),
    }
    folder = tmp_path / "mlx-q"
    folder.mkdir()
    save_file(ts, str(folder / "model.safetensors"))
    config = {"model_type": "llama", "quantization": {"group_size": 64, "bits": 4,
                                                      "lm_head": {"group_size": 32, "bits": 8}}}
    (folder / "config.json").write_text(json.dumps(config))
    with open_weights(folder) as wf:
        assert sorted(wf.names()) == ["lm_head.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
        a = wf.load("model.layers.0.mlp.up_proj.weight")
        assert isinstance(a, QuantizedArray) and (a.bits, a.group_size, a.shape) == (4, 64, (6, 128))
        assert wf.shape("model.layers.0.mlp.up_proj.weight") == (6, 128)
        assert wf.type_name("model.layers.0.mlp.up_proj.weight") == "MLX_Q4_G64"
        assert a.scales.dtype == np.float32
        np.testing.assert_array_equal(a.weight, q4.weight)
        np.testing.assert_array_equal(a.scales, q4.scales.astype(np.float16).astype(np.float32))
        b = wf.load("lm_head.weight")
        assert (b.bits, b.group_size, b.shape) == (8, 32, (4, 64))
        np.testing.assert_array_equal(b.dequantize(), q8.dequantize())
        assert np.abs(b.dequantize() - x8).max() < 0.05
        with pytest.raises(WeightsError, match="no tensor named"):
            wf.load("lm_head.scales")
    config["quantization"]["lm_head"] = {"group_size": 64, "bits": 8}  # does not fit the stored scales
    (folder / "config.json").write_text(json.dumps(config))
    with open_weights(folder) as wf, pytest.raises(WeightsError, match="do not fit"):
        wf.load("lm_head.weight")


def test_closed_file_and_bad_arguments(tmp_path: Path):
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(path))
    wf = open_weights(path)
    with pytest.raises(InvalidRequestError):
        wf.load("w", requantize=5)
    with pytest.raises(WeightsError, match="no tensor named 'x'"):
        wf.load("x")
    wf.close()
    wf.close()
    with pytest.raises(WeightsError, match="closed"):
        wf.load("w")


# ------------------------------------------------------------------------------------------------------ errors


def _good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]}}


def _lie(mutate) -> dict:
    h = _good_header()
    mutate(h)
    return h


LIES = {
    "size mismatch": (_lie(lambda h: h["a"].update(shape=[2, 3])), ["'a'", "needs 24 bytes"]),
    "offset past the end": (_lie(lambda h: h["b"].update(data_offsets=[24, 32], shape=[1])), ["'b'", "ends at"]),
    "huge offsets": (_lie(lambda h: h["b"].update(data_offsets=[2**62, 2**62 + 8])), ["'b'", "ends at"]),
    "begin after end": (_lie(lambda h: h["b"].update(data_offsets=[24, 16])), ["invalid data_offsets"]),
    "negative offset": (_lie(lambda h: h["b"].update(data_offsets=[-8, 0])), ["invalid data_offsets"]),
    "overlap": (_lie(lambda h: h["b"].update(data_offsets=[8, 16])), ["overlap"]),
    "unknown dtype": (_lie(lambda h: h["a"].update(dtype="F12")), ["unknown dtype 'F12'"]),
    "dtype not a string": (_lie(lambda h: h["a"].update(dtype=5)), ["unknown dtype"]),
    "negative dim": (_lie(lambda h: h["a"].update(shape=[-2, -2])), ["invalid shape"]),
    "float dim": (_lie(lambda h: h["a"].update(shape=[2.0, 2])), ["invalid shape"]),
    "bool dim": (_lie(lambda h: h["a"].update(shape=[True, 4])), ["invalid shape"]),
    "shape not a list": (_lie(lambda h: h["a"].update(shape="2,2")), ["invalid shape"]),
    "missing dtype": (_lie(lambda h: h["a"].pop("dtype")), ["no 'dtype'"]),
    "entry not an object": (_lie(lambda h: h.update(a=[1, 2])), ["not an object"]),
    "metadata not strings": (_lie(lambda h: h.update(__metadata__={"k": 1})), ["__metadata__"]),
    "three offsets": (_lie(lambda h: h["a"].update(data_offsets=[0, 8, 16])), ["invalid data_offsets"]),
}


@pytest.mark.parametrize("case", list(LIES))
def test_lying_headers(tmp_path: Path, case: str):
    header, fragments = LIES[case]
    path = tmp_path / "lie.safetensors"
    path.write_bytes(raw_file(header, bytes(24)))
    expect_error(path, "corrupt" if case not in ("offset past the end", "huge offsets") else "truncated",
                 *fragments)


@pytest.mark.parametrize("case,data,fragment", [
    ("empty", b"", "only 0 bytes"),
    ("short", b"\x01\x02\x03", "only 3 bytes"),
    ("length past end", raw_file(b'{"a":1}', length=1000), "header claims 1000"),
    ("huge length", raw_file(b"{}", length=2**63), "exceeds"),
    ("not json", raw_file(b"{abc"), "invalid JSON"),
    ("json array", raw_file(b"[1,2]"), "not a JSON object"),
    ("not utf-8", raw_file(b'{"\xff":1}'), "UTF-8"),
    ("duplicate keys", raw_file(b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
                                b'"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'), "duplicate key 'a'"),
    ("deep nesting", raw_file(b"[" * 100000 + b"]" * 100000), "JSON"),
])
def test_bad_files(tmp_path: Path, case: str, data: bytes, fragment: str):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    expect_error(path, fragment)


def test_truncated_tensor_data(tmp_path: Path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.ones((16, 16), np.float32), "b": np.ones(4, np.float32)}, str(path))
    data = path.read_bytes()
    for cut in (1, 7, 64, 1000):
        path.write_bytes(data[:-cut])
        expect_error(path, "truncated")


def test_missing_shard_and_bad_index(tmp_path: Path):
    folder = tmp_path / "sharded"
    write_sharded(folder)
    (folder / "model-00002-of-00003.safetensors").unlink()
    index = folder / "model.safetensors.index.json"
    expect_error(index, "missing shard model-00002-of-00003.safetensors", opened=folder)

    folder2 = tmp_path / "sharded2"
    write_sharded(folder2)
    idx = json.loads((folder2 / "model.safetensors.index.json").read_text())
    idx["weight_map"]["layers.0.a"] = "model-00002-of-00003.safetensors"  # the wrong shard
    (folder2 / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_error(folder2, "'layers.0.a'", "does not hold it")

    idx["weight_map"]["layers.0.a"] = "../../etc/passwd"
    (folder2 / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_error(folder2 / "model.safetensors.index.json", "outside the folder", opened=folder2)

    (folder2 / "model.safetensors.index.json").write_text(json.dumps({"weights": {}}))
    expect_error(folder2 / "model.safetensors.index.json", "weight_map", opened=folder2)
    (folder2 / "model.safetensors.index.json").write_text("{")
    expect_error(folder2 / "model.safetensors.index.json", "invalid JSON", opened=folder2)


def test_duplicate_tensor_across_shards(tmp_path: Path):
    folder = tmp_path / "dup"
    folder.mkdir()
    save_file({"x": np.ones(2, np.float32)}, str(folder / "a.safetensors"))
    save_file({"x": np.ones(2, np.float32)}, str(folder / "b.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    expect_error(folder / "b.safetensors", "'x'", "also in", opened=folder)


def test_missing_path(tmp_path: Path):
    expect_error(tmp_path / "absent.safetensors", "no such file")
    expect_error(tmp_path / "absent" / "model.safetensors.index.json", "no such file")


def test_sharded_folder_laid_out_as_the_hub_cache_loads(tmp_path):
    """The hub cache links each shard of a snapshot to a blob in another folder; such folders must load."""
    import json as _json

    from safetensors.numpy import save_file as _save

    from mlx_engine.weights import open_weights as _open

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    _save({"a": arrays["a"]}, str(blobs / "blob1"))
    _save({"b": arrays["b"]}, str(blobs / "blob2"))
    (snap / "model-00001-of-00002.safetensors").symlink_to(blobs / "blob1")
    (snap / "model-00002-of-00002.safetensors").symlink_to(blobs / "blob2")
    (snap / "model.safetensors.index.json").write_text(_json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with _open(snap) as wf:
        for k, v in arrays.items():
            np.testing.assert_array_equal(wf.load(k), v)
