"""A small random Z-Image pipeline built with diffusers and transformers on PyTorch CPU, saved in diffusers' folder
layout, and diffusers' own results on it (the references of the pipeline and CLI tests).

The components follow diffusers' ``tests/pipelines/z_image/test_z_image.py`` at a small size: a
``ZImageTransformer2DModel`` (dim 64, 2 layers, 1 refiner layer, axes_dims [16, 8, 8]), a FLUX-layout
``AutoencoderKL`` (4 blocks, so 8 pixels per latent as the real FLUX VAE, 16 latent channels, no quant convs,
scaling 0.3611 and shift 0.1159 as FLUX), a transformers ``Qwen3Model`` (3 layers, hidden size 32) as the text encoder,
a small byte-level BPE tokenizer trained here with a Qwen-style chat template (``enable_thinking`` as Qwen3's), and
``FlowMatchEulerDiscreteScheduler(shift=3.0)`` as Z-Image-Turbo's. The transformer and VAE are saved in several
safetensors shards with an index, as large checkpoints are.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = ["a red circle on a blue background", "a small green square in the top left corner",
          "a yellow triangle at the bottom right", "dance monkey", "bad quality, blurry", "user assistant"]


def small_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="right", chat_template=CHAT_TEMPLATE)


def build_pipeline():
    """The diffusers ``ZImagePipeline`` of random small components (float32, CPU, seeded)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = small_tokenizer()
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[16, 8, 8], axes_lens=[256, 32, 32])
    with torch.no_grad():  # made with torch.empty: give them values
        transformer.x_pad_token.copy_(torch.randn_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.randn_like(transformer.cap_pad_token))
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[16, 32, 32, 32], layers_per_block=1,
        latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)
    torch.manual_seed(2)
    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=1000000.0)
    text_encoder = Qwen3Model(config)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = ZImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          scheduler=scheduler)
    return pipe


def build_folder(path: Path) -> Path:
    """Save the small pipeline in diffusers' layout at ``path`` (transformer and VAE sharded with an index)."""
    pipe = build_pipeline()
    pipe.save_pretrained(str(path), max_shard_size="500KB")
    return path


def copy_folder(src: Path, dst: Path, *, link_weights: bool = True) -> Path:
    """A copy of a saved folder whose safetensors are hard links (cheap; the weights reader refuses shards whose
    symbolic links lead out of the folder), for tests that change a part."""
    for f in src.rglob("*"):
        rel = f.relative_to(src)
        if f.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        if link_weights and f.suffix == ".safetensors":
            try:
                os.link(f, dst / rel)
            except OSError:
                shutil.copyfile(f, dst / rel)
        else:
            shutil.copyfile(f, dst / rel)
    return dst


def set_scheduler(folder: Path, **changes) -> None:
    f = folder / "scheduler" / "scheduler_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg, indent=2))


def noise(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _decode(pipe, latents):
    """Decode as ``ZImagePipeline.__call__`` does after the loop: float [B, H, W, 3] in [0, 1]."""
    import torch

    with torch.no_grad():
        z = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(z, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")


def reference_text_to_image(folder: Path, prompt: str, init_noise: np.ndarray, *, steps: int, guidance: float,
                            negative_prompt: str | None = None, width: int, height: int, **kwargs):
    """diffusers' ``ZImagePipeline`` on the saved folder from ``init_noise`` ``[B, C, h, w]``: ``(final latents
    [B, C, h, w] float32, pixels [B, H, W, 3] float in [0, 1])``."""
    import torch
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        latents = pipe(prompt, negative_prompt=negative_prompt, height=height, width=width,
                       num_inference_steps=steps, guidance_scale=guidance, latents=torch.from_numpy(init_noise),
                       output_type="latent", **kwargs).images
    return latents.float().numpy(), _decode(pipe, latents)


def reference_image_to_image(folder: Path, prompt: str, image, init_noise: np.ndarray, *, strength: float,
                             steps: int, guidance: float, negative_prompt: str | None = None, **kwargs):
    """diffusers' ``ZImageImg2ImgPipeline`` on the saved folder: the init image encoded (the VAE posterior's mode, as
    this engine does, instead of a sample), noised with ``init_noise`` (diffusers' ``randn_tensor`` replaced by it),
    then denoised. Returns ``(final latents, pixels)`` as :func:`reference_text_to_image`."""
    import torch
    from diffusers import ZImageImg2ImgPipeline
    from diffusers.pipelines.z_image import pipeline_z_image_img2img as mod

    pipe = ZImageImg2ImgPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    saved = mod.retrieve_latents, mod.randn_tensor
    mod.retrieve_latents = lambda out, generator=None, sample_mode="sample": out.latent_dist.mode()
    mod.randn_tensor = lambda shape, generator=None, device=None, dtype=None, layout=None: \
        torch.from_numpy(init_noise).to(dtype=dtype).reshape(shape)
    try:
        with torch.no_grad():
            latents = pipe(prompt, image=image, strength=strength, negative_prompt=negative_prompt,
                           num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                           **kwargs).images
    finally:
        mod.retrieve_latents, mod.randn_tensor = saved
    return latents.float().numpy(), _decode(pipe, latents)
