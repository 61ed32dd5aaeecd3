"""Small random FLUX.1 and FLUX.1 Kontext pipelines built with diffusers and transformers on PyTorch CPU, saved in
diffusers' folder layout, and diffusers' own results on them (``FluxPipeline``, ``FluxKontextPipeline`` and
``FluxImg2ImgPipeline``: the references of tests/test_imagegen_flux.py).

The components follow diffusers' ``tests/pipelines/flux/test_pipeline_flux.py`` at a small size: a
``FluxTransformer2DModel`` (2 heads of 16, 1 double and 2 single blocks, axes_dims_rope [4, 6, 6], 64 input channels
as the real model's 16 latent channels packed 2x2), a FLUX-layout ``AutoencoderKL`` (as tests/zimage_small.py: 4
blocks, 8 pixels per latent, 16 latent channels, FLUX's scaling and shift), a transformers ``CLIPTextModel`` (2
layers, width 32, quick_gelu, ``eos_token_id = 2`` as FLUX's config) with a CLIP BPE tokenizer trained here and saved
as FLUX's is (``vocab.json`` and ``merges.txt`` only), a ``T5EncoderModel`` (2 layers, gated-GELU, 8 relative
position buckets over a distance of 16, so the logarithmic buckets are used) with a Unigram tokenizer trained here,
and ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting as FLUX.1-dev's (schnell's static one for schnell).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

CORPUS = ["a red circle on a blue background", "a small green square in the top left corner",
          "a yellow triangle at the bottom right", "make the circle green", "bad quality, blurry",
          "a lighthouse at dusk, watercolour"]
MAX_T5 = 24  # T5 tokens of the tests (the real pipeline's 512 made small)


def clip_tokenizer_files(folder: Path) -> None:
    """A CLIP BPE vocabulary (``vocab.json``, ``merges.txt``: the byte alphabet, the same with ``</w>``, trained
    merges, then ``<|startoftext|>`` and ``<|endoftext|>`` last, as CLIP's) and ``tokenizer_config.json``."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                             behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=900, initial_alphabet=alphabet, end_of_word_suffix="</w>",
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    vocab: dict[str, int] = {}
    for t in sorted(alphabet) + [c + "</w>" for c in sorted(alphabet)] + ["".join(m) for m in merges] + \
            ["<|startoftext|>", "<|endoftext|>"]:
        vocab.setdefault(t, len(vocab))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")


def t5_tokenizer():
    """A T5 tokenizer (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``</s>`` appended) over a Unigram vocabulary trained
    here."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import Unigram
    from transformers import T5Tokenizer

    tok = Tokenizer(Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def build_folder(path: Path, *, kontext: bool = False, guidance_embeds: bool = True) -> Path:
    """Save a small FLUX pipeline (``FluxKontextPipeline`` when ``kontext``) in diffusers' layout at ``path``."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from diffusers import FluxKontextPipeline, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    scratch = path.parent / (path.name + ".tok")
    clip_tokenizer_files(scratch / "clip")
    clip_tok = CLIPTokenizer.from_pretrained(str(scratch / "clip"), model_max_length=77)
    t5_tok = t5_tokenizer()
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=[4, 6, 6])
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[16, 32, 32, 32], layers_per_block=1,
        latent_channels=16, norm_num_groups=8, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True)
    torch.manual_seed(2)
    clip = CLIPTextModel(CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, vocab_size=len(clip_tok),
        max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=2,
        pad_token_id=1, projection_dim=32))
    torch.manual_seed(3)
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    if guidance_embeds:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    cls = FluxKontextPipeline if kontext else FluxPipeline
    pipe = cls(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
               tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(str(path))
    # FLUX's tokenizer/ folder holds the BPE files only (no tokenizer.json): so does this one
    for f in (path / "tokenizer").iterdir():
        if f.name not in ("tokenizer_config.json", "special_tokens_map.json"):
            f.unlink()
    for f in ("vocab.json", "merges.txt"):
        shutil.copyfile(scratch / "clip" / f, path / "tokenizer" / f)
    (path / "mlx_engine.json").write_text(json.dumps({"steps": 2, "max_sequence_length": MAX_T5,
                                                      "edit_auto_resize": False}))
    return path


def noise(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def pack(x: np.ndarray) -> np.ndarray:
    """diffusers' ``_pack_latents`` in NumPy: ``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def reference(folder: Path, prompt: str, init_noise: np.ndarray, *, steps: int, guidance: float, width: int,
              height: int, image=None, **kwargs):
    """diffusers' pipeline of the folder from ``init_noise [B, C, h, w]`` (packed as diffusers packs it):
    ``(final latents [B, C, h, w] float32, pixels [B, H, W, 3] in [0, 1])``. With ``image`` (Kontext): the image
    preprocessed without auto-resize, at ``max_area = width * height`` (the size taken as given)."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    extra = dict(kwargs)
    if image is not None:
        extra.update(image=image, _auto_resize=False, max_area=width * height)
    with torch.no_grad():
        packed = pipe(prompt=prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                      latents=torch.from_numpy(pack(init_noise)), output_type="latent", max_sequence_length=MAX_T5,
                      **extra).images
        latents = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)
        z = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        pixels = pipe.image_processor.postprocess(pipe.vae.decode(z, return_dict=False)[0], output_type="np")
    return latents.float().numpy(), pixels


def reference_image_to_image(folder: Path, prompt: str, image, init_noise: np.ndarray, *, strength: float,
                             steps: int, guidance: float, width: int, height: int, **kwargs):
    """diffusers' ``FluxImg2ImgPipeline`` on a FLUX.1 folder: the init image resized to ``width x height`` and encoded
    (the VAE posterior's mode, as this engine does when given the noise, instead of a sample), noised with
    ``init_noise [B, C, h, w]`` (the module's ``randn_tensor`` replaced by it) to the start step ``strength`` gives,
    then denoised. Returns ``(final latents [B, C, h, w] float32, pixels [B, H, W, 3] in [0, 1])``."""
    import torch
    from diffusers import FluxImg2ImgPipeline
    from diffusers.pipelines.flux import pipeline_flux_img2img as mod

    pipe = FluxImg2ImgPipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    saved = mod.retrieve_latents, mod.randn_tensor
    mod.retrieve_latents = lambda out, generator=None, sample_mode="sample": out.latent_dist.mode()
    mod.randn_tensor = lambda shape, generator=None, device=None, dtype=None, layout=None: \
        torch.from_numpy(init_noise).to(dtype=dtype).reshape(shape)
    try:
        with torch.no_grad():
            packed = pipe(prompt=prompt, image=image, strength=strength, height=height, width=width,
                          num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                          max_sequence_length=MAX_T5, **kwargs).images
            latents = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)
            z = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            pixels = pipe.image_processor.postprocess(pipe.vae.decode(z, return_dict=False)[0], output_type="np")
    finally:
        mod.retrieve_latents, mod.randn_tensor = saved
    return latents.float().numpy(), pixels
