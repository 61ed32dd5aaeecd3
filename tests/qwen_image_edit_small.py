"""A small random Qwen-Image-Edit pipeline (diffusers' ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline``)
built with diffusers and transformers on PyTorch CPU and saved in diffusers' folder layout: the components of
``tests/qwen_image_small.py``, with a text encoder whose vision tower runs (2 blocks, the second with full attention,
windows of 3 x 3 merged tokens, peaked weights), the byte-level BPE tokenizer with Qwen2.5-VL's vision tokens added,
and a ``Qwen2VLProcessor`` (transformers' PIL image processor).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

#: the tower of the test: head size 16 (2 heads of 32 features), M-RoPE sections [2, 3, 3] in the text model
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 32,
          "window_size": 84, "fullatt_block_indexes": [1]}
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


@contextlib.contextmanager
def _without_video():
    """transformers' processors construct, check and save a video processor, whose class needs torchvision (not
    installed here); the edit pipelines use no video: the processor is made, saved and loaded without one."""
    from transformers import Qwen2VLProcessor

    attributes = Qwen2VLProcessor.get_attributes.__func__

    def images_only(cls):
        return [a for a in attributes(cls) if "video" not in a]

    Qwen2VLProcessor.get_attributes = classmethod(images_only)
    try:
        yield
    finally:
        del Qwen2VLProcessor.get_attributes  # the inherited one again


def build_pipeline(plus: bool = False):
    """The diffusers edit pipeline (``plus``: the multi-image ``QwenImageEditPlusPipeline``) of random small
    components (float32, CPU, seeded)."""
    import torch
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.hf_gguf import peaked
    from tests.qwen_image_small import build_pipeline as build_text_to_image

    base = build_text_to_image()
    tokenizer = base.tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    old = base.text_encoder.config.text_config
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": len(tokenizer), "max_position_embeddings": 2048,
                     "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"}},
        vision_config=VISION, hidden_size=32, vocab_size=len(tokenizer), image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    assert old.hidden_size == config.text_config.hidden_size
    torch.manual_seed(3)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    peaked(text_encoder, seed=3)
    with _without_video():
        processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return cls(scheduler=base.scheduler, vae=base.vae, text_encoder=text_encoder, tokenizer=tokenizer,
               processor=processor, transformer=base.transformer)


def build_folder(path: Path, plus: bool = False) -> Path:
    """Save the small edit pipeline in diffusers' layout at ``path``."""
    pipe = build_pipeline(plus)
    with _without_video():
        pipe.save_pretrained(str(path), max_shard_size="300KB")
    return path


def load_reference(folder: Path, plus: bool = False):
    """diffusers' edit pipeline loaded back from the saved folder (float32)."""
    import torch
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    with _without_video():
        pipe = cls.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@contextlib.contextmanager
def with_mrope(pipe):
    """diffusers' edit pipeline with the processor's ``mm_token_type_ids`` reaching the text encoder (what diffusers PR
    14189 does; without them transformers 5 runs image tokens at 1D positions, diffusers issue 14194)."""
    te = pipe.text_encoder
    forward = te.forward
    image_token = te.config.image_token_id

    def fixed(*args, input_ids=None, pixel_values=None, **kw):
        if pixel_values is not None and kw.get("mm_token_type_ids") is None:
            kw["mm_token_type_ids"] = (input_ids == image_token).int()
        return forward(*args, input_ids=input_ids, pixel_values=pixel_values, **kw)

    te.forward = fixed
    try:
        yield pipe
    finally:
        del te.forward


def reference_edit(pipe, prompt, images, init_noise, *, steps: int, guidance: float, negative_prompt=None,
                   width: int, height: int):
    """diffusers' edit pipeline (3D positions, :func:`with_mrope`) from ``init_noise`` ``[B, 16, h, w]``:
    ``(final latents [B, 16, h, w] float32, pixels [B, H, W, 3] float in [0, 1])``."""
    import torch

    b, c, h, w = init_noise.shape
    with torch.no_grad(), with_mrope(pipe):
        start = pipe._pack_latents(torch.from_numpy(init_noise), b, c, h, w)
        packed = pipe(image=images, prompt=prompt, negative_prompt=negative_prompt, true_cfg_scale=guidance,
                      height=height, width=width, num_inference_steps=steps, latents=start,
                      output_type="latent").images
        z = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)
        latents = z[:, :, 0].float().numpy()
        cfg = pipe.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        image = pipe.vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        pixels = pipe.image_processor.postprocess(image, output_type="np")
    return latents, pixels
