"""Parity of ``mlx_engine.imagegen.transformer.ZImageTransformer`` with diffusers' ``ZImageTransformer2DModel`` on a small random
configuration saved with ``save_pretrained`` (float32, CPU).

Every parameter is randomised (norm weights around 1, pad tokens, adaLN layers), so that no part is an identity.
Inputs: two latents of different sizes (16 and 36 patches: 32 and 64 tokens after padding) and captions of 5 and 40
tokens (32 and 64 after padding), so the noise refiner, the context refiner and the main blocks all run with padding
masks; a same-length batch (no mask) and a single item too.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from diffusers import ZImageTransformer2DModel  # noqa: E402

from mlx_engine.imagegen.transformer import ZImageTransformer  # noqa: E402
from mlx_engine.ml import DType  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402

CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=96, n_layers=2, n_refiner_layers=1,
              n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0,
              t_scale=1000.0, axes_dims=[16, 16, 16], axes_lens=[256, 32, 32])


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "pad_token" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random ``ZImageTransformer2DModel`` saved in two shards (diffusers' index layout) and the torch module."""
    torch.manual_seed(0)
    model = ZImageTransformer2DModel(**CONFIG).eval()
    _randomise(model, 1)
    folder = tmp_path_factory.mktemp("zimage") / "transformer"
    model.save_pretrained(folder, max_shard_size="1MB", safe_serialization=True)
    assert list(folder.glob("*.safetensors.index.json")), "expected a sharded checkpoint"
    return folder, model


def _inputs(sizes, cap_lens, seed):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((16, 1, h, w)).astype(np.float32) for h, w in sizes]
    caps = [rng.standard_normal((n, 32)).astype(np.float32) for n in cap_lens]
    t = rng.uniform(0.05, 0.95, len(sizes)).astype(np.float32)
    return xs, caps, t


def _reference(model, xs, caps, t):
    with torch.no_grad():
        out = model([torch.from_numpy(x) for x in xs], torch.from_numpy(t), [torch.from_numpy(c) for c in caps],
                    return_dict=False)[0]
    return [o.numpy() for o in out]


def _ours(model: ZImageTransformer, xs, caps, t):
    ctx = model.backend.new_context()
    out = model(ctx, [ctx.from_numpy(x) for x in xs], ctx.from_numpy(t), [ctx.from_numpy(c) for c in caps])
    return [o.numpy() for o in out]


def _rel_err(ours, ref):
    assert [o.shape for o in ours] == [r.shape for r in ref]
    scale = max(np.abs(r).max() for r in ref)
    return max(np.abs(o - r).max() for o, r in zip(ours, ref)) / scale


CASES = {
    "ragged": ([(8, 8), (12, 12)], [5, 40]),  # masks in every stage
    "same-length": ([(8, 8), (8, 8)], [7, 7]),  # no mask (classifier-free-guidance-like batch)
    "single": ([(6, 10)], [33]),  # 15 patches, 33 -> 64 caption tokens
}


@pytest.fixture(scope="module")
def ours(checkpoint):
    folder, _ = checkpoint
    return ZImageTransformer.from_backend(MLXBackend(folder, dtype="float32"))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers(checkpoint, ours, case):
    _, model = checkpoint
    sizes, cap_lens = CASES[case]
    xs, caps, t = _inputs(sizes, cap_lens, seed=len(case))
    ref = _reference(model, xs, caps, t)
    out = _ours(ours, xs, caps, t)
    assert all(o.shape == (16, 1, h, w) for o, (h, w) in zip(out, sizes))
    err = _rel_err(out, ref)
    assert err < 1e-4, f"max abs diff / max abs ref = {err:.2e}"
    print(f"{case}: relative error {err:.2e}")
    # The output depends on t and on the caption (no part is an identity).
    assert np.abs(ref[0]).max() > 0.1


