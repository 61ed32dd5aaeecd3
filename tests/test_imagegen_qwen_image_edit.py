"""Qwen-Image-Edit against transformers and diffusers on small random configurations, in float32: Qwen2.5-VL's vision
tower (window attention, 2D RoPE, patch merger) and its image preprocessing against transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` and ``Qwen2VLImageProcessorPil``; the text encoder's features of an
edit prompt with an image (the tower's rows in place of the ``<|image_pad|>`` tokens, M-RoPE positions) against
``Qwen2_5_VLForConditionalGeneration`` on the small edit folder of ``tests/qwen_image_edit_small.py``; M-RoPE's
positions against ``get_rope_index``; the final latents and pixels of 2-step edits against diffusers'
``QwenImageEditPipeline`` (one image) and ``QwenImageEditPlusPipeline`` (two images, true CFG).

The reference's M-RoPE: transformers 5 builds Qwen2.5-VL's 3D positions from the processor's ``mm_token_type_ids``;
diffusers 0.42's edit pipelines do not forward them (diffusers issue 14194, fix proposed in PR 14189), so its text
encoder silently runs image tokens at consecutive 1D positions, unlike the model as trained (transformers 4's
``get_rope_index`` found the image tokens by id). The reference here forwards them, as that fix does.

Tolerances (float32 on both sides; what differs is the order of sums in matmuls and attention): the preprocessed
patches exactly (both resize with PIL's bicubic and normalise in float32; measured 0); the tower's merged features
1e-4 (measured 2.8e-5 on values up to 3.6; transformers' own float32 output differs from its float64 one by 2.1e-5,
ours by 4.1e-5); the text encoder's features 3e-4 as tests/test_imagegen_qwen_image.py's (measured 4.9e-5 on values up
to 3.9); the edits' final latents 1e-4 and 8-bit pixels 1/255, as tests/test_imagegen_qwen_image.py's (measured
2.4e-6 and 2.6e-6 on latents up to 4.0, pixels 1.8e-6 and 2.3e-6 before rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from PIL import Image  # noqa: E402

from mlx_engine.errors import InvalidRequestError, WeightsError  # noqa: E402
from mlx_engine.mlx import MLXBackend  # noqa: E402
from mlx_engine.models.vision.qwen25vl_vision import Qwen25Vision, Qwen25VisionConfig, image_patches  # noqa: E402
from tests.hf_gguf import peaked  # noqa: E402
from tests.qwen_image_edit_small import build_folder, load_reference, reference_edit  # noqa: E402
from tests.qwen_image_small import noise  # noqa: E402

TOWER_TOL = 1e-4
TEXT_TOL = 3e-4
LATENT_TOL = 1e-4
PIXEL_TOL = 1  # of 255
PROMPT = "a red circle on a blue background"
#: two blocks, the second with full attention; windows of 3 x 3 merged tokens (84 pixels), so a 32 x 24 patch grid
#: (16 x 12 merged, from a 336 x 448 image) has windows cut short at its bottom edge
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 24,
          "window_size": 84, "fullatt_block_indexes": [1]}


def _photo(seed: int, size: tuple[int, int]) -> Image.Image:
    """Random RGB pixels, ``size`` = (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    """transformers' tower (peaked random weights) and ours on the same weights, saved as safetensors."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLConfig(vision_config=VISION).vision_config
    torch.manual_seed(0)
    ref = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()
    peaked(ref, seed=3)  # the init's tiny weights would leave attention uniform and hide a RoPE or window slip
    folder = tmp_path_factory.mktemp("qwen25vl-vision")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({}))
    backend = MLXBackend(folder, dtype="float32")
    ours = Qwen25Vision(Qwen25VisionConfig.from_hf(config.to_dict()), dict(backend.weights))
    yield ref, ours, backend
    backend.close()


@pytest.mark.parametrize("size", [(336, 448), (97, 61)])
def test_vision_tower_matches_transformers(tower, size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref, ours, backend = tower
    image = _photo(size[0], size)  # the second is resized (to 84 x 56) by smart_resize
    expected = Qwen2VLImageProcessorPil()(images=[image], return_tensors="pt")
    patches, grid = image_patches(image, ours.config)
    assert grid == tuple(expected["image_grid_thw"][0].tolist())
    np.testing.assert_array_equal(patches, expected["pixel_values"].numpy())
    with torch.no_grad():
        want = ref(expected["pixel_values"], grid_thw=expected["image_grid_thw"]).pooler_output.numpy()
    with backend.new_context() as ctx:
        got = ours(ctx, patches, grid).numpy()
    assert got.shape == want.shape == (grid[1] * grid[2] // 4, VISION["out_hidden_size"])
    np.testing.assert_allclose(got, want, rtol=0, atol=TOWER_TOL)


def test_vision_tower_checks(tower):
    _, ours, backend = tower
    with backend.new_context() as ctx, pytest.raises(InvalidRequestError, match="do not fit the grid"):
        ours(ctx, np.zeros((10, ours.config.patch_features), np.float32), (1, 4, 4))
    with pytest.raises(WeightsError, match="inconsistent"):
        Qwen25VisionConfig.from_hf({**VISION, "num_heads": 3})
    with pytest.raises(WeightsError, match="lacks visual.merger.ln_q.weight"):
        Qwen25Vision(ours.config, {k: v for k, v in ours.w.items() if k != "merger.ln_q.weight"})


@pytest.fixture(scope="module")
def edit_folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("qwen-image-edit") / "small-qwen-image-edit")


@pytest.fixture(scope="module")
def edit_ref(edit_folder):
    return load_reference(edit_folder)


def reference_features(pipe, prompt: str, image: Image.Image) -> np.ndarray:
    """diffusers' ``_get_qwen_prompt_embeds`` (final-normed hidden states, the template's 64 tokens dropped), with
    the processor's ``mm_token_type_ids`` forwarded (see the module docstring): ``[L, D]`` float32."""
    inputs = pipe.processor(text=[pipe.prompt_template_encode.format(prompt)], images=image, padding=True,
                            return_tensors="pt")
    with torch.no_grad():
        hidden = pipe.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
    return hidden[0, pipe.prompt_template_encode_start_idx:].numpy()


