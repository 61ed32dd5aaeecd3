"""FLUX.1 (dev, schnell) and FLUX.1 Kontext against diffusers and transformers on small random configurations saved in
diffusers' folder layout (``tests/flux_small.py``), float32: the transformer, each text encoder (token ids equal,
features within 1e-5), the VAE decode, the final latents and pixels of 2 steps from the same initial noise, and
image-to-image (``FluxImg2ImgPipeline``: the init image encoded and noised to the step its strength gives); then
editing and image-to-image at every door: the Python API, ``mlx-engine image --edit`` and ``--image --strength`` end
to end (the PNG's metadata makes the same image again), and the server's ``POST /v1/images/edits`` with the real
``openai`` client.

Tolerances (float32 throughout): the transformer's output and the final latents within 1e-4 absolute (measured: a few
1e-6 on values of order 1-3; the difference is the order of float32 sums, which a wrong weight, sign, RoPE axis or
modulation chunk moves by 1e-1 or more); the text encoders' outputs within 1e-5 (measured below 2e-6); pixels as
floats within 1e-4 and as 8-bit values within 1 (a float within 1e-4 of a rounding boundary may round the other
way).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("torch")

import mlx_engine  # noqa: E402
from mlx_engine.errors import InvalidRequestError  # noqa: E402
from mlx_engine.imagegen.flux import FluxKontextPipeline, FluxPipeline, pack_latents, unpack_latents  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402
from tests.flux_small import MAX_T5, build_folder, noise, reference, reference_image_to_image  # noqa: E402

TOL = 1e-4
ENCODER_TOL = 1e-5
PROMPT = "a red circle on a blue background"
EDIT = "make the circle green"
PROMPTS = [PROMPT, "Make the CIRCLE   green, please! 123 \u00fcn\u00efcode", ""]


def F32(folder: Path) -> MLXBackend:
    return MLXBackend(folder, dtype="float32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flux")
    return {"dev": build_folder(root / "dev"), "schnell": build_folder(root / "schnell", guidance_embeds=False),
            "kontext": build_folder(root / "kontext", kontext=True)}


@pytest.fixture(scope="module")
def edit_png(tmp_path_factory) -> Path:
    from PIL import Image

    rng = np.random.default_rng(5)
    p = tmp_path_factory.mktemp("edit") / "photo.png"
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(p)
    return p


def _close(ours: np.ndarray, ref: np.ndarray, tol: float, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    err = float(np.abs(ours - ref).max())
    assert err <= tol, f"{what} differs by {err} (tolerance {tol})"


def _check_result(result, ref_latents, ref_pixels) -> None:
    _close(result.latents, ref_latents, TOL, "final latents")
    _close(result.pixels, ref_pixels, TOL, "final pixels")
    ours = np.stack([np.asarray(im) for im in result.images]).astype(np.int16)
    assert np.abs(ours - (ref_pixels * 255).round().astype(np.int16)).max() <= 1


# ------------------------------------------------------------------------------------------------------- components


@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_transformer_matches_diffusers(folders, variant):
    """Two items, text and image tokens, Kontext-style ids (first axis 1) on half the image tokens."""
    import torch
    from diffusers import FluxTransformer2DModel

    from mlx_engine.imagegen.flux_transformer import FluxTransformer

    folder = folders[variant] / "transformer"
    ref = FluxTransformer2DModel.from_pretrained(str(folder)).eval()
    ours = FluxTransformer.from_backend(F32(folder))
    rng = np.random.default_rng(0)
    b, s, n = 2, 12, 7
    x = rng.standard_normal((b, s, 64)).astype(np.float32)
    txt = rng.standard_normal((b, n, 32)).astype(np.float32)
    pooled = rng.standard_normal((b, 32)).astype(np.float32)
    t, g = np.array([0.7, 0.3], np.float32), np.array([3.5, 2.0], np.float32)
    img_ids = np.stack([np.arange(s) >= 6, np.arange(s) // 4, np.arange(s) % 4], axis=1).astype(np.float32)
    txt_ids = np.zeros((n, 3), np.float32)
    with torch.no_grad():
        want = ref(hidden_states=torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(txt),
                   pooled_projections=torch.from_numpy(pooled), timestep=torch.from_numpy(t),
                   img_ids=torch.from_numpy(img_ids), txt_ids=torch.from_numpy(txt_ids),
                   guidance=torch.from_numpy(g) if ref.config.guidance_embeds else None, return_dict=False)[0]
    with ours.backend.new_context() as ctx:
        got = ours(ctx, ctx.from_numpy(x), t, ctx.from_numpy(pooled), ctx.from_numpy(txt),
                   ours.rope(ctx, txt_ids, img_ids), g).numpy()
    _close(got, want.numpy(), TOL, "transformer output")


def test_text_encoders_match_transformers(folders):
    """CLIP (the tokenizer rebuilt from vocab.json and merges.txt; the pooled output) and T5 (every row of the padded
    sequence) against the pipeline's own ``_get_clip_prompt_embeds`` and ``_get_t5_prompt_embeds``."""
    import torch
    from diffusers import FluxPipeline as Reference

    from mlx_engine.imagegen.clip_encoder import CLIPTextEncoder
    from mlx_engine.imagegen.t5_encoder import T5Encoder

    root = folders["dev"]
    pipe = Reference.from_pretrained(str(root), dtype=torch.float32)
    clip = CLIPTextEncoder(F32(root / "text_encoder"), root / "tokenizer")
    t5 = T5Encoder(F32(root / "text_encoder_2"), root / "tokenizer_2")
    with torch.no_grad():
        pooled = pipe._get_clip_prompt_embeds(PROMPTS, device="cpu").numpy()
        feats = pipe._get_t5_prompt_embeds(PROMPTS, max_sequence_length=MAX_T5, device="cpu").numpy()
    assert clip.token_ids(PROMPTS).tolist() == pipe.tokenizer(PROMPTS, padding="max_length", max_length=77,
                                                              truncation=True).input_ids
    assert [t5.token_ids(p, MAX_T5) for p in PROMPTS] == pipe.tokenizer_2(
        PROMPTS, padding="max_length", max_length=MAX_T5, truncation=True).input_ids
    with clip.backend.new_context() as ctx:
        _close(clip.encode(ctx, PROMPTS).numpy(), pooled, ENCODER_TOL, "CLIP pooled output")
    with t5.backend.new_context() as ctx:
        _close(t5.encode(ctx, PROMPTS, MAX_T5).numpy(), feats, ENCODER_TOL, "T5 features")