def test_layout_is_reused_across_steps(ours):
    xs, caps, t = _inputs([(8, 8), (12, 12)], [5, 40], seed=3)
    first = _ours(ours, xs, caps, t)
    again = _ours(ours, xs, caps, t * 0.5)
    assert len(ours._layouts) >= 1
    assert not np.allclose(first[0], again[0])


@pytest.mark.parametrize("bits,group,tol", [(8, 32, 2e-2), (4, 32, 2e-1)])
def test_quantized(checkpoint, bits, group, tol):
    """Quantized blocks: (a) equal, within 1e-4, to diffusers running on the dequantized weights (the quantized
    matmul computes exactly what it claims); (b) within ``tol`` of the float model (the quantization error itself:
    8-bit affine groups keep ~2-3 significant digits, 4-bit ~1)."""
    folder, model = checkpoint
    q = ZImageTransformer.from_backend(MLXBackend(folder, dtype="float32"), quantize_bits=bits, group_size=group)
    quantized = {n for n, t in q.w.items() if t.is_quantized}
    assert "layers.0.attention.to_q.weight" in quantized and "layers.1.feed_forward.w2.weight" in quantized
    assert "noise_refiner.0.adaLN_modulation.0.weight" in quantized
    assert not any(n.startswith(ZImageTransformer.FLOAT_PREFIXES) for n in quantized)

    xs, caps, t = _inputs([(8, 8), (12, 12)], [5, 40], seed=11)
    out = _ours(q, xs, caps, t)
    ref = _reference(model, xs, caps, t)
    err_float = _rel_err(out, ref)
    assert err_float < tol, f"{bits}-bit vs float: {err_float:.2e}"

    import copy
    deq = copy.deepcopy(model)
    state = deq.state_dict()
    with torch.no_grad():
        for n in quantized:
            state[n].copy_(torch.from_numpy(q.w[n].dequantize().numpy()))
    err_deq = _rel_err(out, _reference(deq, xs, caps, t))
    assert err_deq < 1e-4, f"{bits}-bit vs diffusers on dequantized weights: {err_deq:.2e}"
    print(f"{bits}-bit g{group}: vs float {err_float:.2e}, vs dequantized {err_deq:.2e}")


def test_quantize_skips_widths_not_divisible(checkpoint):
    """With group size 64, only weights whose input width (96 here, 256 for the feed-forward's w2) is a multiple of
    64 are quantized; the rest stay float."""
    folder, _ = checkpoint
    q = ZImageTransformer.from_backend(MLXBackend(folder, dtype="float32"), quantize_bits=8, group_size=64)
    quantized = {n for n, t in q.w.items() if t.is_quantized}
    assert quantized == {"noise_refiner.0.feed_forward.w2.weight", "context_refiner.0.feed_forward.w2.weight",
                         "layers.0.feed_forward.w2.weight", "layers.1.feed_forward.w2.weight"}
    with pytest.raises(ValueError, match="quantize_bits"):
        ZImageTransformer.from_backend(MLXBackend(folder, dtype="float32"), quantize_bits=3)


def test_errors(ours):
    ctx = ours.backend.new_context()
    x = ctx.zeros((16, 1, 8, 8), DType.FLOAT32)
    cap = ctx.zeros((4, 32), DType.FLOAT32)
    with pytest.raises(ValueError, match="latents but"):
        ours(ctx, [x, x], ctx.from_numpy(np.zeros(2, np.float32)), [cap])
    with pytest.raises(ValueError, match="multiple of the patch"):
        ours(ctx, [ctx.zeros((16, 1, 7, 8), DType.FLOAT32)], 0.5, [cap])
    with pytest.raises(ValueError, match="patch size"):
        ours(ctx, [x], 0.5, [cap], patch_size=4)
    with pytest.raises(ValueError, match="axes_lens"):
        ours(ctx, [ctx.zeros((16, 1, 8, 80), DType.FLOAT32)], 0.5, [cap])
