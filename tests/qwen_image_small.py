"""A small random Qwen-Image pipeline built with diffusers and transformers on PyTorch CPU, saved in diffusers' folder
layout, and diffusers' own results on it (the references of ``tests/test_imagegen_qwen_image.py``).

The components follow diffusers' ``tests/pipelines/qwenimage/test_qwenimage.py`` at a small size: a
``QwenImageTransformer2DModel`` (2 heads of 16, 2 blocks, axes_dims_rope [4, 6, 6], text width 32), an
``AutoencoderKLQwenImage`` (base_dim 8, dim_mult [1, 2, 4, 4] so 8 pixels per latent as the real one, 16 latent
channels, random latents_mean / latents_std), a transformers
``Qwen2_5_VLForConditionalGeneration`` (2 layers, hidden size 32, grouped-query attention, M-RoPE sections [2, 3, 3],
a 1-block vision tower that the text encoder never runs; weights re-drawn by ``tests.hf_gguf.peaked``), the byte-level BPE tokenizer of ``tests/zimage_small.py``,
and ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's settings (dynamic shift, ``shift_terminal`` 0.02). The
transformer is saved in several safetensors shards with an index.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.hf_gguf import peaked
from tests.zimage_small import small_tokenizer

#: Qwen-Image's scheduler_config.json (its released values)
SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
             "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
             "use_dynamic_shifting": True}


def build_pipeline():
    """The diffusers ``QwenImagePipeline`` of random small components (float32, CPU, seeded)."""
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = small_tokenizer()
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True, True],
                                 latents_mean=[round(float(v), 4) for v in rng.normal(0, 0.5, 16)],
                                 latents_std=[round(float(v), 4) for v in rng.uniform(0.8, 2.5, 16)])
    with torch.no_grad():  # RMS norm gains start at 1: make them random so a misplaced gain shows
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    torch.manual_seed(2)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": len(tokenizer), "max_position_embeddings": 2048,
                     "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32},
        hidden_size=32, vocab_size=len(tokenizer))
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    peaked(text_encoder, seed=2)  # transformers' init leaves attention nearly idle: a RoPE slip would hide
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def build_folder(path: Path) -> Path:
    """Save the small pipeline in diffusers' layout at ``path`` (the transformer sharded with an index)."""
    build_pipeline().save_pretrained(str(path), max_shard_size="300KB")
    return path


def load_reference(folder: Path):
    """diffusers' ``QwenImagePipeline`` loaded back from the saved folder (float32)."""
    import torch
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def noise(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def reference_text_to_image(pipe, prompt, init_noise: np.ndarray, *, steps: int, guidance: float,
                            negative_prompt=None, width: int, height: int):
    """diffusers' ``QwenImagePipeline`` from ``init_noise`` ``[B, 16, h, w]`` (packed by its ``_pack_latents``, as
    ``prepare_latents`` packs a draw): ``(final latents [B, 16, h, w] float32 (its ``_unpack_latents``), pixels
    [B, H, W, 3] float in [0, 1])``."""
    import torch

    b, c, h, w = init_noise.shape
    with torch.no_grad():
        start = pipe._pack_latents(torch.from_numpy(init_noise), b, c, h, w)
        packed = pipe(prompt, negative_prompt=negative_prompt, true_cfg_scale=guidance, height=height, width=width,
                      num_inference_steps=steps, latents=start, output_type="latent").images
        z = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)  # [B, C, 1, h, w]
        latents = z[:, :, 0].float().numpy()
        cfg = pipe.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        image = pipe.vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        pixels = pipe.image_processor.postprocess(image, output_type="np")
    return latents, pixels
