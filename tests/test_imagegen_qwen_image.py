"""Qwen-Image against diffusers on a small random configuration saved in diffusers' folder layout
(``tests/qwen_image_small.py``), in float32: the transformer's output, the VAE's decode and encode, the text encoder's
hidden states (Qwen2.5-VL's language model run by the engine's own qwen2 decoder), and the final latents and pixels of
a 2-step generation from the same initial noise, with and without true CFG; then ``mlx-engine image`` on the folder
end to end (the PNG decodes; its metadata reproduces it pixel for pixel) and the request checks.

Tolerances (float32 on both sides; what differs is the order of sums in matmuls, convolutions and attention, a few
float32 ulps of values of order 1): transformer output, VAE decode (pixels in [-1, 1]) and encode 2e-5 (measured
1.4e-6, 3.1e-6, 2.9e-7); the text encoder's logits 2e-5 of their spread (measured 7.8e-7); its features 3e-4 (measured
7.8e-5 on values up to 4: the peaked random weights grow the residual stream to an RMS of 80 before the final norm,
and transformers' own float32 features differ from its float64 ones by 1.6e-4, ours by 8.4e-5); final latents after
the 2-step loop 1e-4 (measured 2.1e-6, values up to 4.6), 8-bit pixels 1/255 (a value on a rounding boundary may flip;
measured 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from PIL import Image  # noqa: E402

from mlx_engine.cli.main import main  # noqa: E402
from mlx_engine.errors import InvalidRequestError, UnsupportedError  # noqa: E402
from mlx_engine.imagegen.metadata import read_png_parameters  # noqa: E402
from mlx_engine.imagegen.qwen_image import QwenImagePipeline  # noqa: E402
from mlx_engine.imagegen.registry import load_pipeline  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402
from tests.arch_proof import ours  # noqa: E402
from tests.hf_gguf import spread  # noqa: E402
from tests.qwen_image_small import build_folder, load_reference, noise, reference_text_to_image  # noqa: E402

PROMPT = "a red circle on a blue background"
NEGATIVE = "bad quality, blurry"
FEATURE_TOL = 2e-5
TEXT_TOL = 3e-4
LATENT_TOL = 1e-4
PIXEL_TOL = 1  # of 255


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("qwen-image") / "small-qwen-image")


def F32(folder: Path, **kw) -> MLXBackend:
    return MLXBackend(folder, dtype="float32", **kw)


@pytest.fixture(scope="module")
def ref(folder):
    return load_reference(folder)


@pytest.fixture(scope="module")
def pipe(folder):
    p = load_pipeline(folder, F32)
    yield p
    p.close()


def _max_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


# ----------------------------------------------------------------------------------------------------------- parts


def test_transformer_matches_diffusers(ref, pipe):
    """Two items with text of different lengths (the shorter one masked), 4 x 6 patches (a non-square grid: the
    centred height and width positions differ), one timestep each."""
    rng = np.random.default_rng(0)
    h, w, length = 4, 6, 7
    x = rng.standard_normal((2, h * w, 64)).astype(np.float32)
    text = rng.standard_normal((2, length, 32)).astype(np.float32)
    mask = np.ones((2, length), bool)
    mask[1, 5:] = False
    text[1, 5:] = 0.0  # as the pipeline pads
    t = np.array([0.9, 0.35], np.float32)
    with torch.no_grad():
        want = ref.transformer(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(text),
                               encoder_hidden_states_mask=torch.from_numpy(mask.astype(np.int64)),
                               timestep=torch.from_numpy(t), img_shapes=[[(1, h, w)]] * 2,
                               return_dict=False)[0].numpy()
    with pipe.backend.new_context() as ctx:
        got = pipe.transformer(ctx, ctx.from_numpy(x), t, ctx.from_numpy(text), (1, h, w), mask).numpy()
    assert got.shape == want.shape == (2, h * w, 64)
    assert _max_err(got, want) <= FEATURE_TOL, _max_err(got, want)


def test_vae_matches_diffusers(ref, pipe):
    rng = np.random.default_rng(1)
    z = rng.standard_normal((1, 16, 4, 6)).astype(np.float32)
    image = rng.uniform(-1, 1, (1, 3, 32, 48)).astype(np.float32)
    with torch.no_grad():
        want = ref.vae.decode(torch.from_numpy(z)[:, :, None], return_dict=False)[0][:, :, 0].numpy()
        mode = ref.vae.encode(torch.from_numpy(image)[:, :, None]).latent_dist.mode()[:, :, 0].numpy()
    with pipe.backend.new_context() as ctx:
        got = pipe.vae.decode(ctx, ctx.from_numpy(z.transpose(0, 2, 3, 1))).numpy().transpose(0, 3, 1, 2)
        enc = pipe.vae.encode(ctx, ctx.from_numpy(image.transpose(0, 2, 3, 1))).numpy().transpose(0, 3, 1, 2)
    assert got.shape == want.shape == (1, 3, 32, 48)
    assert _max_err(got, want) <= FEATURE_TOL, _max_err(got, want)
    assert enc.shape == mode.shape == (1, 16, 4, 6)
    assert _max_err(enc, mode) <= FEATURE_TOL, _max_err(enc, mode)
    # tiled: 4-latent tiles every 2 (diffusers' 256-pixel tiles every 192, scaled down), blended seams, no clamp
    ref.vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                          tile_sample_stride_width=16)
    try:
        with torch.no_grad():
            want = ref.vae.decode(torch.from_numpy(z)[:, :, None], return_dict=False)[0][:, :, 0].numpy()
    finally:
        ref.vae.disable_tiling()
    with pipe.backend.new_context() as ctx:
        got = pipe.vae.decode_tiled(ctx, ctx.from_numpy(z.transpose(0, 2, 3, 1)), tile=4, overlap=2).numpy()
    assert _max_err(got.transpose(0, 3, 1, 2), want) <= FEATURE_TOL


def test_text_encoder_matches_diffusers(ref, pipe):
    """The prompt template, the dropped prefix, the final-normed hidden states of the unpadded tokens: prompts of
    different lengths in one call (diffusers pads and masks; the engine runs each as its own sequence)."""
    prompts = [PROMPT, "", NEGATIVE]
    with torch.no_grad():
        embeds, mask = ref._get_qwen_prompt_embeds(prompts)
    got = pipe.encode_prompt(prompts, 512)
    for i, e in enumerate(got):
        n = int(mask[i].sum())
        assert e.shape == (n, 32)
        assert _max_err(e.numpy(), embeds[i, :n].numpy()) <= TEXT_TOL, _max_err(e.numpy(), embeds[i, :n].numpy())
    assert len({e.shape[0] for e in got}) == 3


def test_text_encoder_as_a_chat_model(folder, ref):
    """The same folder loads as a text model (``qwen2_5_vl``): its logits at every position of a prompt against
    transformers' ``Qwen2_5_VLForConditionalGeneration`` (text only), as a fraction of their spread."""
    tokens = ref.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        want = ref.text_encoder(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    got = ours(folder / "text_encoder", tokens)
    assert got.shape == want.shape
    assert _max_err(got, want) / spread(want) <= FEATURE_TOL, _max_err(got, want) / spread(want)


# -------------------------------------------------------------------------------------------------- the pipeline


@pytest.mark.parametrize("guidance,negative", [(1.0, None), (4.0, NEGATIVE)], ids=["no-cfg", "true-cfg"])
def test_text_to_image_matches_diffusers(ref, pipe, guidance, negative):
    width, height, steps = 64, 48, 2
    init = noise((1, 16, height // 8, width // 8), seed=3)
    ref_lat, ref_px = reference_text_to_image(ref, PROMPT, init, steps=steps, guidance=guidance,
                                              negative_prompt=negative, width=width, height=height)
    result = pipe.generate(PROMPT, negative_prompt=negative, width=width, height=height, steps=steps,
                           guidance=guidance, noise=init)
    assert result.images[0].size == (width, height) and result.latents.shape == ref_lat.shape
    assert _max_err(result.latents, ref_lat) <= LATENT_TOL, _max_err(result.latents, ref_lat)
    ref_u8 = (ref_px * 255).round().astype(np.int16)
    got_u8 = np.stack([np.asarray(im) for im in result.images]).astype(np.int16)
    assert np.abs(got_u8 - ref_u8).max() <= PIXEL_TOL
    assert result.parameters["negative_prompt"] == negative and result.stats.steps_run == steps


def test_quantized_transformer(folder, pipe):
    """quantize=8 / 4: the blocks' linear weights whose input width is a multiple of 64 (here the MLPs' second
    layers, 128 wide) run quantized; the result moves a little (measured 1.2e-4 and 2.0e-3 of the largest latent),
    4 bits about 16x more than 8."""
    init = noise((1, 16, 4, 4), seed=6)
    ref = pipe.generate(PROMPT, width=32, height=32, steps=2, guidance=1.0, noise=init)
    errors = {}
    for bits in (8, 4):
        with QwenImagePipeline(folder, F32, quantize=bits) as q:
            assert sum(t.is_quantized for t in q.transformer.w.values()) == 4
            r = q.generate(PROMPT, width=32, height=32, steps=2, guidance=1.0, noise=init)
        errors[bits] = np.abs(r.latents - ref.latents).max() / np.abs(ref.latents).max()
    assert 0 < errors[8] < 1e-3 and errors[8] < errors[4] < 2e-2, errors


def test_requests_and_loading(folder, pipe, tmp_path):
    assert isinstance(pipe, QwenImagePipeline) and pipe.size_multiple == 16
    with pytest.raises(InvalidRequestError, match="multiples of 16"):
        pipe.generate(PROMPT, width=40, height=32, steps=1)
    with pytest.raises(InvalidRequestError, match="image-to-image"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, image=np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(InvalidRequestError, match="max_sequence_length"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, max_sequence_length=2000)
    with pytest.raises(InvalidRequestError, match="guidance"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, guidance=-1.0)
    with pytest.raises(InvalidRequestError, match="noise has shape"):
        pipe.generate(PROMPT, width=32, height=32, steps=1, noise=np.zeros((1, 16, 8, 8), np.float32))
    calls = []
    r = pipe.generate([PROMPT, "a green square"], width=32, height=32, steps=2, seed=1,
                      callback=lambda i, n, lat, t: calls.append((i, n, tuple(lat.shape))))
    assert len(r.images) == 2 and calls == [(0, 2, (2, 16, 4, 4)), (1, 2, (2, 16, 4, 4))]
    assert r.parameters["negative_prompt"] == " " and r.stats.guidance == 4.0  # the model card's defaults
    init = noise((1, 16, 4, 4), seed=5)  # true CFG is not silently skipped
    on = pipe.generate(PROMPT, negative_prompt=NEGATIVE, width=32, height=32, steps=2, guidance=4.0, noise=init)
    off = pipe.generate(PROMPT, negative_prompt=NEGATIVE, width=32, height=32, steps=2, guidance=1.0, noise=init)
    assert np.abs(on.latents - off.latents).max() > 1e-3
    # another transformer class in model_index.json is refused by name
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    index = json.loads((other / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedError, match="FluxTransformer2DModel"):
        load_pipeline(other, F32)


# ---------------------------------------------------------------------------------------------------- end to end


def test_cli_image_end_to_end(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(main, ["image", PROMPT, "--model", str(folder), "--width", "48", "--height", "32", "--steps",
                             "2", "--guidance", "3.0", "--negative-prompt", NEGATIVE, "-o", "first.png"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    with Image.open(tmp_path / "first.png") as im:
        assert im.size == (48, 32) and im.format == "PNG"
        first = np.asarray(im.convert("RGB")).copy()
    meta = read_png_parameters(tmp_path / "first.png")
    assert meta["negative_prompt"] == NEGATIVE and meta["guidance"] == 3.0 and isinstance(meta["seed"], int)
    r = runner.invoke(main, ["image", "--from-metadata", "first.png", "--model", str(folder), "-o", "again.png"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    with Image.open(tmp_path / "again.png") as im:
        assert np.array_equal(np.asarray(im.convert("RGB")), first)