def test_text_encoder_with_image_matches_transformers(edit_folder, edit_ref):
    from mlx_engine.imagegen.text_encoder import TextEncoder
    from mlx_engine.models.registry import load_text_model
    from mlx_engine.models.text.tokenizer import Tokenizer

    image = _photo(7, (84, 56))  # 6 x 4 patches: 3 x 2 merged image tokens with rows and columns apart
    backend = MLXBackend(edit_folder / "text_encoder", dtype="float32")
    config = json.loads((edit_folder / "text_encoder" / "config.json").read_text())
    weights = {k.split("visual.", 1)[1]: v for k, v in backend.weights.items() if "visual." in k}
    tower = Qwen25Vision(Qwen25VisionConfig.from_hf(config["vision_config"]), weights)
    encoder = TextEncoder(load_text_model(backend), Tokenizer.from_folder(edit_folder / "tokenizer"), backend,
                          hidden_state=-1, template=edit_ref.prompt_template_encode, drop=64)
    prompts = ["a red circle on a blue background", "bad quality, blurry"]
    patches, grid = image_patches(image, tower.config)
    with backend.new_context() as ctx:
        rows = tower(ctx, patches, grid)
        got = [e.numpy() for e in encoder.encode(ctx, prompts, images=[(rows, (1, grid[1] // 2, grid[2] // 2))])]
    backend.close()
    for prompt, ours in zip(prompts, got):
        want = reference_features(edit_ref, prompt, image)
        assert ours.shape == want.shape
        np.testing.assert_allclose(ours, want, rtol=0, atol=TEXT_TOL)
    # the M-RoPE positions matter here: transformers without them (diffusers 0.42's call) differs far beyond that
    inputs = edit_ref.processor(text=[edit_ref.prompt_template_encode.format(prompts[0])], images=image,
                                return_tensors="pt")
    inputs.pop("mm_token_type_ids")
    with torch.no_grad():
        flat = edit_ref.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1][0, 64:].numpy()
    assert np.abs(flat - got[0]).max() > 100 * TEXT_TOL


def test_mrope_index_matches_transformers(edit_ref):
    """Two images of different grids between text runs (Plus's prompts), against ``get_rope_index``."""
    from mlx_engine.models.arch.qwen2 import Qwen25VL

    pad = edit_ref.text_encoder.config.image_token_id
    grids = [(1, 2, 3), (1, 4, 2)]  # merged; transformers takes the patch grid (x 2 per side)
    ids = [5, 6, 7] + [pad] * 6 + [8, 9] + [pad] * 8 + [10]
    types = [int(t == pad) for t in ids]
    with torch.no_grad():
        want, _ = edit_ref.text_encoder.model.get_rope_index(
            torch.tensor([ids]), torch.tensor([types]), torch.tensor([(t, 2 * h, 2 * w) for t, h, w in grids]))
    np.testing.assert_array_equal(Qwen25VL.rope_index(ids, pad, grids), want[:, 0].numpy())
    with pytest.raises(InvalidRequestError, match="do not match"):
        Qwen25VL.rope_index(ids, pad, grids[:1])


def _ours(folder: Path):
    from mlx_engine.imagegen.registry import load_pipeline

    return load_pipeline(folder, lambda p: MLXBackend(p, dtype="float32"))


def test_edit_matches_diffusers(edit_folder, edit_ref):
    """One input image (sized by the pipeline to 1024 x 1024 for the VAE and the vision tower, as diffusers), a
    64 x 64 output, 2 steps without CFG (tests/test_imagegen_qwen_image.py proves the CFG step)."""
    from mlx_engine.imagegen.qwen_image_edit import QwenImageEditPipeline

    image = _photo(11, (56, 40))
    init = noise((1, 16, 8, 8), seed=1)
    want_latents, want_pixels = reference_edit(edit_ref, PROMPT, image, init, steps=2, guidance=1.0,
                                               width=64, height=64)
    pipe = _ours(edit_folder)
    assert isinstance(pipe, QwenImageEditPipeline) and pipe.max_edit_images == 1
    try:
        got = pipe.generate(PROMPT, edit_images=[image], width=64, height=64, steps=2, guidance=1.0, noise=init)
        np.testing.assert_allclose(got.latents, want_latents, rtol=0, atol=LATENT_TOL)
        assert np.abs(np.asarray(got.images[0], np.int32) - np.round(want_pixels[0] * 255)).max() <= PIXEL_TOL
        with pytest.raises(InvalidRequestError, match="edits an image"):
            pipe.generate(PROMPT, width=64, height=64, steps=1)
        with pytest.raises(InvalidRequestError, match="at most 1 edit image"):
            pipe.generate(PROMPT, edit_images=[image, image], width=64, height=64, steps=1)
    finally:
        pipe.close()


@pytest.fixture(scope="module")
def plus_folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("qwen-image-edit-plus") / "small-qwen-image-edit-plus", plus=True)


def test_edit_plus_matches_diffusers(plus_folder, monkeypatch):
    """Two input images of different aspects, with true CFG; both pipelines' VAE area (diffusers' module constant
    ``VAE_IMAGE_SIZE``, ours ``VAE_AREA``) shrunk from 1024 x 1024 to 256 x 256 to keep the test lean (the same
    code runs; the 1024 x 1024 path is the one-image test's)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from mlx_engine.imagegen import qwen_image_edit
    from mlx_engine.imagegen.qwen_image_edit import QwenImageEditPlusPipeline

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 256 * 256)
    monkeypatch.setattr(qwen_image_edit, "VAE_AREA", 256 * 256)
    images = [_photo(12, (56, 40)), _photo(13, (32, 48))]
    init = noise((1, 16, 8, 8), seed=2)
    ref = load_reference(plus_folder, plus=True)
    want_latents, want_pixels = reference_edit(ref, PROMPT, images, init, steps=2, guidance=4.0,
                                               negative_prompt=" ", width=64, height=64)
    pipe = _ours(plus_folder)
    assert isinstance(pipe, QwenImageEditPlusPipeline)
    try:
        got = pipe.generate(PROMPT, edit_images=images, width=64, height=64, steps=2, guidance=4.0,
                            negative_prompt=" ", noise=init)
        np.testing.assert_allclose(got.latents, want_latents, rtol=0, atol=LATENT_TOL)
        assert np.abs(np.asarray(got.images[0], np.int32) - np.round(want_pixels[0] * 255)).max() <= PIXEL_TOL
    finally:
        pipe.close()