def test_vae_decode_and_packing_match_diffusers(folders):
    import torch
    from diffusers import AutoencoderKL as Reference
    from diffusers import FluxPipeline as Ref

    from mlx_engine.imagegen.vae import AutoencoderKL

    folder = folders["dev"] / "vae"
    z = noise((1, 16, 6, 8), seed=7)
    with torch.no_grad():
        want = Reference.from_pretrained(str(folder)).decode(torch.from_numpy(z), return_dict=False)[0].numpy()
        packed = Ref._pack_latents(torch.from_numpy(z), 1, 16, 6, 8).numpy()
    vae = AutoencoderKL.from_backend(F32(folder))
    with MLXBackend(folder, dtype="float32").new_context() as ctx:
        got = vae.decode(ctx, ctx.from_numpy(z.transpose(0, 2, 3, 1))).numpy().transpose(0, 3, 1, 2)
        p = pack_latents(ctx.from_numpy(z))
        assert np.array_equal(p.numpy(), packed)
        assert np.array_equal(unpack_latents(p, 6, 8).numpy(), z)
    _close(got, want, TOL, "VAE decode")


# ------------------------------------------------------------------------------------------------ whole pipelines


@pytest.mark.parametrize("variant,guidance", [("dev", 3.5), ("schnell", 0.0)])
def test_text_to_image_matches_diffusers(folders, variant, guidance):
    """2 steps at 64x48 (dev: dynamic shifting, guidance embedded; schnell: static schedule, no guidance input)."""
    init = noise((1, 16, 6, 8), seed=1)
    ref_lat, ref_px = reference(folders[variant], PROMPT, init, steps=2, guidance=guidance, width=64, height=48)
    with FluxPipeline(folders[variant], F32) as pipe:
        result = pipe.generate(PROMPT, width=64, height=48, steps=2, guidance=guidance, noise=init)
    assert result.images[0].size == (64, 48) and result.stats.steps_run == 2
    _check_result(result, ref_lat, ref_px)


