"""The FLUX.1 pipelines: text-to-image (schnell, dev) as diffusers' ``FluxPipeline``, image-to-image as
``FluxImg2ImgPipeline``, and image editing as ``FluxKontextPipeline``.

Sources: diffusers ``pipelines/flux/pipeline_flux.py`` (``__call__``, ``encode_prompt``, ``_get_clip_prompt_embeds``,
``_get_t5_prompt_embeds``, ``prepare_latents``, ``_pack_latents``, ``_unpack_latents``,
``_prepare_latent_image_ids``, ``calculate_shift``) and ``pipelines/flux/pipeline_flux_kontext.py`` (``__call__``,
``prepare_latents``, ``_encode_vae_image``, ``PREFERRED_KONTEXT_RESOLUTIONS``) and ``pipelines/flux/
pipeline_flux_img2img.py`` (``get_timesteps``, ``prepare_latents``). In the prepare / denoise generator / decode shape
of :class:`~mlx_engine.imagegen.zimage.ZImagePipeline`::

    prompt -> CLIP pooled [B, 768] (77 tokens) ; T5 features [B, L, 4096] (L = max_sequence_length, pads included)
    seed -> noise [B, 16, h, w] (h = 2 * (height // 16)) ; packed 2x2: [B, (h/2)(w/2), 64], ids (0, row, col)
    Kontext: each edit image -> VAE mean -> (x - shift) * scale -> packed, ids (1, row, col), appended to the sequence
    mu = calculate_shift(image tokens) ; sigmas = linspace(1, 1/n, n) -> scheduler.set_timesteps(sigmas, mu)
    image-to-image: init image -> VAE -> (x - shift) * scale, noised to sigmas[t_start] (t_start from strength); the
                loop runs steps t_start .. n - 1
    per step i: v = transformer(latents [+ edit latents], t_i / 1000, guidance (dev), pooled, T5)[:, :S]
                (true CFG when ``true_cfg > 1`` and a negative prompt: neg + true_cfg * (pos - neg))
                latents = scheduler.step(v, i, latents)
    unpack -> latents / scaling_factor + shift_factor -> VAE decode -> [0, 1] -> uint8 -> PIL

``guidance`` is diffusers' ``guidance_scale``: FLUX.1-dev and Kontext take it as an input of the transformer (guidance
distillation, one pass per step); schnell has no such input and ignores it. Latents stay float32 ``[B, C, h, w]``
between steps (diffusers keeps them packed, in the model's dtype: the same numbers in float32).

Sizes: the latents of an edit image follow Kontext: its own size rounded down to a multiple of 16, or with
``edit_auto_resize`` (Kontext's default, ``_auto_resize``) the preferred resolution of closest aspect ratio. The output
size defaults to the first edit image's (diffusers' default is 1024 x 1024 rescaled to ``max_area``; a size given here
is taken as given, which is diffusers' result with ``max_area = width * height``).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.imagegen.pipeline import (MAX_SIDE, DenoiseJob, ImageGenerationStats, ImageResult, StepCallback,
                                          component_folder, load_init_image, preprocess_init_image, read_defaults,
                                          read_json, read_model_index)
from mlx_engine.imagegen.zimage import ZImagePipeline
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["FluxPipeline", "FluxKontextPipeline", "PIPELINE_CLASSES", "KONTEXT_CLASSES", "pack_latents",
           "unpack_latents", "latent_image_ids"]

PIPELINE_CLASSES = ("FluxPipeline",)
KONTEXT_CLASSES = ("FluxKontextPipeline",)
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
#: diffusers' ``__call__`` defaults (28 steps, guidance 3.5); schnell's folders say 4 steps in ``mlx_engine.json``.
BUILTIN_DEFAULTS = {"steps": 28, "guidance": 3.5, "true_cfg": 1.0, "negative_prompt": None,
                    "max_sequence_length": 512, "edit_auto_resize": True, "strength": 0.6}
#: the T5 limit of ``FluxPipeline.check_inputs``.
MAX_T5_TOKENS = 512
#: ``(width, height)`` Kontext was trained on (``pipeline_flux_kontext.py``).
PREFERRED_KONTEXT_RESOLUTIONS = [
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672)]


def pack_latents(x: Tensor) -> Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``: each 2x2 patch one token, features in (c, dy, dx) order
    (``FluxPipeline._pack_latents``)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: Tensor, h: int, w: int) -> Tensor:
    """The inverse of :func:`pack_latents`: ``[B, (h/2)(w/2), 4C] -> [B, C, h, w]``."""
    b, _, f = x.shape
    c = f // 4
    return x.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def latent_image_ids(h2: int, w2: int, first: int = 0) -> np.ndarray:
    """Position ids ``[h2 * w2, 3]`` of packed latents: ``(first, row, col)`` (``_prepare_latent_image_ids``;
    Kontext's input image has ``first = 1``)."""
    ids = np.zeros((h2, w2, 3), np.float32)
    ids[..., 0] = first
    ids[..., 1] = np.arange(h2)[:, None]
    ids[..., 2] = np.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3)


