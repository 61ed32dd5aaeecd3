"""Qwen-Image-Edit against transformers and diffusers on small random configurations, in float32: Qwen2.5-VL's vision
tower (window attention, 2D RoPE, patch merger) and its image preprocessing against transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` and ``Qwen2VLImageProcessorPil``.

Tolerances (float32 on both sides; what differs is the order of sums in matmuls and attention): the preprocessed
patches exactly (both resize with PIL's bicubic and normalise in float32; measured 0); the tower's merged features
1e-4 (measured 2.8e-5 on values up to 3.6; transformers' own float32 output differs from its float64 one by 2.1e-5,
ours by 4.1e-5).
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

TOWER_TOL = 1e-4
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