def test_true_cfg_matches_diffusers(folders):
    init = noise((1, 16, 4, 4), seed=2)
    ref_lat, ref_px = reference(folders["dev"], PROMPT, init, steps=2, guidance=3.5, width=32, height=32,
                                negative_prompt="bad quality, blurry", true_cfg_scale=2.5)
    with FluxPipeline(folders["dev"], F32) as pipe:
        result = pipe.generate(PROMPT, negative_prompt="bad quality, blurry", true_cfg=2.5, width=32, height=32,
                               steps=2, guidance=3.5, noise=init)
    _check_result(result, ref_lat, ref_px)


def test_kontext_edit_matches_diffusers(folders, edit_png):
    """One input image (56x40, cut to 48x32 as Kontext cuts it: 6 packed tokens at ids (1, row, col) after the
    output's 6 at (0, row, col)); the same call without it differs, and two images are refused."""
    from PIL import Image

    image = Image.open(edit_png).convert("RGB")
    init = noise((1, 16, 4, 6), seed=3)
    ref_lat, ref_px = reference(folders["kontext"], EDIT, init, steps=2, guidance=2.5, width=48, height=32,
                                image=image)
    with FluxKontextPipeline(folders["kontext"], F32) as pipe:
        result = pipe.generate(EDIT, width=48, height=32, steps=2, guidance=2.5, noise=init, edit_images=[image])
        plain = pipe.generate(EDIT, width=48, height=32, steps=2, guidance=2.5, noise=init)
        with pytest.raises(InvalidRequestError, match="at most 1 edit image"):
            pipe.prepare(EDIT, edit_images=[image, image])
    _check_result(result, ref_lat, ref_px)
    assert np.abs(plain.latents - result.latents).max() > 1e-2  # the image is not ignored


@pytest.mark.parametrize("variant,guidance,steps,strength,run", [("dev", 3.5, 4, 0.6, 3), ("schnell", 0.0, 2, 0.5, 1)])
def test_image_to_image_matches_diffusers(folders, edit_png, variant, guidance, steps, strength, run):
    """``FluxImg2ImgPipeline``: the 56x40 init image resized to 48x32, encoded, noised to ``sigmas[t_start]`` with
    ``t_start = int(steps - steps * strength)`` (dev: 1 of 4, so 3 steps run; schnell: 1 of 2), then denoised."""
    from PIL import Image

    image = Image.open(edit_png).convert("RGB")
    init = noise((1, 16, 4, 6), seed=6)
    ref_lat, ref_px = reference_image_to_image(folders[variant], PROMPT, image, init, strength=strength,
                                               steps=steps, guidance=guidance, width=48, height=32)
    seen = []
    with FluxPipeline(folders[variant], F32) as pipe:
        result = pipe.generate(PROMPT, image=image, strength=strength, width=48, height=32, steps=steps,
                               guidance=guidance, noise=init, callback=lambda i, n, lat, t: seen.append((i, n)))
    assert result.stats.steps_run == run and result.stats.strength == strength
    assert seen == [(i, run) for i in range(run)] and result.parameters["strength"] == strength
    _check_result(result, ref_lat, ref_px)


def test_editing_refused_by_pipelines_without_it(folders, edit_png):
    with FluxPipeline(folders["schnell"], F32) as pipe:
        with pytest.raises(InvalidRequestError, match="does not edit images"):
            mlx_engine.generate_image(PROMPT, model=pipe, edit_images=[edit_png], width=32, height=32)
        with pytest.raises(InvalidRequestError, match="does not edit images"):
            pipe.generate(PROMPT, edit_images=[edit_png], width=32, height=32)
        with pytest.raises(InvalidRequestError, match="max_sequence_length"):
            pipe.generate(PROMPT, max_sequence_length=513)
        with pytest.raises(InvalidRequestError, match="strength applies to image-to-image"):
            pipe.generate(PROMPT, strength=0.5, width=32, height=32)
        with pytest.raises(InvalidRequestError, match=r"strength must be a number in \[0, 1\]"):
            pipe.generate(PROMPT, image=str(edit_png), strength=1.5)
        with pytest.raises(InvalidRequestError, match="leaves no denoising step"):
            pipe.generate(PROMPT, image=str(edit_png), strength=0.0, steps=2)
    with FluxKontextPipeline(folders["kontext"], F32) as pipe:
        with pytest.raises(InvalidRequestError, match="does not do image-to-image"):
            pipe.generate(PROMPT, image=str(edit_png), width=32, height=32)


# ------------------------------------------------------------------------------------------------------ the doors


