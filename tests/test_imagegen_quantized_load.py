"""``--quantize`` as the transformer is read (``imagegen.quantize.transformer_backend``: the backend's load
``transform`` quantizes each linear weight before the next tensor is read) against the path it replaces, quantizing
after the whole float transformer is loaded (``from_backend(..., quantize_bits=...)``, itself held against diffusers
in tests/test_imagegen_transformer.py and tests/test_imagegen_flux2.py).

- Same bits: on random diffusers ``ZImageTransformer2DModel`` and ``FluxTransformer2DModel`` checkpoints (float32),
  both loads hold the same quantized tensors (packed words, scales and biases equal bit for bit) and the same float
  ones, and one transformer call gives identical outputs (``np.array_equal``: the same ``mx.quantize`` of the same
  float tensor, then the same graph; any difference is a bug, so no tolerance).
- Lower peak: on a Z-Image checkpoint of about 35 MB in float32 (every block weight quantizable with groups of 64),
  the load's own peak (``Backend.peak_memory() - memory_before_load``, MLX's allocator) is at most what
  ``imagegen.memory`` estimates for the load (the quantized weights, counted exactly, plus the largest float tensor
  quantized: measured 12.09 MB for 8 bits, 7.96 MB for 4, against 12.09 + 1.57 and 7.96 + 1.57 MB), under half the
  float size, while the float load's peak is the float size (35.8 MB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from diffusers import FluxTransformer2DModel, ZImageTransformer2DModel  # noqa: E402

from mlx_engine.imagegen import memory  # noqa: E402
from mlx_engine.imagegen.flux_transformer import FluxTransformer  # noqa: E402
from mlx_engine.imagegen.quantize import transformer_backend  # noqa: E402
from mlx_engine.imagegen.transformer import ZImageTransformer  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402

ZIMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2, n_refiner_layers=1,
              n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0,
              t_scale=1000.0, axes_dims=[16, 8, 8], axes_lens=[256, 32, 32])
#: dim 384: the feed-forward width int(384 / 3 * 8) = 1024 and every other block input are multiples of 64
ZIMAGE_BIG = {**ZIMAGE, "dim": 384, "n_heads": 4, "n_kv_heads": 4, "axes_dims": [32, 32, 32]}
FLUX = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=[4, 6, 6])


def F32(folder: Path, **kw) -> MLXBackend:
    return MLXBackend(folder, dtype="float32", **kw)


def _save(model: torch.nn.Module, folder: Path) -> Path:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # no zero or identity parameter (pad tokens are made with torch.empty)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
    model.save_pretrained(folder, max_shard_size="1MB", safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qload")
    torch.manual_seed(0)
    return {"zimage": _save(ZImageTransformer2DModel(**ZIMAGE), root / "zimage"),
            "flux": _save(FluxTransformer2DModel(**FLUX), root / "flux"),
            "big": _save(ZImageTransformer2DModel(**ZIMAGE_BIG), root / "big")}


def _arrays(t) -> list[np.ndarray]:
    if t.is_quantized:
        return [np.array(a) for a in (t.w, t.scales, t.biases)]
    return [t.numpy()]


def _assert_same_weights(after, read) -> None:
    assert after.w.keys() == read.w.keys()
    quantized = {n for n, t in after.w.items() if t.is_quantized}
    assert quantized and quantized == {n for n, t in read.w.items() if t.is_quantized}
    for n, t in after.w.items():
        if t.is_quantized:
            assert (t.bits, t.group_size) == (read.w[n].bits, read.w[n].group_size), n
        assert all(np.array_equal(a, b) for a, b in zip(_arrays(t), _arrays(read.w[n]), strict=True)), n


def _zimage_out(model: ZImageTransformer) -> np.ndarray:
    rng = np.random.default_rng(0)
    with model.backend.new_context() as ctx:
        x = ctx.from_numpy(rng.standard_normal((16, 1, 8, 8)).astype(np.float32))
        cap = ctx.from_numpy(rng.standard_normal((5, 32)).astype(np.float32))
        return model(ctx, [x], np.array([0.7], np.float32), [cap])[0].numpy()


def _flux_out(model: FluxTransformer) -> np.ndarray:
    rng = np.random.default_rng(0)
    s, n = 16, 7
    img_ids = np.stack([np.zeros(s), np.arange(s) // 4, np.arange(s) % 4], axis=1).astype(np.float32)
    with model.backend.new_context() as ctx:
        x = ctx.from_numpy(rng.standard_normal((1, s, 64)).astype(np.float32))
        txt = ctx.from_numpy(rng.standard_normal((1, n, 32)).astype(np.float32))
        pooled = ctx.from_numpy(rng.standard_normal((1, 32)).astype(np.float32))
        rope = model.rope(ctx, np.zeros((n, 3), np.float32), img_ids)
        return model(ctx, x, np.array([0.7], np.float32), pooled, txt, rope, np.array([3.5], np.float32)).numpy()


@pytest.mark.parametrize("bits", [8, 4])
def test_zimage_quantized_as_read_is_quantized_after_load(folders, bits):
    folder, keep = folders["zimage"], ZImageTransformer.FLOAT_PREFIXES
    after = ZImageTransformer.from_backend(F32(folder), quantize_bits=bits)
    read = ZImageTransformer.from_backend(transformer_backend(F32, folder, bits, keep))  # quantized by the load
    _assert_same_weights(after, read)
    assert np.array_equal(_zimage_out(after), _zimage_out(read))


@pytest.mark.parametrize("bits", [8, 4])
def test_flux_quantized_as_read_is_quantized_after_load(folders, bits):
    folder, keep = folders["flux"], FluxTransformer.FLOAT_PREFIXES
    after = FluxTransformer.from_backend(F32(folder), quantize_bits=bits, group_size=32)  # 32 features wide
    read = FluxTransformer.from_backend(transformer_backend(F32, folder, bits, keep, group_size=32))
    _assert_same_weights(after, read)
    assert np.array_equal(_flux_out(after), _flux_out(read))


def test_load_peak_is_about_the_quantized_size(folders):
    """The load's own peak against ``imagegen.memory``'s load-phase estimate: the quantized weights (counted
    exactly) plus the one float tensor being quantized; the float load holds the whole float transformer."""
    folder, keep = folders["big"], ZImageTransformer.FLOAT_PREFIXES
    full = F32(folder)
    float_bytes = full.weights_nbytes()
    float_peak = full.peak_memory() - full.memory_before_load
    full.close()
    tensors = memory.folder_tensors(folder)
    lines = [f"float32 {float_bytes / 1e6:.2f} MB, load peak {float_peak / 1e6:.2f} MB"]
    assert float_peak >= float_bytes
    for bits in (8, 4):
        q = transformer_backend(F32, folder, bits, keep)
        peak, kept = q.peak_memory() - q.memory_before_load, q.weights_nbytes()
        q.close()
        transient = memory.quantize_transient_bytes(tensors, 4, quantize=bits, float_prefixes=keep)
        lines.append(f"{bits}-bit {kept / 1e6:.2f} MB, load peak {peak / 1e6:.2f} MB (estimate "
                     f"{kept / 1e6:.2f} + {transient / 1e6:.2f} MB)")
        assert kept == memory.weight_bytes(tensors, 4, quantize=bits, float_prefixes=keep)
        assert peak <= kept + transient, lines
        assert peak < float_bytes / 2, lines
    print("; ".join(lines))
