"""The FLUX AutoencoderKL against diffusers' ``AutoencoderKL`` (PyTorch CPU, float32): small random configurations in
the FLUX layout saved with ``save_pretrained``, loaded by our code through ``MLXBackend(folder)`` exactly as a real
``vae/`` folder. Decode, encode (mode and sample), tiled decode (against diffusers' ``tiled_decode`` and against the
untiled decode), and the errors for missing or bad folders."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from mlx_engine.imagegen.vae import AutoencoderKL  # noqa: E402
from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError  # noqa: E402
from mlx_engine.ml import DType  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402

FLUX_LIKE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 32, 64, 64), layers_per_block=1,
    norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=64,
)
# the other branches: quant convs, two resnets per block, no mid-block attention, no shift factor
OTHER = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 64), layers_per_block=2,
    norm_num_groups=32, scaling_factor=0.18215, shift_factor=None, use_quant_conv=True, use_post_quant_conv=True,
    mid_block_add_attention=False, down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
)


def make_reference(config: dict, seed: int = 0, local: float | None = None):
    """A random diffusers AutoencoderKL. GroupNorm affine parameters are perturbed (their init is 1 and 0).

    ``local``: scale the eight off-centre taps of every 3x3 kernel by this factor, which makes the decoder's
    effective receptive field short, as in trained VAEs (a random one mixes its whole tile, so no tiling can match
    the untiled decode).
    """
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderKL(**config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if local is not None and p.ndim == 4 and p.shape[-1] == 3:
                m = torch.full((3, 3), local)
                m[1, 1] = 1.0
                p.mul_(m)
    return ref


@pytest.fixture(scope="module")
def flux_vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux") / "vae"
    ref = make_reference(FLUX_LIKE)
    ref.save_pretrained(folder)
    backend = MLXBackend(folder)
    return ref, AutoencoderKL.from_backend(backend), backend, folder


@pytest.fixture(scope="module")
def other_vae(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other") / "vae"
    ref = make_reference(OTHER, seed=1)
    ref.save_pretrained(folder)
    backend = MLXBackend(folder)
    return ref, AutoencoderKL.from_backend(backend), backend, folder


def nchw(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 3, 1, 2)


def nhwc(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 3, 1)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: the error relative to the output's scale."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_config_attributes(flux_vae, other_vae):
    _, vae, _, _ = flux_vae
    assert (vae.scaling_factor, vae.shift_factor, vae.latent_channels, vae.downscale) == (0.3611, 0.1159, 16, 8)
    assert vae.dtype == DType.FLOAT32
    _, other, _, _ = other_vae
    assert (other.scaling_factor, other.shift_factor, other.downscale) == (0.18215, 0.0, 2)


@pytest.mark.parametrize("which", ["flux_vae", "other_vae"])
def test_decode_equals_diffusers(which, request):
    ref, vae, backend, _ = request.getfixturevalue(which)
    rng = np.random.default_rng(2)
    z = rng.standard_normal((2, 16, 12, 10)).astype(np.float32)
    with torch.no_grad():
        want = ref.decode(torch.from_numpy(z)).sample.numpy()
    with backend.new_context() as ctx:
        got = vae.decode(ctx, ctx.from_numpy(nhwc(z))).numpy()
    assert got.shape == (2, 12 * vae.downscale, 10 * vae.downscale, 3)
    assert rel_err(nchw(got), want) < 1e-4


@pytest.mark.parametrize("which", ["flux_vae", "other_vae"])
def test_encode_equals_diffusers(which, request):
    ref, vae, backend, _ = request.getfixturevalue(which)
    rng = np.random.default_rng(3)
    images = rng.uniform(-1, 1, (2, 3, 64, 48)).astype(np.float32)
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(images)).latent_dist
        mean, std = dist.mode().numpy(), dist.std.numpy()
    with backend.new_context() as ctx:
        x = ctx.from_numpy(nhwc(images))
        got = vae.encode(ctx, x).numpy()
        assert got.shape == (2, 64 // vae.downscale, 48 // vae.downscale, 16)
        assert rel_err(nchw(got), mean) < 1e-4
        # a sample: mean + std * eps, eps drawn from the key (the same draw the VAE makes)
        key = ctx.random_key(7)
        sample = vae.encode(ctx, x, sample_key=key).numpy()
        eps = ctx.random_normal(got.shape, DType.FLOAT32, key).numpy()
        assert rel_err(nchw(sample), mean + std * nchw(eps)) < 1e-4
        again = vae.encode(ctx, x, sample_key=ctx.random_key(7)).numpy()
        other = vae.encode(ctx, x, sample_key=ctx.random_key(8)).numpy()
    np.testing.assert_array_equal(sample, again)
    assert np.abs(sample - other).max() > 1e-3


@pytest.mark.parametrize("tile,overlap,batch", [(8, 2, 1), (12, 4, 2), (10, 5, 1)])
def test_tiled_decode_equals_diffusers_tiled_decode(flux_vae, tile, overlap, batch):
    """Same tiles, same blends (including the ragged last row and column, and blends of already-blended tiles)."""
    ref, vae, backend, _ = flux_vae
    rng = np.random.default_rng(tile)
    z = rng.standard_normal((batch, 16, 21, 17)).astype(np.float32)
    ref.tile_latent_min_size = tile
    ref.tile_sample_min_size = tile * vae.downscale
    ref.tile_overlap_factor = overlap / tile
    with torch.no_grad():
        want = ref.tiled_decode(torch.from_numpy(z)).sample.numpy()
    with backend.new_context() as ctx:
        got = vae.decode_tiled(ctx, ctx.from_numpy(nhwc(z)), tile=tile, overlap=overlap).numpy()
    assert got.shape == (batch, 21 * 8, 17 * 8, 3)
    assert rel_err(nchw(got), want) < 1e-4


def test_tiled_decode_within_2_of_255_of_untiled(tmp_path):
    """On a VAE with a short receptive field (see make_reference) and a stationary latent (a periodic pattern whose
    period divides the tile stride, so every tile sees the statistics of the whole), the tiled decode stays within
    2/255 of the untiled one in [0, 1] pixels, seams included. Tiles of 32 latents overlapping by 16, on 64 x 48."""
    config = dict(OTHER, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
                  layers_per_block=1, shift_factor=0.1159)
    make_reference(config, seed=4, local=0.05).save_pretrained(tmp_path / "vae")
    backend = MLXBackend(tmp_path / "vae")
    vae = AutoencoderKL.from_backend(backend)
    rng = np.random.default_rng(4)
    z = np.tile(rng.standard_normal((1, 4, 4, 16)).astype(np.float32), (1, 16, 12, 1))
    with backend.new_context() as ctx:
        zt = ctx.from_numpy(z)
        full = vae.decode(ctx, zt).numpy()
        tiled = vae.decode_tiled(ctx, zt, tile=32, overlap=16).numpy()
    assert tiled.shape == full.shape == (1, 128, 96, 3)
    assert np.abs(full).max() > 0.1  # not a trivially flat output
    pixel_diff = np.abs((tiled + 1) / 2 - (full + 1) / 2).max()
    assert pixel_diff <= 2 / 255, pixel_diff * 255


def test_tiled_decode_of_one_tile_is_the_plain_decode(flux_vae):
    _, vae, backend, _ = flux_vae
    z = np.random.default_rng(5).standard_normal((1, 8, 6, 16)).astype(np.float32)
    with backend.new_context() as ctx:
        zt = ctx.from_numpy(z)
        np.testing.assert_array_equal(vae.decode_tiled(ctx, zt, tile=8, overlap=2).numpy(), vae.decode(ctx, zt).numpy())
        with pytest.raises(InvalidRequestError, match="overlap"):
            vae.decode_tiled(ctx, zt, tile=4, overlap=4)
        with pytest.raises(InvalidRequestError, match="channels last"):
            vae.decode(ctx, ctx.from_numpy(nchw(z)))
        with pytest.raises(InvalidRequestError, match="images"):
            vae.encode(ctx, ctx.from_numpy(np.zeros((1, 16, 16), np.float32)))


def test_bfloat16_weights_decode_close_to_float32(flux_vae):
    """A half-precision backend computes in bfloat16 (GroupNorm statistics in float32): close to float32. The VAE
    keeps what it needs, so its backend may be closed once it is built (freeing the channels-first originals)."""
    ref, vae, backend, folder = flux_vae
    half_backend = MLXBackend(folder, dtype="bfloat16")
    half = AutoencoderKL.from_backend(half_backend)
    half_backend.close()
    assert len(half_backend.weights) == 0
    assert half.dtype == DType.BFLOAT16
    z = np.random.default_rng(6).standard_normal((1, 6, 6, 16)).astype(np.float32)
    with backend.new_context() as ctx:
        want = vae.decode(ctx, ctx.from_numpy(z)).numpy()
        got = half.decode(ctx, ctx.from_numpy(z))
        assert got.dtype == DType.BFLOAT16
        assert rel_err(got.numpy(), want) < 0.05


def test_deprecated_attention_names_load(flux_vae, tmp_path):
    """Old checkpoints name the mid-block attention query / key / value / proj_attn (diffusers converts them)."""
    from safetensors.numpy import load_file, save_file

    _, vae, backend, folder = flux_vae
    old = tmp_path / "vae"
    old.mkdir()
    shutil.copy(folder / "config.json", old / "config.json")
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    rename = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    renamed = {}
    for name, t in tensors.items():
        for new, dep in rename.items():
            name = name.replace(f".attentions.0.{new}.", f".attentions.0.{dep}.")
        renamed[name] = t
    assert any(".proj_attn." in n for n in renamed)
    save_file(renamed, old / "diffusion_pytorch_model.safetensors")
    again = AutoencoderKL.from_backend(MLXBackend(old))
    z = np.random.default_rng(7).standard_normal((1, 4, 4, 16)).astype(np.float32)
    with backend.new_context() as ctx:
        np.testing.assert_array_equal(again.decode(ctx, ctx.from_numpy(z)).numpy(),
                                      vae.decode(ctx, ctx.from_numpy(z)).numpy())


def test_missing_folder_config_or_weights(flux_vae, tmp_path):
    _, _, _, folder = flux_vae
    with pytest.raises(WeightsError, match="nowhere"):
        MLXBackend(tmp_path / "nowhere")
    # weights without config.json
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    shutil.copy(folder / "diffusion_pytorch_model.safetensors", no_config)
    with pytest.raises(WeightsError, match="no_config.*config.json"):
        AutoencoderKL.from_backend(MLXBackend(no_config))
    # config.json without weights
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(folder / "config.json", no_weights)
    with pytest.raises(WeightsError, match="no_weights"):
        MLXBackend(no_weights)
    # a truncated weights file
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(folder / "config.json", corrupt)
    data = (folder / "diffusion_pytorch_model.safetensors").read_bytes()
    (corrupt / "diffusion_pytorch_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="corrupt"):
        MLXBackend(corrupt)


def test_config_weights_mismatch_and_unsupported(flux_vae, tmp_path):
    _, _, _, folder = flux_vae
    cfg = json.loads((folder / "config.json").read_text())

    def folder_with(config: dict, name: str):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        shutil.copy(folder / "diffusion_pytorch_model.safetensors", d)
        return MLXBackend(d)

    # the config asks for a quant_conv the file does not hold
    with pytest.raises(WeightsError, match="quant_conv.weight.*missing"):
        AutoencoderKL.from_backend(folder_with(dict(cfg, use_quant_conv=True), "quant"))
    # wider blocks than the weights
    with pytest.raises(WeightsError, match="shape"):
        AutoencoderKL.from_backend(folder_with(dict(cfg, block_out_channels=[64, 64, 64, 64]), "wide"))
    with pytest.raises(UnsupportedError, match="down_block_types"):
        AutoencoderKL.from_backend(folder_with(dict(cfg, down_block_types=["AttnDownEncoderBlock2D"] * 4), "attn"))
    with pytest.raises(UnsupportedError, match="_class_name"):
        AutoencoderKL.from_backend(folder_with(dict(cfg, _class_name="AutoencoderTiny"), "tiny"))
    with pytest.raises(UnsupportedError, match="act_fn"):
        AutoencoderKL.from_backend(folder_with(dict(cfg, act_fn="gelu"), "gelu"))