def test_cli_edit_end_to_end(folders, edit_png, tmp_path):
    """``mlx-engine image --edit``: a PNG whose metadata names the edit image and its sha256, and which
    ``--from-metadata`` (the image given again) makes pixel for pixel."""
    import hashlib

    from click.testing import CliRunner
    from PIL import Image

    from mlx_engine.cli.main import main

    def run(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return Path(r.output.strip().splitlines()[-1])

    first = run("image", EDIT, "-m", folders["kontext"], "--edit", edit_png, "--seed", 11, "--steps", 2, "-q",
                "-o", tmp_path / "a.png")
    params = mlx_engine.read_image_parameters(first)
    assert params["edit_images"] == [str(edit_png.resolve())]
    assert params["edit_images_sha256"] == [hashlib.sha256(edit_png.read_bytes()).hexdigest()]
    assert params["seed"] == 11 and (params["width"], params["height"]) == (48, 32)  # the edit image's size
    again = run("image", "--from-metadata", first, "-m", folders["kontext"], "--edit", edit_png, "-q", "-o",
                tmp_path / "b.png")  # files a PNG names (model, edit image) are read only when given again
    a, b = (np.asarray(Image.open(p).convert("RGB")) for p in (first, again))
    assert a.shape == (32, 48, 3) and np.array_equal(a, b)
    r = CliRunner().invoke(main, ["image", PROMPT, "-m", str(folders["schnell"]), "--edit", str(edit_png), "-q",
                                  "-o", str(tmp_path / "c.png")])
    assert r.exit_code == 1 and "does not edit images" in r.stderr


def test_cli_image_to_image_end_to_end(folders, edit_png, tmp_path):
    """``mlx-engine image --image FILE --strength``: the PNG records the strength and the init image's path and
    sha256, ``--from-metadata`` (the image given again) makes it pixel for pixel, and it equals the Python API's."""
    import hashlib

    from click.testing import CliRunner
    from PIL import Image

    from mlx_engine.cli.main import main

    def run(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return Path(r.output.strip().splitlines()[-1])

    first = run("image", PROMPT, "-m", folders["dev"], "--image", edit_png, "--strength", 0.5, "--seed", 7,
                "--steps", 2, "-q", "-o", tmp_path / "a.png")
    params = mlx_engine.read_image_parameters(first)
    assert params["strength"] == 0.5 and params["init_image"] == str(edit_png.resolve())
    assert params["init_image_sha256"] == hashlib.sha256(edit_png.read_bytes()).hexdigest()
    assert (params["width"], params["height"]) == (48, 32)  # the init image's size cut to multiples of 16
    again = run("image", "--from-metadata", first, "-m", folders["dev"], "--image", edit_png, "-q", "-o",
                tmp_path / "b.png")
    want = mlx_engine.generate_image(PROMPT, model=folders["dev"], image=edit_png, strength=0.5, seed=7, steps=2)
    a, b = (np.asarray(Image.open(p).convert("RGB")) for p in (first, again))
    assert a.shape == (32, 48, 3) and np.array_equal(a, b) and np.array_equal(a, np.asarray(want))


def test_server_images_edits_with_openai_client(folders, edit_png, tmp_path):
    """``client.images.edit`` (multipart: ``image``; ``image[]`` for a list) against ``/v1/images/edits``; the image
    equals the API's for the same seed; a model without editing, or two images for Kontext, answer 400."""
    import openai
    from PIL import Image

    from mlx_engine.server import ServerConfig
    from tests.test_server import RunningServer, free_port

    srv = RunningServer(ServerConfig(port=free_port(), store_root=str(tmp_path / "home"),
                                     models_dirs=[str(folders["kontext"].parent)]))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        kontext = str(folders["kontext"])
        r = client.images.edit(model=kontext, image=edit_png.open("rb"), prompt=EDIT, size="48x32",
                               extra_body={"seed": 4, "steps": 2})
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))).convert("RGB"))
        want = mlx_engine.generate_image(EDIT, model=kontext, edit_images=[edit_png], width=48, height=32, seed=4,
                                         steps=2)
        assert np.array_equal(got, np.asarray(want))
        with pytest.raises(openai.BadRequestError, match="at most 1 edit image"):
            client.images.edit(model=kontext, image=[edit_png.open("rb"), edit_png.open("rb")], prompt=EDIT)
        with pytest.raises(openai.BadRequestError, match="does not edit images"):
            client.images.edit(model=str(folders["schnell"]), image=edit_png.open("rb"), prompt=EDIT, size="32x32")
    finally:
        srv.stop()
