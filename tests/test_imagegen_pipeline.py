"""The Z-Image pipeline against diffusers on a small random configuration saved in diffusers' folder layout
(``tests/zimage_small.py``): final latents within 1e-3 and final pixels within 2/255 from the same initial noise,
text-to-image and image-to-image, with and without guidance (and diffusers' cfg normalization and truncation options,
and a dynamically shifted schedule); plus seeds, callbacks, memory, sizes, loading errors and the Python API."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("torch")

import mlx_engine  # noqa: E402
from mlx_engine.imagegen.metadata import png_info, read_png_parameters  # noqa: E402
from mlx_engine.imagegen.zimage import ZImagePipeline  # noqa: E402
from mlx_engine import api  # noqa: E402
from mlx_engine.api import image as image_api  # noqa: E402
from mlx_engine.errors import InvalidRequestError, ModelNotFoundError, UnsupportedError, WeightsError  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402
from tests.zimage_small import (build_folder, copy_folder, noise, reference_image_to_image,  # noqa: E402
                                reference_text_to_image, set_scheduler)

LATENT_TOL = 1e-3
PIXEL_TOL = 2  # of 255

PROMPT = "a red circle on a blue background"
NEGATIVE = "bad quality, blurry"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("zimage") / "small-zimage")


def F32(folder: Path, **kw) -> MLXBackend:
    """The backend factory of these tests: float32 on the default device (comparisons are in float32)."""
    return MLXBackend(folder, dtype="float32", **kw)


@pytest.fixture(scope="module")
def pipe(folder) -> ZImagePipeline:
    p = ZImagePipeline(folder, F32)
    yield p
    p.close()


def _pixels(result) -> np.ndarray:
    return np.stack([np.asarray(im) for im in result.images]).astype(np.int16)


def _check(result, ref_latents, ref_pixels):
    assert result.latents.shape == ref_latents.shape
    lat_err = np.abs(result.latents - ref_latents).max()
    assert lat_err <= LATENT_TOL, f"final latents differ by {lat_err}"
    ref_u8 = (ref_pixels * 255).round().astype(np.int16)  # diffusers' numpy_to_pil
    px_err = np.abs(_pixels(result) - ref_u8).max()
    assert px_err <= PIXEL_TOL, f"pixels differ by {px_err}/255"
    # the float pixels too, before rounding
    assert np.abs(result.pixels - ref_pixels).max() <= PIXEL_TOL / 255


# ------------------------------------------------------------------------------------------------ parity with diffusers


@pytest.mark.parametrize("guidance,negative,options", [
    (0.0, None, {}),                                                     # Z-Image-Turbo's setting: no guidance
    (3.0, NEGATIVE, {}),                                                 # guidance with a negative prompt
    (2.5, None, {}),                                                     # guidance against the empty prompt
    (4.0, NEGATIVE, {"cfg_normalization": True, "cfg_truncation": 0.1}),  # diffusers' options
], ids=["no-guidance", "guidance-negative", "guidance-empty-negative", "cfg-normalization-truncation"])
def test_text_to_image_matches_diffusers(folder, pipe, guidance, negative, options):
    width, height, steps = 64, 48, 3
    init = noise((1, 16, height // 8, width // 8), seed=1)
    ref_lat, ref_px = reference_text_to_image(folder, PROMPT, init, steps=steps, guidance=guidance,
                                              negative_prompt=negative, width=width, height=height, **options)
    result = pipe.generate(PROMPT, negative_prompt=negative, width=width, height=height, steps=steps,
                           guidance=guidance, noise=init, **options)
    assert result.images[0].size == (width, height) and result.images[0].mode == "RGB"
    _check(result, ref_lat, ref_px)


def test_cfg_options_change_the_result(pipe):
    """The cfg options are not silently ignored (with these settings they change the latents)."""
    init = noise((1, 16, 8, 8), seed=2)
    a = pipe.generate(PROMPT, negative_prompt=NEGATIVE, width=64, height=64, steps=3, guidance=4.0, noise=init)
    b = pipe.generate(PROMPT, negative_prompt=NEGATIVE, width=64, height=64, steps=3, guidance=4.0, noise=init,
                      cfg_normalization=True)
    c = pipe.generate(PROMPT, negative_prompt=NEGATIVE, width=64, height=64, steps=3, guidance=4.0, noise=init,
                      cfg_truncation=0.1)
    assert np.abs(a.latents - b.latents).max() > 1e-3
    assert np.abs(a.latents - c.latents).max() > 1e-3


@pytest.mark.parametrize("guidance,negative", [(0.0, None), (3.0, NEGATIVE)], ids=["no-guidance", "guidance"])
def test_image_to_image_matches_diffusers(folder, pipe, guidance, negative):
    from PIL import Image

    rng = np.random.default_rng(5)
    init_image = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    steps, strength = 4, 0.6  # t_start = int(4 - 2.4) = 1: 3 steps run
    init = noise((1, 16, 8, 8), seed=3)
    ref_lat, ref_px = reference_image_to_image(folder, PROMPT, init_image, init, strength=strength, steps=steps,
                                               guidance=guidance, negative_prompt=negative)
    result = pipe.generate(PROMPT, negative_prompt=negative, image=init_image, strength=strength, steps=steps,
                           guidance=guidance, noise=init)
    assert result.stats.steps_run == 3 and result.stats.strength == strength
    _check(result, ref_lat, ref_px)


def test_dynamic_shift_schedule_matches_diffusers(folder, tmp_path):
    """A scheduler config with use_dynamic_shifting: mu from calculate_shift(image tokens), as the pipeline does."""
    dyn = copy_folder(folder, tmp_path / "dynamic")
    set_scheduler(dyn, use_dynamic_shifting=True, shift=1.0)
    init = noise((1, 16, 8, 8), seed=4)
    ref_lat, ref_px = reference_text_to_image(dyn, PROMPT, init, steps=4, guidance=0.0, width=64, height=64)
    with ZImagePipeline(dyn, F32) as p:
        result = p.generate(PROMPT, width=64, height=64, steps=4, guidance=0.0, noise=init)
    _check(result, ref_lat, ref_px)


# ----------------------------------------------------------------------------------------------- seeds and callbacks


def test_seeded_noise_is_reproducible(pipe):
    a = pipe.generate(PROMPT, width=64, height=64, steps=2, seed=7)
    b = pipe.generate(PROMPT, width=64, height=64, steps=2, seed=7)
    c = pipe.generate(PROMPT, width=64, height=64, steps=2, seed=8)
    assert a.stats.seed == 7 and a.parameters["seed"] == 7
    assert np.array_equal(a.latents, b.latents) and np.array_equal(_pixels(a), _pixels(b))
    assert not np.array_equal(a.latents, c.latents)
    # no seed: one is drawn and reported, and it reproduces the image
    d = pipe.generate(PROMPT, width=64, height=64, steps=2)
    assert isinstance(d.stats.seed, int)
    e = pipe.generate(PROMPT, width=64, height=64, steps=2, seed=d.stats.seed)
    assert np.array_equal(_pixels(d), _pixels(e))


def test_seeded_image_to_image_is_reproducible(pipe):
    from PIL import Image

    img = Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8))
    a = pipe.generate(PROMPT, image=img, strength=0.5, steps=4, seed=3)
    b = pipe.generate(PROMPT, image=img, strength=0.5, steps=4, seed=3)
    assert np.array_equal(a.latents, b.latents)
    assert a.stats.steps_run == 2


def test_callback_per_step_and_text_encoder_freed_before_the_loop(pipe):
    calls = []

    def cb(step, total, latents, elapsed):
        assert pipe._text_encoder is None and pipe._text_backend is None  # freed before the denoising loop
        calls.append((step, total, tuple(latents.shape), elapsed))

    result = pipe.generate(PROMPT, width=64, height=32, steps=3, guidance=1.5, seed=1, callback=cb)
    assert [c[0] for c in calls] == [0, 1, 2] and all(c[1] == 3 for c in calls)
    assert all(c[2] == (1, 16, 4, 8) for c in calls)
    assert all(b[3] >= a[3] for a, b in zip(calls, calls[1:]))
    s = result.stats
    assert s.peak_memory_bytes > 0 and len(s.step_seconds) == 3
    assert "peak memory" in s.summary() and s.total_seconds >= s.denoise_seconds
    # image-to-image: the callback counts the steps that run
    calls.clear()
    pipe.generate(PROMPT, image=np.zeros((32, 32, 3), np.uint8), strength=0.5, steps=4, seed=1, callback=cb)
    assert [c[:2] for c in calls] == [(0, 2), (1, 2)]


def test_callback_exception_cancels(pipe):
    def cb(step, total, latents, elapsed):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipe.generate(PROMPT, width=64, height=64, steps=3, seed=1, callback=cb)
    assert pipe._text_encoder is None
    pipe.generate(PROMPT, width=32, height=32, steps=1, seed=1)  # still usable


def test_keep_text_encoder(folder):
    with ZImagePipeline(folder, F32, keep_text_encoder=True) as p:
        assert p._text_encoder is not None
        a = p.generate(PROMPT, width=32, height=32, steps=2, seed=1)
        assert p._text_encoder is not None
    with ZImagePipeline(folder, F32) as p:
        b = p.generate(PROMPT, width=32, height=32, steps=2, seed=1)
    assert np.array_equal(a.latents, b.latents)


def test_tiled_decode_route(pipe):
    """Above the size threshold (here lowered) the VAE decodes in tiles; the image keeps its size."""
    saved = pipe.tile_above_pixels, pipe.vae_tile, pipe.vae_tile_overlap
    try:
        pipe.vae_tile, pipe.vae_tile_overlap = 4, 2
        pipe.tile_above_pixels = 64 * 64
        big = pipe.generate(PROMPT, width=96, height=64, steps=1, seed=1)
        small = pipe.generate(PROMPT, width=64, height=64, steps=1, seed=1)
        forced = pipe.generate(PROMPT, width=96, height=64, steps=1, seed=1, vae_tiling=False)
    finally:
        pipe.tile_above_pixels, pipe.vae_tile, pipe.vae_tile_overlap = saved
    assert big.stats.tiled_decode and not small.stats.tiled_decode and not forced.stats.tiled_decode
    assert big.images[0].size == (96, 64)
    assert np.array_equal(big.latents, forced.latents)


def test_quantized_transformer(folder, pipe):
    init = noise((1, 16, 8, 8), seed=6)
    ref = pipe.generate(PROMPT, width=64, height=64, steps=2, noise=init)
    errors = {}
    for bits in (8, 4):
        with ZImagePipeline(folder, F32, quantize=bits) as q:
            assert any(t.is_quantized for t in q.transformer.w.values())
            r = q.generate(PROMPT, width=64, height=64, steps=2, noise=init)
        errors[bits] = np.abs(r.latents - ref.latents).max() / np.abs(ref.latents).max()
    # affine quantization per group of 64: 8 bits is close (measured 0.3% here), 4 bits about 16x coarser (2.8%)
    assert 0 < errors[8] < 0.01 and errors[8] < errors[4] < 0.1, errors
    with pytest.raises(InvalidRequestError, match="4 or 8"):
        ZImagePipeline(folder, MLXBackend, quantize=3)


# ------------------------------------------------------------------------------------------------------- requests


def test_sizes(pipe):
    assert pipe.size_multiple == 16 and pipe.min_side == 32
    assert pipe.max_side == 512  # the small model's RoPE tables (axes_lens 32 patches of 16 pixels)
    for w, h in [(60, 64), (64, 100), (16, 64), (64, 1024), (0, 64), ("64", 64), (64.0, 64)]:
        with pytest.raises(InvalidRequestError, match="multiples of 16") as e:
            pipe.generate(PROMPT, width=w, height=h, steps=1, seed=1)
        assert "32 and 512" in str(e.value)
    assert pipe.defaults["width"] == pipe.defaults["height"] == 64  # the VAE's sample_size
    r = pipe.generate(PROMPT, steps=1, seed=1)
    assert r.images[0].size == (64, 64)


def test_invalid_requests(pipe):
    with pytest.raises(InvalidRequestError, match="steps"):
        pipe.generate(PROMPT, width=32, height=32, steps=0)
    with pytest.raises(InvalidRequestError, match="steps"):
        pipe.generate(PROMPT, width=32, height=32, steps="4")
    with pytest.raises(InvalidRequestError, match="seed"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, seed=-1)
    with pytest.raises(InvalidRequestError, match="guidance"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, guidance=-1)
    with pytest.raises(InvalidRequestError, match="guidance"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, guidance=float("nan"))
    with pytest.raises(InvalidRequestError, match="strength"):
        pipe.generate(PROMPT, image=np.zeros((32, 32, 3), np.uint8), strength=1.5, steps=2)
    with pytest.raises(InvalidRequestError, match="init image"):
        pipe.generate(PROMPT, width=32, height=32, steps=2, strength=0.5)
    with pytest.raises(InvalidRequestError, match="no denoising step"):
        pipe.generate(PROMPT, image=np.zeros((32, 32, 3), np.uint8), strength=0.0, steps=4)
    r = pipe.generate(PROMPT, image=np.zeros((32, 32, 3), np.uint8), strength=0.1, steps=4, seed=1)
    assert r.stats.steps_run == 1  # t_start = int(4 - 0.4) = 3, as diffusers
    with pytest.raises(InvalidRequestError, match="noise has shape"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, noise=np.zeros((1, 16, 8, 8), np.float32))
    with pytest.raises(InvalidRequestError, match="prompt"):
        pipe.generate(None, width=32, height=32, steps=1)
    with pytest.raises(InvalidRequestError, match="no such init image"):
        pipe.generate(PROMPT, image="does-not-exist.png", steps=2)
    with pytest.raises(InvalidRequestError, match="negative prompt"):
        pipe.generate([PROMPT, PROMPT], negative_prompt=["a"], guidance=2.0, width=32, height=32, steps=1)
    # an init image of another size is resized; without width/height its size is rounded down to a multiple of 16
    r = pipe.generate(PROMPT, image=np.zeros((50, 70, 3), np.uint8), strength=1.0, steps=1, seed=1)
    assert r.images[0].size == (64, 48)


def test_empty_prompt_and_batches(pipe):
    r = pipe.generate("", width=32, height=32, steps=1, seed=1)
    assert r.images[0].size == (32, 32)
    two = pipe.generate([PROMPT, "a green square"], width=32, height=32, steps=2, seed=1, guidance=2.0)
    assert len(two.images) == 2 and two.latents.shape == (2, 16, 4, 4)


# --------------------------------------------------------------------------------------------------------- loading


def test_loading_errors(folder, tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such image model folder"):
        ZImagePipeline(tmp_path / "nothing", MLXBackend)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="model_index.json"):
        ZImagePipeline(tmp_path / "empty", MLXBackend)

    for comp in ("vae", "transformer", "text_encoder", "tokenizer", "scheduler"):
        broken = copy_folder(folder, tmp_path / f"no-{comp}")
        shutil.rmtree(broken / comp)
        with pytest.raises(WeightsError, match=f"{comp}") as e:
            with ZImagePipeline(broken, MLXBackend) as p:
                p.generate(PROMPT, width=32, height=32, steps=1, seed=1)
        assert str(broken / comp) in str(e.value) or comp in str(e.value)

    # a corrupt (truncated) shard of the transformer
    bad = copy_folder(folder, tmp_path / "corrupt", link_weights=False)
    shard = sorted((bad / "transformer").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(WeightsError, match=shard.name):
        ZImagePipeline(bad, MLXBackend)
    # garbage in place of the VAE weights
    bad2 = copy_folder(folder, tmp_path / "garbage", link_weights=False)
    for f in (bad2 / "vae").glob("*.safetensors"):
        f.write_bytes(b"\x00" * 64)
    with pytest.raises(WeightsError):
        ZImagePipeline(bad2, MLXBackend)
    # another pipeline class
    other = copy_folder(folder, tmp_path / "other")
    idx = json.loads((other / "model_index.json").read_text())
    idx["_class_name"] = "FluxPipeline"
    (other / "model_index.json").write_text(json.dumps(idx))
    with pytest.raises(UnsupportedError, match="FluxPipeline"):
        ZImagePipeline(other, MLXBackend)


def test_defaults_file(folder, tmp_path):
    f = copy_folder(folder, tmp_path / "with-defaults")
    (f / "mlx_engine.json").write_text(json.dumps({"steps": 2, "width": 32, "height": 48, "guidance": 1.0}))
    with ZImagePipeline(f, MLXBackend) as p:
        r = p.generate(PROMPT, seed=1)
    assert r.stats.steps == 2 and r.images[0].size == (32, 48) and r.stats.guidance == 1.0
    (f / "mlx_engine.json").write_text(json.dumps({"stepz": 2}))
    with pytest.raises(WeightsError, match="stepz"):
        ZImagePipeline(f, MLXBackend)


# ------------------------------------------------------------------------------------------------------ Python API


def test_generate_image_api(folder):
    img = mlx_engine.generate_image(PROMPT, model=str(folder), width=64, height=32, steps=2, seed=11)
    assert img.size == (64, 32) and img.mode == "RGB"
    assert img.info["seed"] == 11 and img.info["parameters"]["steps"] == 2
    pipe = mlx_engine.load_image_model(folder)
    same = pipe.generate(PROMPT, width=64, height=32, steps=2, seed=11)
    assert np.array_equal(np.asarray(img), np.asarray(same.images[0]))
    # a loaded pipeline is reused and stays open
    again = mlx_engine.generate_image(PROMPT, model=pipe, width=64, height=32, steps=2, seed=11)
    assert np.array_equal(np.asarray(img), np.asarray(again))
    assert pipe.transformer is not None and pipe._backends
    # image-to-image and a callback
    steps = []
    out = mlx_engine.generate_image(PROMPT, model=pipe, image=img, strength=0.5, steps=4, seed=1,
                                    callback=lambda i, n, lat, t: steps.append((i, n)))
    assert out.size == (64, 32) and steps == [(0, 2), (1, 2)]
    assert "generate_image" in dir(mlx_engine) and "load_image_model" in dir(mlx_engine)
    pipe.close()
    with pytest.raises(InvalidRequestError, match="closed"):
        pipe.generate(PROMPT, steps=1)


def test_generate_image_api_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(image_api, "DEFAULT_IMAGE_MODEL", None)
    with pytest.raises(ModelNotFoundError, match="no image model given"):
        mlx_engine.generate_image(PROMPT)
    with pytest.raises(ModelNotFoundError, match="no such image model"):
        mlx_engine.generate_image(PROMPT, model=str(tmp_path / "missing"))


def test_png_metadata_round_trip(tmp_path):
    from PIL import Image

    params = {"prompt": "un cercle rouge \u2014 \u7ea2\u8272", "negative_prompt": None, "seed": 2 ** 40 + 3,
              "steps": 4, "guidance": 2.5, "width": 32, "height": 48, "model": "some/folder", "strength": None}
    path = tmp_path / "x.png"
    Image.new("RGB", (32, 48)).save(path, pnginfo=png_info(params))
    back = read_png_parameters(path)
    assert back["prompt"] == params["prompt"] and back["seed"] == params["seed"] and back["guidance"] == 2.5
    assert back["engine"] == "mlx-engine" and back["engine_version"] == mlx_engine.__version__
    assert "negative_prompt" not in back and "strength" not in back
    with Image.open(path) as im:
        assert im.text["seed"] == str(2 ** 40 + 3) and im.text["width"] == "32"
    Image.new("RGB", (8, 8)).save(tmp_path / "plain.png")
    with pytest.raises(InvalidRequestError, match="no generation metadata"):
        read_png_parameters(tmp_path / "plain.png")