@dataclass
class FluxJob(DenoiseJob):
    """A :class:`~mlx_engine.imagegen.pipeline.DenoiseJob` with FLUX's own inputs.

    Attributes:
        pos_embeds, neg_embeds: ``[T5 features [B, L, J], CLIP pooled [B, P]]`` (neg only with true CFG).
        rope: the transformer's RoPE tables of ``[text, latents, edit latents]``.
        edit_latents: packed edit-image latents ``[B, S_edit, 4C]`` or None. true_cfg: the true-CFG scale.
    """

    rope: Any = None
    edit_latents: Tensor | None = None
    true_cfg: float = 1.0


class FluxPipeline:
    """A FLUX.1 diffusers folder (``model_index.json``; ``transformer/``, ``vae/``, ``text_encoder/`` (CLIP),
    ``tokenizer/``, ``text_encoder_2/`` (T5), ``tokenizer_2/``, ``scheduler/``), loaded for generation.

    Made as :class:`~mlx_engine.imagegen.zimage.ZImagePipeline` is (``folder, make_backend, quantize=...,
    keep_text_encoder=..., resolve_model=..., memory_check=...``; ``resolve_model`` is not used: FLUX folders hold
    their encoders) and
    offering the same methods. :attr:`max_edit_images` says how many edit images it takes (0 here);
    :attr:`image_to_image` whether it takes an init image and a strength (``FluxImg2ImgPipeline``; Kontext does not).

    Raises:
        ModelNotFoundError: no such folder or no ``model_index.json``. WeightsError: a missing component, config or
        tensor. UnsupportedError: another pipeline class or component class. InvalidRequestError: ``quantize`` not
        None, 4 or 8. MemoryBudgetError: as ZImagePipeline's ``memory_check``.
    """

    CLASSES = PIPELINE_CLASSES
    max_edit_images = 0
    image_to_image = True

    def __init__(self, folder: "str | os.PathLike[str]", make_backend: Callable[[Path], Backend], *,
                 quantize: int | None = None, keep_text_encoder: bool = False,
                 resolve_model: Callable[[str], Path] | None = None, memory_check: Backend | None = None):
        from mlx_engine.imagegen.memory import check_pipeline_memory
        from mlx_engine.imagegen.scheduler import FlowMatchEulerScheduler

        if quantize not in (None, 4, 8):
            raise InvalidRequestError(f"quantize must be 4 or 8 (bits), got {quantize!r}")
        self.folder = Path(os.fspath(folder))
        self._make_backend = make_backend
        self.quantize = quantize
        self.keep_text_encoder = keep_text_encoder
        self.model_index = self._read_model_index()
        self.name = str(self.folder)
        for tok in ("tokenizer", "tokenizer_2"):
            component_folder(self.folder, tok)
        self.transformer_config = read_json(component_folder(self.folder, "transformer") / "config.json",
                                            "the transformer config")
        self.vae_config = read_json(component_folder(self.folder, "vae") / "config.json", "the vae config")
        self.scheduler = FlowMatchEulerScheduler.from_folder(component_folder(self.folder, "scheduler"))
        self._backends: list[Backend] = []
        self._encoders: tuple | None = None
        self._closed = False
        blocks = self.vae_config.get("block_out_channels") or [0, 0, 0, 0]
        self.vae_scale_factor = 2 ** (len(blocks) - 1)
        self.size_multiple = self.vae_scale_factor * 2  # latents are packed 2x2
        self.min_side = self.size_multiple
        self.max_width = self.max_height = self.max_side = MAX_SIDE
        self.tile_above_pixels = 1024 * 1024
        self.vae_tile, self.vae_tile_overlap = 64, 16
        side = int(self.vae_config.get("sample_size") or 1024)
        side = max(self.min_side, min(MAX_SIDE, side - side % self.size_multiple))
        self.defaults = read_defaults(self.folder, {**BUILTIN_DEFAULTS, "width": side, "height": side})
        #: the bytes the model needs (:mod:`mlx_engine.imagegen.memory`), when the load was checked
        self.memory_estimate = check_pipeline_memory(self, memory_check)
        try:
            self.transformer = self._load_transformer()
            self.vae = self._load_vae()
            if keep_text_encoder:
                self._load_encoders()
        except BaseException:
            self.close()
            raise

    @classmethod
    def memory_layout(cls):
        """What the load holds (:class:`~mlx_engine.imagegen.memory.MemoryLayout`) for the memory estimate."""
        from mlx_engine.imagegen.flux_transformer import FluxTransformer
        from mlx_engine.imagegen.memory import MemoryLayout
        from mlx_engine.imagegen.quantize import T5_FLOAT

        return MemoryLayout(float_prefixes=FluxTransformer.FLOAT_PREFIXES, text=("text_encoder", "text_encoder_2"),
                            text_float={"text_encoder_2": T5_FLOAT})

    # ---- loading -------------------------------------------------------------------------------------------------
    def _read_model_index(self) -> dict:
        index = read_model_index(self.folder)
        name = index.get("_class_name")
        if name not in self.CLASSES:
            raise UnsupportedError(f"{self.folder}: pipeline {name!r} is not loaded by {type(self).__name__}, which "
                                   f"runs {' and '.join(self.CLASSES)} folders")
        for comp in COMPONENTS:
            if comp not in index:
                raise WeightsError(f"{self.folder / 'model_index.json'}: no {comp!r} component listed")
        expected = {"transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL", "text_encoder": "CLIPTextModel",
                    "text_encoder_2": "T5EncoderModel", "scheduler": "FlowMatchEulerDiscreteScheduler"}
        for comp, cls in expected.items():
            entry = index.get(comp)
            got = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
            if got is not None and got != cls:
                raise UnsupportedError(f"{self.folder}: {comp} is a {got}; this engine implements {cls}")
        return index

    def _backend(self, name: str) -> Backend:
        return self._make_backend(component_folder(self.folder, name))

    def _load_transformer(self):
        from mlx_engine.imagegen.flux_transformer import FluxTransformer
        from mlx_engine.imagegen.quantize import transformer_backend

        backend = transformer_backend(self._make_backend, component_folder(self.folder, "transformer"), self.quantize,
                                      FluxTransformer.FLOAT_PREFIXES)
        self._backends.append(backend)
        return FluxTransformer.from_backend(backend, quantize_bits=self.quantize)

    def _load_vae(self):
        from mlx_engine.imagegen.vae import AutoencoderKL

        backend = self._backend("vae")
        self._backends.append(backend)
        vae = AutoencoderKL.from_backend(backend)
        backend.close()  # the VAE keeps its own channels-last copies
        return vae

    def _load_encoders(self) -> tuple:
        """``(CLIPTextEncoder, T5Encoder)``, loaded once until :meth:`free_text_encoder`."""
        from mlx_engine.imagegen.clip_encoder import CLIPTextEncoder
        from mlx_engine.imagegen.quantize import T5_FLOAT, quantizing
        from mlx_engine.imagegen.t5_encoder import T5Encoder

        if self._encoders is None:
            # CLIP stays as stored with --quantize: 123 M parameters, 2.5 % of T5's 4.8 B
            clip = CLIPTextEncoder(self._backend("text_encoder"), component_folder(self.folder, "tokenizer"))
            try:
                t5_backend = quantizing(self._make_backend, self.quantize, T5_FLOAT)
                t5 = T5Encoder(t5_backend(component_folder(self.folder, "text_encoder_2")),
                               component_folder(self.folder, "tokenizer_2"))
            except BaseException:
                clip.close()
                raise
            self._encoders = (clip, t5)
        return self._encoders

    def free_text_encoder(self) -> None:
        """Close both text encoders (loaded again by the next generation)."""
        encoders, self._encoders = self._encoders, None
        for e in encoders or ():
            e.close()
            e.backend.clear_cache()

    def close(self) -> None:
        """Drop every component's weights."""
        self.free_text_encoder()
        for b in self._backends:
            b.close()
        self._backends = []
        self._closed = True

    # what Z-Image's pipeline does the same way (the transformer's backend, memory figures, the size check, the VAE
    # decode of [B, C, h, w] latents), shared rather than copied
    backend = ZImagePipeline.backend
    backend_name = ZImagePipeline.backend_name
    memory = ZImagePipeline.memory
    check_size = ZImagePipeline.check_size
    decode = ZImagePipeline.decode
    __enter__ = ZImagePipeline.__enter__
    __exit__ = ZImagePipeline.__exit__

    # ---- the steps -----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompts: Sequence[str], max_sequence_length: int) -> tuple[Tensor, Tensor]:
        """``(T5 features [B, L, J], CLIP pooled [B, P])`` in the encoders' compute dtype (diffusers
        ``FluxPipeline.encode_prompt``; ``prompt_2`` is the prompt)."""
        clip, t5 = self._load_encoders()
        with clip.backend.new_context() as ctx:
            pooled = clip.encode(ctx, prompts)
            ctx.evaluate(pooled)
        with t5.backend.new_context() as ctx:
            feats = t5.encode(ctx, prompts, max_sequence_length)
            ctx.evaluate(feats)
        return feats, pooled

    def generate(self, prompt: "str | Sequence[str]", *, negative_prompt: "str | Sequence[str] | None" = None,
                 width: int | None = None, height: int | None = None, steps: int | None = None,
                 guidance: float | None = None, seed: int | None = None, edit_images: Sequence[Any] | None = None,
                 image: Any = None, strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                 callback: StepCallback | None = None, true_cfg: float | None = None,
                 max_sequence_length: int | None = None, sigmas: Sequence[float] | None = None,
                 vae_tiling: bool | None = None) -> ImageResult:
        """Generate images: :meth:`prepare`, each step of :meth:`denoise` (``callback`` after each), :meth:`decode`.

        Args:
            prompt: a text, or a list (one image each); given to both CLIP and T5.
            negative_prompt: used only with ``true_cfg > 1`` (diffusers' true classifier-free guidance).
            width, height: pixels, multiples of :attr:`size_multiple` (16) up to 4096 (default: the model's, or the
                first edit image's size).
            steps: denoising steps (default 28; schnell folders: their ``mlx_engine.json``).
            guidance: diffusers' ``guidance_scale``, the distilled guidance input of dev and Kontext (ignored by
                schnell), >= 0.
            seed: seed of the noise ``[B, 16, h, w]``; None draws one (reported in the stats and parameters).
            edit_images: images to edit (PIL images, paths or uint8 ``[H, W, 3]`` arrays); up to
                :attr:`max_edit_images`.
            image, strength: image-to-image (``FluxImg2ImgPipeline``; not Kontext): an init image (PIL image, path or
                uint8 ``[H, W, 3]`` array), resized with Lanczos to ``width x height`` (default: its own size cut to a
                multiple of 16), and how much of the schedule to run, in ``[0, 1]`` (default 0.6): the image is
                noised to ``sigmas[t_start]``, ``t_start = int(steps - min(steps * strength, steps))``.
            noise: the initial noise, float32 ``[B, C, h, w]`` (parity tests), instead of the seeded draw (and then
                the init image's latents are the VAE posterior's mode, not a sample).
            callback: :data:`~mlx_engine.imagegen.pipeline.StepCallback`.
            true_cfg: diffusers' ``true_cfg_scale``: above 1 with a negative prompt, two passes per step.
            max_sequence_length: T5 tokens (1..512; default 512).
            sigmas: custom sigmas (default ``linspace(1, 1/steps, steps)``).
            vae_tiling: decode in tiles (True), at once (False), or above :attr:`tile_above_pixels` (None).

        Returns:
            :class:`~mlx_engine.imagegen.pipeline.ImageResult`.

        Raises:
            InvalidRequestError: a bad size, step count, guidance, sequence length, noise shape, edit image or init
                image; edit images given to a pipeline that takes none (or more than it takes); an init image given to
                Kontext, or with edit images; a strength outside ``[0, 1]``, without an init image, or leaving no
                step.
        """
        job = self.prepare(prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
                           guidance=guidance, seed=seed, edit_images=edit_images, image=image, strength=strength,
                           noise=noise, true_cfg=true_cfg, max_sequence_length=max_sequence_length, sigmas=sigmas,
                           vae_tiling=vae_tiling)
        try:
            for k, latents in enumerate(self.denoise(job)):
                if callback is not None:
                    callback(k, job.total, latents, job.stats.denoise_seconds)
            return self.decode(job)
        finally:
            job.close()

    __call__ = generate

    def _edit_inputs(self, edit_images: Sequence[Any] | None) -> list[np.ndarray]:
        """The edit images as float32 ``[1, H, W, 3]`` in ``[-1, 1]`` (Kontext's preprocessing)."""
        if edit_images is None:
            return []
        if isinstance(edit_images, (str, os.PathLike, np.ndarray)) or hasattr(edit_images, "convert"):
            edit_images = [edit_images]
        edit_images = list(edit_images)
        if len(edit_images) > self.max_edit_images:
            if not self.max_edit_images:
                raise InvalidRequestError(f"{self.name}: this {type(self).__name__} model does not edit images; use "
                                          "a model that does (FLUX.1 Kontext, FLUX.2)")
            raise InvalidRequestError(f"{self.name}: {type(self).__name__} takes at most {self.max_edit_images} edit "
                                      f"image(s), got {len(edit_images)}")
        out = []
        m = self.size_multiple
        for im in edit_images:
            pil = load_init_image(im)
            w = pil.width - pil.width % self.vae_scale_factor  # VaeImageProcessor.get_default_height_width
            h = pil.height - pil.height % self.vae_scale_factor
            if h < m or w < m:
                raise InvalidRequestError(f"an edit image must be at least {m}x{m} pixels, got {pil.width}x"
                                          f"{pil.height}")
            if self.defaults["edit_auto_resize"]:
                aspect = w / h
                _, w, h = min((abs(aspect - rw / rh), rw, rh) for rw, rh in PREFERRED_KONTEXT_RESOLUTIONS)
            w, h = w // m * m, h // m * m
            arr, _, _ = preprocess_init_image(pil, w, h, self.check_size, m)
            out.append(arr)
        return out

    def prepare(self, prompt: "str | Sequence[str]", *, negative_prompt: "str | Sequence[str] | None" = None,
                width: int | None = None, height: int | None = None, steps: int | None = None,
                guidance: float | None = None, seed: int | None = None, edit_images: Sequence[Any] | None = None,
                image: Any = None, strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                true_cfg: float | None = None, max_sequence_length: int | None = None,
                sigmas: Sequence[float] | None = None, vae_tiling: bool | None = None) -> FluxJob:
        """Check the request, set the timesteps, encode the prompts (then free the encoders unless kept), make the
        start latents and the edit images' latents. Arguments as :meth:`generate`.

        Returns:
            a :class:`FluxJob` owning a Context until closed (:meth:`decode` closes it).

        Raises:
            InvalidRequestError: as :meth:`generate`; nothing heavy has run when a check fails.
        """
        from mlx_engine.imagegen.scheduler import calculate_shift, check_steps, retrieve_img2img_start

        if self._closed:
            raise InvalidRequestError("the image pipeline is closed")
        started = time.perf_counter()
        d = self.defaults
        if image is None and strength is not None:
            raise InvalidRequestError("strength applies to image-to-image: give an init image (image=...)")
        if image is not None and not self.image_to_image:
            raise InvalidRequestError(f"{type(self).__name__} does not do image-to-image (image=, strength=); give "
                                      "the image to edit as edit_images=")
        if image is not None and edit_images:
            raise InvalidRequestError("give an init image (image=) or images to edit (edit_images=), not both")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else []
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError(f"the prompt must be a string (or a list of strings), got {prompt!r}")
        batch = len(prompts)
        steps = check_steps(d["steps"] if steps is None else steps)
        guidance = d["guidance"] if guidance is None else guidance
        true_cfg = d["true_cfg"] if true_cfg is None else true_cfg
        for name, v in (("guidance", guidance), ("true_cfg", true_cfg)):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v < 0:
                raise InvalidRequestError(f"{name} must be a number >= 0, got {v!r}")
        guidance, true_cfg = float(guidance), float(true_cfg)
        max_len = d["max_sequence_length"] if max_sequence_length is None else max_sequence_length
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= MAX_T5_TOKENS:
            raise InvalidRequestError(f"max_sequence_length must be an integer in 1..{MAX_T5_TOKENS}, got {max_len!r}")
        max_len = int(max_len)
        negative_prompt = d["negative_prompt"] if negative_prompt is None else negative_prompt
        do_true_cfg = true_cfg > 1 and negative_prompt is not None  # diffusers: true_cfg_scale > 1 and has_neg_prompt
        negs = []
        if do_true_cfg:
            negs = [negative_prompt] * batch if isinstance(negative_prompt, str) else list(negative_prompt)
            if len(negs) != batch or not all(isinstance(p, str) for p in negs):
                raise InvalidRequestError(f"give one negative prompt (a string) per prompt: {batch} prompt(s), "
                                          f"negative_prompt={negative_prompt!r}")

        edits = self._edit_inputs(edit_images)
        init = None
        if image is not None:
            strength = d["strength"] if strength is None else strength
            if (isinstance(strength, bool) or not isinstance(strength, (int, float, np.number))
                    or not 0.0 <= strength <= 1.0):
                raise InvalidRequestError(f"strength must be a number in [0, 1], got {strength!r}")
            strength = float(strength)
            init, width, height = preprocess_init_image(image, width, height, self.check_size, self.size_multiple)
        if width is None and height is None and edits:
            height, width = edits[0].shape[1:3]
        width = d["width"] if width is None else width
        height = d["height"] if height is None else height
        width, height = self.check_size(width, height)

        channels = int(self.transformer_config.get("in_channels", 64)) // 4
        lh = 2 * (height // (self.vae_scale_factor * 2))
        lw = 2 * (width // (self.vae_scale_factor * 2))
        shape = (batch, channels, lh, lw)
        if noise is not None:
            if tuple(noise.shape) != shape:
                raise InvalidRequestError(f"noise has shape {tuple(noise.shape)}; this request needs {shape}")
        elif seed is None:
            seed = secrets.randbelow(2 ** 32)
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
            raise InvalidRequestError(f"seed must be an integer in 0 .. 2**64 - 1, got {seed!r}")
        else:
            seed = int(seed)

        cfg = self.scheduler.config
        mu = calculate_shift((lh // 2) * (lw // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sig = list(sigmas) if sigmas is not None else list(np.linspace(1.0, 1 / steps, steps))
        self.scheduler.set_timesteps(steps, mu=mu, sigmas=sig)
        steps = self.scheduler.num_inference_steps
        first = 0
        if init is not None:  # FluxImg2ImgPipeline.get_timesteps
            first = retrieve_img2img_start(steps, strength)
            if steps - first < 1:
                raise InvalidRequestError(
                    f"strength {strength} with {steps} steps leaves no denoising step; give a strength above 0")

        backend = self.backend
        backend.reset_peak_memory()
        stats = ImageGenerationStats(seed=None if noise is not None else seed, width=width, height=height,
                                     steps=steps, steps_run=steps - first, guidance=guidance, strength=strength)
        parameters = {"prompt": prompt, "negative_prompt": negative_prompt if do_true_cfg else None,
                      "seed": stats.seed, "steps": steps, "guidance": guidance, "width": width, "height": height,
                      "strength": strength, "true_cfg": true_cfg if do_true_cfg else None,
                      "max_sequence_length": max_len}

        t0 = time.perf_counter()
        try:
            feats, pooled = self.encode_prompt(prompts + negs, max_len)
        finally:
            if not self.keep_text_encoder:
                self.free_text_encoder()
        stats.text_seconds = time.perf_counter() - t0

        ctx = backend.new_context()
        try:
            if noise is not None:
                latents = noise.astype(DType.FLOAT32) if isinstance(noise, Tensor) else \
                    ctx.from_numpy(np.asarray(noise, dtype=np.float32))
            else:
                latents = ctx.random_normal(shape, DType.FLOAT32, ctx.random_key(seed))
            if init is not None:
                # FluxImg2ImgPipeline.prepare_latents: a posterior sample (a key split from the seed's) noised to
                # sigmas[first]; given noise (parity tests) takes the posterior's mode
                sample_key = None if noise is not None else ctx.split_key(ctx.random_key(seed))[1]
                lat = self._encode_image(ctx, init, sample_key)
                if batch > 1:
                    lat = ctx.concatenate([lat] * batch, axis=0)
                latents = self.scheduler.scale_noise(lat, first, latents)
            ids = [latent_image_ids(lh // 2, lw // 2)]
            packed_edits = []
            for arr in edits:
                lat = self._encode_image(ctx, arr)  # [1, C, eh, ew]
                packed_edits.append(pack_latents(lat))
                ids.append(latent_image_ids(lat.shape[2] // 2, lat.shape[3] // 2, first=1))
            edit_latents = None
            if packed_edits:
                edit_latents = ctx.concatenate(packed_edits, axis=1) if len(packed_edits) > 1 else packed_edits[0]
                if batch > 1:
                    edit_latents = ctx.concatenate([edit_latents] * batch, axis=0)
            txt_ids = np.zeros((max_len, 3), np.float32)
            rope = self.transformer.rope(ctx, txt_ids, np.concatenate(ids, axis=0))
            ctx.evaluate(latents, *([edit_latents] if edit_latents is not None else []))
        except BaseException:
            ctx.close()
            raise
        return FluxJob(ctx=ctx, batch=batch, channels=channels, lh=lh, lw=lw, width=width, height=height,
                       steps=steps, first=first, guidance=guidance, do_cfg=do_true_cfg, cfg_normalization=False,
                       cfg_truncation=None, vae_tiling=vae_tiling,
                       pos_embeds=[feats[:batch], pooled[:batch]],
                       neg_embeds=[feats[batch:], pooled[batch:]] if do_true_cfg else [], latents=latents,
                       stats=stats, parameters=parameters, started=started, rope=rope, edit_latents=edit_latents,
                       true_cfg=true_cfg)

    def _encode_image(self, ctx: Context, image: np.ndarray, sample_key: Any = None) -> Tensor:
        """``_encode_vae_image`` (Kontext's, and image-to-image's): ``(z - shift_factor) * scaling_factor``, float32
        ``[1, C, h, w]``, with ``z`` the VAE posterior's mode, or a sample drawn with ``sample_key``."""
        x = ctx.from_numpy(image, DType.FLOAT32)
        dtype = self.vae.dtype
        mean = self.vae.encode(ctx, x if dtype == DType.FLOAT32 else x.astype(dtype),
                               sample_key=sample_key).astype(DType.FLOAT32)
        lat = (mean - float(self.vae.shift_factor)) * float(self.vae.scaling_factor)
        return lat.transpose(0, 3, 1, 2)

    def denoise(self, job: FluxJob) -> Iterator[Tensor]:
        """Run the loop of a prepared job, yielding the evaluated float32 ``[B, C, h, w]`` latents after each step
        (also in ``job.latents``; ``job.stats`` holds each step's time)."""
        ctx, stats = job.ctx, job.stats
        timesteps = self.scheduler.timesteps
        n = (job.lh // 2) * (job.lw // 2)
        embeds = self.transformer.config.guidance_embeds
        guidance = np.full((job.batch,), job.guidance, np.float32) if embeds else None
        t_loop = time.perf_counter()
        for i in range(job.first, job.steps):
            t_step = time.perf_counter()
            # diffusers: timestep = t.expand(B).to(latents.dtype); transformer(timestep=timestep / 1000)
            t_in = np.full((job.batch,), np.float32(timesteps[i]) / np.float32(1000.0), np.float32)
            x = pack_latents(job.latents)
            if job.edit_latents is not None:
                x = ctx.concatenate([x, job.edit_latents], axis=1)

            def velocity(feats: Tensor, pooled: Tensor) -> Tensor:
                out = self.transformer(ctx, x, t_in, pooled, feats, job.rope, guidance)
                return out[:, :n].astype(DType.FLOAT32)

            v = velocity(*job.pos_embeds)
            if job.do_cfg:
                neg = velocity(*job.neg_embeds)
                v = neg + (v - neg) * job.true_cfg
            job.latents = self.scheduler.step(unpack_latents(v, job.lh, job.lw), i, job.latents)
            ctx.evaluate(job.latents)
            now = time.perf_counter()
            stats.step_seconds.append(now - t_step)
            stats.denoise_seconds = now - t_loop
            yield job.latents

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.folder)!r}, quantize={self.quantize})"


class FluxKontextPipeline(FluxPipeline):
    """FLUX.1 Kontext (``FluxKontextPipeline``): :class:`FluxPipeline` plus one edit image, whose latents join the
    sequence with position ids ``(1, row, col)``; without one it makes an image from the prompt alone."""

    CLASSES = KONTEXT_CLASSES
    max_edit_images = 1
    image_to_image = False
