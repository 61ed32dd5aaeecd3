"""The Z-Image text-to-image (and image-to-image) pipeline, as diffusers' ``ZImagePipeline`` and
``ZImageImg2ImgPipeline``.

Sources: diffusers 0.42 ``pipelines/z_image/pipeline_z_image.py`` (``__call__``, ``encode_prompt``,
``prepare_latents``) and ``pipelines/z_image/pipeline_z_image_img2img.py`` (``get_timesteps``, ``prepare_latents``),
``image_processor.py`` (``VaeImageProcessor``: pre- and post-processing). The steps, as there, in three methods
(the shape of the FLUX sampler in mlx-examples: :meth:`ZImagePipeline.prepare`, the generator
:meth:`ZImagePipeline.denoise` that yields after each step, :meth:`ZImagePipeline.decode`)::

    prompt (+ negative prompt when guidance > 0) -> text encoder -> hidden states [L_i, D] of the unpadded tokens
    seed -> noise latents [B, C, h, w] (h = 2 * (height // (vae_scale * 2)))       (image-to-image: VAE-encode the
                                                                                     init image, noise it to sigma
                                                                                     of the first step)
    mu = calculate_shift(image tokens); sigmas = linspace(1, 1/n, n) -> scheduler.set_timesteps(sigmas, mu)
    per step i:  t_in = (1000 - t_i) / 1000
                 v = transformer([latents], t_in, [prompt]) (and for the negative prompt: pos + g * (pos - neg),
                     optionally renormalized to the norm of pos; guidance off once t_in > cfg_truncation)
                 latents = scheduler.step(-v, i, latents)
    latents / scaling_factor + shift_factor -> VAE decode (tiled above a size) -> [0, 1] -> uint8 -> PIL

Latents are kept in diffusers' layout ``[B, C, h, w]`` (float32, as diffusers keeps them); the transformer takes
``[C, 1, h, w]`` per image, the VAE takes channels-last ``[B, h, w, C]``.

Guidance (diffusers' Z-Image convention): ``guidance`` is its ``guidance_scale``; above 0 the transformer runs on the
prompt and the negative prompt (``""`` when none), combined as ``pos + guidance * (pos - neg)`` (classifier-free
guidance with ``w = 1 + g``, Ho & Salimans 2022); 0 turns it off (one pass per step, Z-Image-Turbo's setting).

Memory: the text encoder is loaded for each generation and closed before denoising (unless ``keep_text_encoder``);
the VAE decodes images above :attr:`ZImagePipeline.tile_above_pixels` in overlapping tiles; the generation's peak is in
:class:`ImageGenerationStats`. The caller gives a backend factory (``make_backend(folder) -> Backend``).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.imagegen.pipeline import (MAX_SIDE, DenoiseJob, ImageGenerationStats, ImageResult, StepCallback,
                                          check_image_size, component_folder, guide, preprocess_init_image,
                                          read_defaults, read_json, read_pipeline_index, store_component)
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["ZImagePipeline", "PIPELINE_CLASSES", "COMPONENTS"]

#: ``_class_name`` values of ``model_index.json`` this pipeline loads.
PIPELINE_CLASSES = ("ZImagePipeline", "ZImageImg2ImgPipeline")
#: the component folders a Z-Image diffusers folder holds.
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
#: Z-Image-Turbo's recommended settings (9 steps, i.e. 8 transformer evaluations that matter; no guidance).
BUILTIN_DEFAULTS = {"steps": 9, "guidance": 0.0, "strength": 0.6, "negative_prompt": None}
SEQ_MULTIPLE = 32  # diffusers transformer_z_image.py SEQ_MULTI_OF: caption tokens are padded to a multiple of it


class ZImagePipeline:
    """A Z-Image diffusers folder, loaded for generation.

    Args:
        folder: the diffusers folder: ``model_index.json`` and the folders ``transformer/``, ``vae/``,
            ``text_encoder/``, ``tokenizer/``, ``scheduler/`` (weights as safetensors, sharded with an index or not).
        make_backend: ``make_backend(component_folder, transform=None) -> Backend`` (``MLXBackend``), called for
            ``transformer/`` and ``vae/`` here and ``text_encoder/`` at each generation; ``transform(name, tensor)``
            quantizes each tensor as it is read (:func:`~mlx_engine.imagegen.quantize.transformer_backend`).
        quantize: quantize the transformer's linear weights, and the folder's text encoder's, to 8 or 4 bits as they
            are read (None: keep them; a store text model runs as pulled).
        keep_text_encoder: keep the text encoder loaded between generations (faster repeated prompts, more memory;
            default: loaded for each generation, freed before denoising).
        resolve_model: ``resolve_model(name) -> path`` of a store model, for a text encoder that ``model_index.json``
            names ``["mlx_engine", "store:NAME"]`` (our small models share one); its GGUF's metadata has the tokenizer.
        memory_check: a backend without weights (``make_backend``'s device and dtype): the load is refused before
            any weight is read when :func:`~mlx_engine.imagegen.memory.check_pipeline_memory` finds it cannot fit.

    Attributes:
        transformer, vae, scheduler: the loaded components. vae_scale_factor: pixels per latent (8 for the FLUX VAE);
        width and height must be multiples of ``size_multiple`` (``vae_scale_factor * patch_size``, 16).
        min_side, max_side: the accepted range of width and height in pixels.
        defaults: the default settings (width, height, steps, guidance, strength, negative_prompt).
        tile_above_pixels: the VAE decodes in tiles (``vae_tile`` latent pixels a side, ``vae_tile_overlap`` of
            overlap: 64 and 16, diffusers' for FLUX) when ``width * height`` is larger (default 1024 * 1024).

    Raises:
        ModelNotFoundError: ``folder`` does not exist or is not a diffusers folder (no ``model_index.json``).
        WeightsError: a component folder, config or weights file is missing, truncated or corrupt (named).
        UnsupportedError: another pipeline class, or a component this engine does not implement.
        InvalidRequestError: ``quantize`` other than None, 4 or 8.
        MemoryBudgetError: ``memory_check`` is given and the model cannot fit (both numbers and what would fit).

    A subclass (another diffusers family) sets the class attributes below and overrides the hooks ``_set_geometry``,
    ``_default_side``, ``_load_transformer``, ``_load_vae``, ``_text_encoder_options`` and the steps.
    """

    #: the ``_class_name`` values of ``model_index.json`` this class loads, and the family's name in messages.
    pipeline_classes: tuple[str, ...] = PIPELINE_CLASSES
    family = "Z-Image"
    #: the diffusers class each component must be (when ``model_index.json`` names one).
    component_classes = {"transformer": "ZImageTransformer2DModel", "vae": "AutoencoderKL",
                         "scheduler": "FlowMatchEulerDiscreteScheduler"}
    #: the model's recommended settings (``width`` and ``height`` come from :meth:`_default_side`).
    builtin_defaults = BUILTIN_DEFAULTS

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
        self._resolve_model = resolve_model
        #: the name results record as the model (``mlx_engine.load_image_model`` sets the catalog name or path)
        self.name = str(self.folder)
        #: the store model that is the text encoder and tokenizer (``model_index.json``: ``["mlx_engine",
        #: "store:NAME"]``), or None when the folder holds ``text_encoder/`` and ``tokenizer/``
        self.text_model = store_component(self.model_index.get("text_encoder"))
        configs = {name: self._component_config(name) for name in ("transformer", "vae")}
        if self.text_model is None:
            configs["text_encoder"] = self._component_config("text_encoder")
            self._check_tokenizer()
        elif resolve_model is None:
            raise UnsupportedError(f"{self.folder}: the text encoder is the store model {self.text_model!r}; "
                                   "load this folder with mlx_engine.load_image_model (which resolves it)")
        self.scheduler = FlowMatchEulerScheduler.from_folder(self.folder / "scheduler")
        self.transformer_config = configs["transformer"]
        self.vae_config = configs["vae"]
        self._backends: list[Backend] = []
        self._text_encoder = None
        self._text_backend: Backend | None = None
        self._closed = False
        self._set_geometry()
        self.defaults = self._read_defaults()
        #: the bytes the model needs (:mod:`mlx_engine.imagegen.memory`), when the load was checked
        self.memory_estimate = check_pipeline_memory(self, memory_check)

        try:
            self.transformer = self._load_transformer()
            self.vae = self._load_vae()
            if keep_text_encoder:
                self._load_text_encoder()
        except BaseException:
            self.close()
            raise

    # ---- loading ------------------------------------------------------------------------------------------------
    def _set_geometry(self) -> None:
        """The sizes the model takes: ``vae_scale_factor``, ``patch_size``, ``size_multiple``, ``min_side``,
        ``max_width`` / ``max_height`` / ``max_side``, ``max_sequence_length``, and the VAE tiling settings."""
        blocks = self.vae_config.get("block_out_channels") or [0, 0, 0, 0]
        self.vae_scale_factor = 2 ** (len(blocks) - 1)  # diffusers ZImagePipeline.__init__
        patch = self.transformer_config.get("all_patch_size") or [2]
        self.patch_size = int(patch[0]) if isinstance(patch, (list, tuple)) else int(patch)
        self.size_multiple = self.vae_scale_factor * self.patch_size
        axes_lens = self.transformer_config.get("axes_lens") or [1024, 512, 512]
        self.min_side = self.size_multiple * 2
        self.max_height = min(MAX_SIDE, int(axes_lens[1]) * self.size_multiple)
        self.max_width = min(MAX_SIDE, int(axes_lens[2]) * self.size_multiple)
        self.max_side = min(self.max_height, self.max_width)
        # caption positions run 1 .. padded length, the image frame sits one past them: keep it in the RoPE table
        self.max_sequence_length = max(SEQ_MULTIPLE, min(512, (int(axes_lens[0]) - 2) // SEQ_MULTIPLE * SEQ_MULTIPLE))
        self.tile_above_pixels = 1024 * 1024
        self.vae_tile, self.vae_tile_overlap = 64, 16  # latent pixels (512-pixel tiles, 128-pixel blends)

    def _read_model_index(self) -> dict:
        return read_pipeline_index(self.folder, self.pipeline_classes, self.family, COMPONENTS,
                                   self.component_classes)

    def _component_folder(self, name: str) -> Path:
        return component_folder(self.folder, name)

    def _component_config(self, name: str) -> dict:
        return read_json(self._component_folder(name) / "config.json", f"the {name} config")

    def _check_tokenizer(self) -> None:
        p = self._component_folder("tokenizer")
        if not (p / "tokenizer.json").is_file():
            raise WeightsError(f"{p}: no tokenizer.json in the tokenizer folder")

    @classmethod
    def memory_layout(cls):
        """What the load holds (:class:`~mlx_engine.imagegen.memory.MemoryLayout`) for the memory estimate."""
        from mlx_engine.imagegen.memory import MemoryLayout
        from mlx_engine.imagegen.quantize import TEXT_MODEL_FLOAT
        from mlx_engine.imagegen.transformer import ZImageTransformer

        return MemoryLayout(float_prefixes=ZImageTransformer.FLOAT_PREFIXES,
                            text_float={"text_encoder": TEXT_MODEL_FLOAT})

    def _default_side(self) -> int:
        """The default width and height (pixels) before clamping to the model's range."""
        return int(self.vae_config.get("sample_size") or 1024)  # the FLUX VAE says 1024; small models say less

    def _read_defaults(self) -> dict[str, Any]:
        side = self._default_side()
        side = max(self.min_side, min(self.max_side, side - side % self.size_multiple))
        return read_defaults(self.folder, {**self.builtin_defaults, "width": side, "height": side})

    def _backend(self, name: str) -> Backend:
        return self._make_backend(self._component_folder(name))

    def _load_transformer(self):
        from mlx_engine.imagegen.quantize import transformer_backend
        from mlx_engine.imagegen.transformer import ZImageTransformer

        backend = transformer_backend(self._make_backend, self._component_folder("transformer"), self.quantize,
                                      ZImageTransformer.FLOAT_PREFIXES)
        self._backends.append(backend)
        try:
            return ZImageTransformer.from_backend(backend, quantize_bits=self.quantize)
        except KeyError as e:
            raise WeightsError(f"{self.folder / 'transformer'}: missing tensor {e}") from None

    def _load_vae(self):
        from mlx_engine.imagegen.vae import AutoencoderKL

        backend = self._backend("vae")
        self._backends.append(backend)
        try:
            vae = AutoencoderKL.from_backend(backend)
        except KeyError as e:
            raise WeightsError(f"{self.folder / 'vae'}: missing tensor {e}") from None
        backend.close()  # the VAE holds its own (channels-last) copies of the weights; drop the originals
        return vae

    def _load_text_encoder(self):
        from mlx_engine.imagegen.quantize import TEXT_MODEL_FLOAT, quantizing
        from mlx_engine.imagegen.text_encoder import TextEncoder
        from mlx_engine.models.registry import load_text_checkpoint

        if self._text_encoder is not None:
            return self._text_encoder
        # --quantize quantizes the folder's text encoder as it is read; a store model runs as it was pulled
        make_backend = self._make_backend
        if self.text_model is not None:  # a store model (a GGUF file): its tokenizer is in its metadata
            path, tokenizer_folder = self._resolve_model(self.text_model), None
        else:
            path, tokenizer_folder = self._component_folder("text_encoder"), self._component_folder("tokenizer")
            make_backend = quantizing(make_backend, self.quantize, TEXT_MODEL_FLOAT)
        try:
            text = load_text_checkpoint(path, make_backend, tokenizer_folder=tokenizer_folder)
        except KeyError as e:
            raise WeightsError(f"{self.folder / 'text_encoder'}: missing tensor {e}") from None
        self._text_encoder = TextEncoder(text.model, text.tokenizer, text.backend, **self._text_encoder_options())
        self._text_backend = text.backend
        return self._text_encoder

    def _text_encoder_options(self) -> dict[str, Any]:
        """Keyword options of :class:`~mlx_engine.imagegen.text_encoder.TextEncoder` (Z-Image: its defaults)."""
        return {}

    def free_text_encoder(self) -> None:
        """Close the text encoder and drop its weights (it is loaded again by the next generation)."""
        te, backend = self._text_encoder, self._text_backend
        self._text_encoder = self._text_backend = None
        if te is not None:
            te.close()
        if backend is not None:
            backend.close()
            backend.clear_cache()

    @property
    def backend(self) -> Backend:
        """The transformer's backend (device name, memory controls)."""
        if not self._backends:
            raise InvalidRequestError("the image pipeline is closed")
        return self._backends[0]

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def memory(self) -> tuple[int, int]:
        """``(active, peak)`` bytes of device memory now (the peak since the current generation began)."""
        b = self.backend
        return b.active_memory(), b.peak_memory()

    def close(self) -> None:
        """Drop every component's weights."""
        self.free_text_encoder()
        for b in self._backends:
            b.close()
        self._backends = []
        self._closed = True

    def __enter__(self) -> "ZImagePipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- checks -------------------------------------------------------------------------------------------------
    def check_size(self, width: Any, height: Any) -> tuple[int, int]:
        """``(width, height)`` as ints when the model can make that size (see
        :func:`~mlx_engine.imagegen.pipeline.check_image_size`)."""
        return check_image_size(width, height, multiple=self.size_multiple, min_side=self.min_side,
                                max_width=self.max_width, max_height=self.max_height)

    # ---- the steps ----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompts: Sequence[str], max_sequence_length: int) -> list[Tensor]:
        """Hidden states ``[L_i, D]`` (compute dtype) of each prompt's unpadded tokens, chat template applied
        (diffusers ``ZImagePipeline._encode_prompt``; the text encoder's business)."""
        te = self._load_text_encoder()
        with self._text_backend.new_context() as ctx:
            embeds = te.encode(ctx, list(prompts), max_sequence_length=max_sequence_length)
            ctx.evaluate(*embeds)
        return embeds

    def generate(self, prompt: "str | Sequence[str]", *, negative_prompt: "str | Sequence[str] | None" = None,
                 width: int | None = None, height: int | None = None, steps: int | None = None,
                 guidance: float | None = None, seed: int | None = None, image: Any = None,
                 strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                 callback: StepCallback | None = None, cfg_normalization: "bool | float" = False,
                 cfg_truncation: float | None = 1.0, max_sequence_length: int | None = None,
                 sigmas: Sequence[float] | None = None, vae_tiling: bool | None = None) -> ImageResult:
        """Generate images: :meth:`prepare`, every step of :meth:`denoise` (``callback`` after each), :meth:`decode`.

        Args:
            prompt: the text (an empty string is allowed: unconditional), or a list of texts (one image each).
            negative_prompt: what the guidance steers away from (used only when ``guidance > 0``; default ``""``).
            width, height: pixels, multiples of :attr:`size_multiple` in ``min_side .. max_side`` (default: the
                model's, :attr:`defaults`; for image-to-image, the init image's size rounded down to a multiple).
            steps: the scheduler's denoising steps (>= 1).
            guidance: diffusers' Z-Image ``guidance_scale`` (>= 0; 0 = off; see the module docstring).
            seed: the seed of the noise (``Context.random_normal`` with ``Context.random_key(seed)``, one draw of
                ``[B, C, h, w]``); None draws a random seed, reported in the stats and parameters.
            image: an init image for image-to-image (PIL image, file path, or uint8 ``[H, W, 3]`` array).
            strength: image-to-image: how much of the schedule to run, in ``[0, 1]``; the init image is noised to
                ``sigmas[t_start]`` with ``t_start = int(steps - min(steps * strength, steps))``.
            noise: the initial noise, float32 ``[B, C, h, w]`` (for parity tests), instead of the seeded draw.
            callback: :data:`~mlx_engine.imagegen.pipeline.StepCallback`, after each step.
            cfg_normalization: diffusers' option: when truthy, rescale the guided prediction so its norm is at most
                ``float(cfg_normalization)`` times the norm of the prompt's prediction.
            cfg_truncation: diffusers' option: guidance is off for steps whose ``(1000 - t) / 1000`` exceeds it
                (only when it is <= 1; 1.0, the default, keeps it everywhere).
            max_sequence_length: the text encoder's token limit (default 512, capped by the transformer's RoPE table).
            sigmas: custom sigmas (default diffusers' Z-Image ``linspace(1, 1/steps, steps)``).
            vae_tiling: decode in tiles (True), at once (False), or above :attr:`tile_above_pixels` (None).

        Returns:
            :class:`~mlx_engine.imagegen.pipeline.ImageResult`.

        Raises:
            InvalidRequestError: an unsupported size, fewer than one step (also after ``strength``), a negative
                guidance, a strength outside ``[0, 1]``, noise of the wrong shape, an unreadable init image.
        """
        job = self.prepare(prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
                           guidance=guidance, seed=seed, image=image, strength=strength, noise=noise,
                           cfg_normalization=cfg_normalization, cfg_truncation=cfg_truncation,
                           max_sequence_length=max_sequence_length, sigmas=sigmas, vae_tiling=vae_tiling)
        try:
            for k, latents in enumerate(self.denoise(job)):
                if callback is not None:
                    callback(k, job.total, latents, job.stats.denoise_seconds)
            return self.decode(job)
        finally:
            job.close()

    __call__ = generate

    def prepare(self, prompt: "str | Sequence[str]", *, negative_prompt: "str | Sequence[str] | None" = None,
                width: int | None = None, height: int | None = None, steps: int | None = None,
                guidance: float | None = None, seed: int | None = None, image: Any = None,
                strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                cfg_normalization: "bool | float" = False, cfg_truncation: float | None = 1.0,
                max_sequence_length: int | None = None, sigmas: Sequence[float] | None = None,
                vae_tiling: bool | None = None) -> DenoiseJob:
        """Check the request, set the scheduler's timesteps, encode the prompts (freeing the text encoder unless it is
        kept) and make the start latents (noise, or the noised init image). Arguments as :meth:`generate`.

        Returns:
            a :class:`DenoiseJob` that owns a Context until it is closed (:meth:`decode` and :meth:`generate` close
            it; a caller that stops early calls ``job.close()``).

        Raises:
            InvalidRequestError: as :meth:`generate`; nothing heavy has run when a check fails.
        """
        from mlx_engine.imagegen.scheduler import calculate_shift, retrieve_img2img_start, z_image_default_sigmas

        if self._closed:
            raise InvalidRequestError("the image pipeline is closed")
        started = time.perf_counter()
        d = self.defaults
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else []
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError(f"the prompt must be a string (or a list of strings), got {prompt!r}")
        batch = len(prompts)
        steps = d["steps"] if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise InvalidRequestError(f"steps must be an integer of at least 1, got {steps!r}")
        steps = int(steps)
        guidance = d["guidance"] if guidance is None else guidance
        if (isinstance(guidance, bool) or not isinstance(guidance, (int, float, np.number))
                or not math.isfinite(guidance) or guidance < 0):
            raise InvalidRequestError(f"guidance must be a number >= 0 (0 turns it off), got {guidance!r}")
        guidance = float(guidance)
        if negative_prompt is None:
            negative_prompt = d.get("negative_prompt")
        max_len = self.max_sequence_length if max_sequence_length is None else int(max_sequence_length)
        if not 1 <= max_len <= self.max_sequence_length:
            raise InvalidRequestError(f"max_sequence_length must be in 1..{self.max_sequence_length}, got {max_len}")

        init = None
        if image is not None:
            strength = d["strength"] if strength is None else strength
            if (isinstance(strength, bool) or not isinstance(strength, (int, float, np.number))
                    or not 0.0 <= strength <= 1.0):
                raise InvalidRequestError(f"strength must be a number in [0, 1], got {strength!r}")
            strength = float(strength)
            init, width, height = preprocess_init_image(image, width, height, self.check_size, self.size_multiple)
        else:
            if strength is not None:
                raise InvalidRequestError("strength applies to image-to-image: give an init image (image=...)")
            width = d["width"] if width is None else width
            height = d["height"] if height is None else height
        width, height = self.check_size(width, height)

        do_cfg = guidance > 0  # diffusers: do_classifier_free_guidance = guidance_scale > 0
        if do_cfg:
            negs = [""] * batch if negative_prompt is None else (
                [negative_prompt] if isinstance(negative_prompt, str) else list(negative_prompt))
            if len(negs) != batch or not all(isinstance(p, str) for p in negs):
                raise InvalidRequestError(f"give one negative prompt (a string) per prompt: {batch} prompt(s), "
                                          f"negative_prompt={negative_prompt!r}")
        else:
            negs = []

        channels = int(self.transformer_config.get("in_channels", 16))
        lh = 2 * (height // (self.vae_scale_factor * 2))  # diffusers prepare_latents
        lw = 2 * (width // (self.vae_scale_factor * 2))
        shape = (batch, channels, lh, lw)
        if noise is not None:
            got = tuple(noise.shape)
            if got != shape:
                raise InvalidRequestError(f"noise has shape {got}; this request needs {shape} ([B, C, h, w])")
        elif seed is None:
            seed = secrets.randbelow(2 ** 32)
        else:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
                raise InvalidRequestError(f"seed must be an integer in 0 .. 2**64 - 1, got {seed!r}")
            seed = int(seed)

        # timesteps (before any heavy work, so a bad strength fails fast)
        image_seq_len = (lh // 2) * (lw // 2)
        cfg = self.scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sig = list(sigmas) if sigmas is not None else z_image_default_sigmas(steps)
        self.scheduler.set_timesteps(steps, mu=mu, sigmas=sig)
        steps = self.scheduler.num_inference_steps
        first = 0
        if init is not None:
            first = retrieve_img2img_start(steps, strength)
            if steps - first < 1:
                raise InvalidRequestError(
                    f"strength {strength} with {steps} steps leaves no denoising step; give a strength above 0")

        backend = self.backend
        backend.reset_peak_memory()
        stats = ImageGenerationStats(seed=None if noise is not None else seed, width=width, height=height,
                                     steps=steps, steps_run=steps - first, guidance=guidance, strength=strength)
        parameters = {
            "prompt": prompt, "negative_prompt": negative_prompt if do_cfg else None, "seed": stats.seed,
            "steps": steps, "guidance": guidance, "width": width, "height": height, "strength": strength,
            "cfg_normalization": cfg_normalization, "cfg_truncation": cfg_truncation,
            "max_sequence_length": max_len,
        }

        # 1. text
        t0 = time.perf_counter()
        try:
            embeds = self.encode_prompt(prompts + negs, max_len)
        finally:
            if not self.keep_text_encoder:
                self.free_text_encoder()  # before the denoising loop, as the design asks
        stats.text_seconds = time.perf_counter() - t0

        # 2. latents
        ctx = backend.new_context()
        try:
            if noise is not None:
                noise_t = noise.astype(DType.FLOAT32) if isinstance(noise, Tensor) else \
                    ctx.from_numpy(np.asarray(noise, dtype=np.float32))
            else:
                noise_t = ctx.random_normal(shape, DType.FLOAT32, ctx.random_key(seed))
            if init is not None:
                # diffusers samples the VAE posterior (retrieve_latents, sample_mode="sample"): so do we for a seeded
                # generation (a key split from the seed's); given noise (parity tests) takes the posterior's mode
                sample_key = None if noise is not None else ctx.split_key(ctx.random_key(seed))[1]
                latents = self._encode_init(ctx, init, batch, noise_t, first, sample_key)
            else:
                latents = noise_t
            ctx.evaluate(latents)
        except BaseException:
            ctx.close()
            raise
        return DenoiseJob(ctx=ctx, batch=batch, channels=channels, lh=lh, lw=lw, width=width, height=height,
                         steps=steps, first=first, guidance=guidance, do_cfg=do_cfg,
                         cfg_normalization=cfg_normalization, cfg_truncation=cfg_truncation, vae_tiling=vae_tiling,
                         pos_embeds=embeds[:batch], neg_embeds=embeds[batch:], latents=latents, stats=stats,
                         parameters=parameters, started=started)

    def denoise(self, job: DenoiseJob) -> Iterator[Tensor]:
        """Run the denoising loop of a prepared job, yielding the evaluated float32 ``[B, C, h, w]`` latents after
        each step (also kept in ``job.latents``; ``job.stats`` holds each step's time). Stopping early (closing the
        generator) leaves the job's latents where the last finished step left them."""
        ctx, stats = job.ctx, job.stats
        timesteps = self.scheduler.timesteps
        dtype = self.backend.compute_dtype
        channels, lh, lw, batch = job.channels, job.lh, job.lw, job.batch
        t_loop = time.perf_counter()
        for i in range(job.first, job.steps):
            t_step = time.perf_counter()
            t = np.float32(timesteps[i])
            t_in = np.float32((np.float32(1000.0) - t) / np.float32(1000.0))
            current = job.guidance
            if job.do_cfg and job.cfg_truncation is not None and float(job.cfg_truncation) <= 1:
                if float(t_in) > float(job.cfg_truncation):
                    current = 0.0
            apply_cfg = job.do_cfg and current > 0
            x = job.latents if dtype == DType.FLOAT32 else job.latents.astype(dtype)
            xs = [x[b].reshape(channels, 1, lh, lw) for b in range(batch)]
            caps = list(job.pos_embeds)
            if apply_cfg:
                xs = xs + xs
                caps = caps + list(job.neg_embeds)
            outs = self.transformer(ctx, xs, np.full((len(xs),), t_in, dtype=np.float32), caps)
            preds = []
            for b in range(batch):
                pred = outs[b].astype(DType.FLOAT32)
                if apply_cfg:
                    pred = guide(pred, outs[batch + b].astype(DType.FLOAT32), current, job.cfg_normalization)
                preds.append(pred.reshape(channels, lh, lw))
            job.latents = self.scheduler.step(-ctx.stack(preds, axis=0), i, job.latents)
            ctx.evaluate(job.latents)
            now = time.perf_counter()
            stats.step_seconds.append(now - t_step)
            stats.denoise_seconds = now - t_loop
            yield job.latents

    def decode(self, job: DenoiseJob) -> ImageResult:
        """VAE-decode the job's latents (in tiles above :attr:`tile_above_pixels`, unless ``job.vae_tiling`` says
        otherwise) into 8-bit RGB images, and close the job.

        Returns:
            :class:`~mlx_engine.imagegen.pipeline.ImageResult`.
        """
        stats = job.stats
        try:
            t0 = time.perf_counter()
            latents = job.latents
            lat_np = latents.numpy().astype(np.float32)
            tiled = (job.width * job.height > self.tile_above_pixels) if job.vae_tiling is None \
                else bool(job.vae_tiling)
            z = latents.transpose(0, 2, 3, 1)
            z = z / float(self.vae.scaling_factor) + float(self.vae.shift_factor)
            decoded = (self.vae.decode_tiled(job.ctx, z, tile=self.vae_tile, overlap=self.vae_tile_overlap) if tiled
                       else self.vae.decode(job.ctx, z))
            pixels = decoded.numpy().astype(np.float32)
            stats.decode_seconds = time.perf_counter() - t0
            stats.tiled_decode = tiled
        finally:
            job.close()
        pixels = np.clip(pixels * 0.5 + 0.5, 0.0, 1.0)  # VaeImageProcessor.denormalize
        as_uint8 = (pixels * 255).round().astype(np.uint8)  # VaeImageProcessor.numpy_to_pil
        images = [Image.fromarray(a) for a in as_uint8]
        stats.peak_memory_bytes = self.backend.peak_memory()
        stats.total_seconds = time.perf_counter() - job.started
        return ImageResult(images=images, latents=lat_np, pixels=pixels, stats=stats, parameters=job.parameters)

    def _encode_init(self, ctx: Context, init: np.ndarray, batch: int, noise: Tensor, first: int,
                     sample_key: Any = None) -> Tensor:
        """Image-to-image start latents (diffusers ``ZImageImg2ImgPipeline.prepare_latents``):
        ``(encode(image) - shift_factor) * scaling_factor`` in ``[B, C, h, w]``, noised to ``sigmas[first]``.

        ``sample_key``: draw from the VAE posterior with it (as diffusers' ``latent_dist.sample``), or None for its
        mode (the mean, ``sample_mode="argmax"``)."""
        img = ctx.from_numpy(init, DType.FLOAT32)
        dtype = self.backend.compute_dtype
        x = img if dtype == DType.FLOAT32 else img.astype(dtype)
        mean = self.vae.encode(ctx, x, sample_key=sample_key).astype(DType.FLOAT32)
        lat = (mean - float(self.vae.shift_factor)) * float(self.vae.scaling_factor)
        lat = lat.transpose(0, 3, 1, 2)
        if batch > 1:
            lat = ctx.concatenate([lat] * batch, axis=0)
        return self.scheduler.scale_noise(lat, first, noise)

    def __repr__(self) -> str:
        return (f"ZImagePipeline({str(self.folder)!r}, size_multiple={self.size_multiple}, "
                f"quantize={self.quantize})")


