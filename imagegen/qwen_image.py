"""The Qwen-Image text-to-image pipeline, as diffusers' ``QwenImagePipeline``.

Source: diffusers ``pipelines/qwenimage/pipeline_qwenimage.py`` (``__call__``, ``_get_qwen_prompt_embeds``,
``encode_prompt``, ``prepare_latents``, ``_pack_latents``, ``_unpack_latents``), with ``calculate_shift`` as FLUX's.
The steps, in the prepare / denoise generator / decode shape of :class:`~mlx_engine.imagegen.zimage.ZImagePipeline`
(whose loading, memory and size checks this class shares)::

    prompt (+ negative prompt when guidance > 1) -> Qwen2.5-VL's language model on the prompt template
        -> final-normed hidden states, the template's first 34 tokens dropped -> [L_i, 3584]
    seed -> noise latents [B, 16, h, w] (h = 2 * (height // 16)), packed 2x2 per step -> [B, h/2 * w/2, 64]
    mu = calculate_shift(image tokens); sigmas = linspace(1, 1/n, n) -> scheduler.set_timesteps(sigmas, mu)
    per step i:  v = transformer(packed latents, t_i / 1000, text features, mask)   (the velocity)
                 true CFG: c = neg + g * (pos - neg), rescaled per token to the norm of pos:
                     v = c * ||pos|| / ||c||  (norms over each packed token's 64 features)
                 latents = scheduler.step(v, i, latents)
    latents * latents_std + latents_mean -> VAE decode (one frame; tiled above a size) -> [0, 1] -> uint8 -> PIL

Guidance follows diffusers' ``true_cfg_scale``: ``guidance`` above 1 runs the transformer on the prompt and on the
negative prompt and combines them as above (classifier-free guidance, Ho & Salimans 2022, with the norm rescale of
the Qwen-Image pipeline); 1 or less turns it off (one pass per step). diffusers also needs a negative prompt to turn it
on; here the negative prompt defaults to ``" "`` (the Qwen-Image model card's), so ``guidance`` alone decides.
The text features of one step's prompts are padded to the longest and the padding masked, so the prompt and negative
prompt run as one batch (diffusers runs them as two; attention sees the same keys).

Memory: as Z-Image's (the text encoder is freed before the loop unless kept; the VAE decodes in tiles above
:attr:`~mlx_engine.imagegen.zimage.ZImagePipeline.tile_above_pixels`).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlx_engine.errors import InvalidRequestError
from mlx_engine.imagegen.pipeline import MAX_SIDE, DenoiseJob, ImageGenerationStats, ImageResult, StepCallback
from mlx_engine.imagegen.zimage import ZImagePipeline
from mlx_engine.ml import DType, Tensor

__all__ = ["QwenImagePipeline", "QwenImageJob", "PIPELINE_CLASSES"]

#: ``_class_name`` values of ``model_index.json`` this pipeline loads.
PIPELINE_CLASSES = ("QwenImagePipeline",)
#: diffusers' ``prompt_template_encode`` and ``prompt_template_encode_start_idx``: the system prompt's tokens (34 with
#: Qwen2.5-VL's tokenizer) are dropped from the features.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34
#: diffusers' ``tokenizer_max_length``: the most prompt tokens kept after the template's.
MAX_TEXT_TOKENS = 1024
#: the model card's settings: 50 steps, true_cfg_scale 4, negative prompt " "; 1024 x 1024 (default_sample_size 128).
BUILTIN_DEFAULTS = {"steps": 50, "guidance": 4.0, "strength": None, "negative_prompt": " "}


@dataclass
class QwenImageJob(DenoiseJob):
    """A Qwen-Image generation: a :class:`~mlx_engine.imagegen.pipeline.DenoiseJob` with an edit's conditioning.

    Attributes:
        cond: the packed, normalised latents of an edit's input images ``[B, T, 64]`` (the compute dtype), which
            follow the noisy latents in the transformer's sequence each step (Qwen-Image-Edit), or None.
        cond_shapes: their ``(1, h/2, w/2)`` patch grids, in order (diffusers' ``img_shapes[i][1:]``).
    """

    cond: Tensor | None = None
    cond_shapes: tuple[tuple[int, int, int], ...] = ()


class QwenImagePipeline(ZImagePipeline):
    """A Qwen-Image diffusers folder, loaded for generation.

    Args, attributes and errors as :class:`~mlx_engine.imagegen.zimage.ZImagePipeline`; the folder holds a
    ``QwenImageTransformer2DModel``, an ``AutoencoderKLQwenImage``, a ``Qwen2_5_VLForConditionalGeneration`` text
    encoder with its tokenizer, and a ``FlowMatchEulerDiscreteScheduler``. ``quantize`` (8 or 4 bits) applies to the
    transformer's blocks and the text encoder's language model (its vision tower stays as stored).
    """

    pipeline_classes = PIPELINE_CLASSES
    family = "Qwen-Image"
    component_classes = {"transformer": "QwenImageTransformer2DModel", "vae": "AutoencoderKLQwenImage",
                         "scheduler": "FlowMatchEulerDiscreteScheduler"}
    builtin_defaults = BUILTIN_DEFAULTS

    # ---- loading (the hooks of ZImagePipeline) -------------------------------------------------------------------
    def _set_geometry(self) -> None:
        temporal = self.vae_config.get("temperal_downsample") or [False, True, True]
        self.vae_scale_factor = 2 ** len(temporal)  # diffusers QwenImagePipeline.__init__
        self.patch_size = int(self.transformer_config.get("patch_size") or 2)
        self.size_multiple = self.vae_scale_factor * self.patch_size
        self.min_side = self.size_multiple * 2
        # RoPE angles are computed for any position: only the engine's own limit applies
        self.max_height = self.max_width = self.max_side = MAX_SIDE
        self.max_sequence_length = 512  # diffusers' default; at most MAX_TEXT_TOKENS
        self.tile_above_pixels = 1024 * 1024
        self.vae_tile, self.vae_tile_overlap = 32, 8  # diffusers': 256-pixel tiles every 192 pixels

    @classmethod
    def memory_layout(cls):
        from mlx_engine.imagegen.memory import MemoryLayout
        from mlx_engine.imagegen.quantize import TEXT_MODEL_FLOAT
        from mlx_engine.imagegen.qwen_transformer import QwenImageTransformer

        return MemoryLayout(float_prefixes=QwenImageTransformer.FLOAT_PREFIXES,
                            text_float={"text_encoder": TEXT_MODEL_FLOAT})

    def _default_side(self) -> int:
        return min(self.max_side, 128 * self.vae_scale_factor)  # default_sample_size * vae_scale_factor

    def _load_transformer(self):
        from mlx_engine.imagegen.qwen_transformer import QwenImageTransformer
        from mlx_engine.imagegen.quantize import transformer_backend

        backend = transformer_backend(self._make_backend, self._component_folder("transformer"), self.quantize,
                                      QwenImageTransformer.FLOAT_PREFIXES)
        self._backends.append(backend)
        return QwenImageTransformer.from_backend(backend, quantize_bits=self.quantize)

    def _load_vae(self):
        from mlx_engine.imagegen.qwen_vae import QwenImageVAE

        backend = self._backend("vae")
        self._backends.append(backend)
        vae = QwenImageVAE.from_backend(backend)
        backend.close()  # the VAE holds its own 2D copies of the kernels
        return vae

    def _text_encoder_options(self) -> dict[str, Any]:
        return {"template": PROMPT_TEMPLATE, "drop": TEMPLATE_DROP, "hidden_state": -1}

    # ---- the steps ---------------------------------------------------------------------------------------------
    def generate(self, prompt: "str | Sequence[str]", *, negative_prompt: "str | Sequence[str] | None" = None,
                 width: int | None = None, height: int | None = None, steps: int | None = None,
                 guidance: float | None = None, seed: int | None = None, image: Any = None,
                 strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                 callback: StepCallback | None = None, max_sequence_length: int | None = None,
                 sigmas: Sequence[float] | None = None, vae_tiling: bool | None = None,
                 edit_images: Sequence[Any] | None = None) -> ImageResult:
        """Generate images: :meth:`prepare`, every step of :meth:`denoise` (``callback`` after each), :meth:`decode`.

        Args:
            prompt: the text (an empty string is allowed), or a list of texts (one image each).
            negative_prompt: what true CFG steers away from (used when ``guidance > 1``; default ``" "``).
            width, height: pixels, multiples of :attr:`size_multiple` (16) in ``min_side .. max_side`` (default
                1024, or the folder's ``mlx_engine.json``).
            steps: the scheduler's denoising steps (>= 1; default 50).
            guidance: diffusers' ``true_cfg_scale`` (>= 0; above 1 turns true CFG on; default 4).
            seed: the seed of the noise (one draw of ``[B, 16, h, w]``); None draws a random one, reported.
            image, strength: image-to-image is not offered by this pipeline (an error when given).
            noise: the initial noise, float32 ``[B, 16, h, w]`` (for parity tests), instead of the seeded draw.
            callback: :data:`~mlx_engine.imagegen.pipeline.StepCallback`, after each step.
            max_sequence_length: the most text tokens kept after the template (1..1024; default 512).
            sigmas: custom sigmas (default diffusers' ``np.linspace(1, 1/steps, steps)``).
            vae_tiling: decode in tiles (True), at once (False), or above :attr:`tile_above_pixels` (None).
            edit_images: images to edit, for a pipeline that edits (:attr:`max_edit_images`; this one makes images
                from text and takes none).

        Returns:
            :class:`~mlx_engine.imagegen.pipeline.ImageResult` (``latents`` unpacked, ``[B, 16, h, w]``).

        Raises:
            InvalidRequestError: an unsupported size, fewer than one step, a negative guidance, noise of the wrong
                shape, an init image, a bad ``max_sequence_length``.
        """
        job = self.prepare(prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
                           guidance=guidance, seed=seed, image=image, strength=strength, noise=noise,
                           max_sequence_length=max_sequence_length, sigmas=sigmas, vae_tiling=vae_tiling,
                           edit_images=edit_images)
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
                max_sequence_length: int | None = None, sigmas: Sequence[float] | None = None,
                vae_tiling: bool | None = None, edit_images: Sequence[Any] | None = None) -> QwenImageJob:
        """Check the request, set the timesteps, encode the prompts (freeing the text encoder unless kept) and draw
        the start latents. Arguments as :meth:`generate`.

        Returns:
            a :class:`QwenImageJob` owning a Context until closed.

        Raises:
            InvalidRequestError: as :meth:`generate`; nothing heavy has run when a check fails.
        """
        from mlx_engine.imagegen.scheduler import calculate_shift, check_steps

        if self._closed:
            raise InvalidRequestError("the image pipeline is closed")
        started = time.perf_counter()
        d = self.defaults
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else []
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError(f"the prompt must be a string (or a list of strings), got {prompt!r}")
        batch = len(prompts)
        if image is not None or strength is not None:
            raise InvalidRequestError("Qwen-Image makes images from text: image-to-image (an init image, strength) is "
                                      "not offered by this model")
        steps = check_steps(d["steps"] if steps is None else steps)
        guidance = d["guidance"] if guidance is None else guidance
        if (isinstance(guidance, bool) or not isinstance(guidance, (int, float, np.number))
                or not math.isfinite(guidance) or guidance < 0):
            raise InvalidRequestError(f"guidance must be a number >= 0 (1 or less turns it off), got {guidance!r}")
        guidance = float(guidance)
        if negative_prompt is None:
            negative_prompt = d.get("negative_prompt")
        max_len = self.max_sequence_length if max_sequence_length is None else max_sequence_length
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or \
                not 1 <= max_len <= MAX_TEXT_TOKENS:
            raise InvalidRequestError(f"max_sequence_length must be an integer in 1..{MAX_TEXT_TOKENS}, "
                                      f"got {max_len!r}")
        max_len = int(max_len)
        edits = self._edit_inputs(edit_images)
        default_width, default_height = self._default_size(edits)
        width, height = self.check_size(default_width if width is None else width,
                                        default_height if height is None else height)

        do_cfg = guidance > 1.0 and negative_prompt is not None  # diffusers: true_cfg_scale > 1 and has_neg_prompt
        negs: list[str] = []
        if do_cfg:
            negs = [negative_prompt] * batch if isinstance(negative_prompt, str) else list(negative_prompt)
            if len(negs) != batch or not all(isinstance(p, str) for p in negs):
                raise InvalidRequestError(f"give one negative prompt (a string) per prompt: {batch} prompt(s), "
                                          f"negative_prompt={negative_prompt!r}")

        channels = int(self.transformer_config.get("in_channels", 64)) // 4
        lh = 2 * (height // (self.vae_scale_factor * 2))  # diffusers prepare_latents
        lw = 2 * (width // (self.vae_scale_factor * 2))
        shape = (batch, channels, lh, lw)
        if noise is not None:
            if tuple(noise.shape) != shape:
                raise InvalidRequestError(f"noise has shape {tuple(noise.shape)}; this request needs {shape} "
                                          "([B, C, h, w])")
        elif seed is None:
            seed = secrets.randbelow(2 ** 32)
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
            raise InvalidRequestError(f"seed must be an integer in 0 .. 2**64 - 1, got {seed!r}")
        else:
            seed = int(seed)

        cfg = self.scheduler.config
        mu = calculate_shift((lh // 2) * (lw // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        sig = list(sigmas) if sigmas is not None else [float(s) for s in np.linspace(1.0, 1.0 / steps, steps)]
        self.scheduler.set_timesteps(steps, mu=mu, sigmas=sig)
        steps = self.scheduler.num_inference_steps

        backend = self.backend
        backend.reset_peak_memory()
        stats = ImageGenerationStats(seed=None if noise is not None else seed, width=width, height=height,
                                     steps=steps, steps_run=steps, guidance=guidance)
        parameters = {"prompt": prompt, "negative_prompt": negative_prompt if do_cfg else None, "seed": stats.seed,
                      "steps": steps, "guidance": guidance, "width": width, "height": height, "strength": None,
                      "max_sequence_length": max_len}

        t0 = time.perf_counter()
        try:
            embeds = self._encode(prompts + negs, max_len, edits)
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
            cond, cond_shapes = self._condition(ctx, edits, batch)
            ctx.evaluate(latents, *([cond] if cond is not None else []))
        except BaseException:
            ctx.close()
            raise
        return QwenImageJob(ctx=ctx, batch=batch, channels=channels, lh=lh, lw=lw, width=width, height=height,
                          steps=steps, first=0, guidance=guidance, do_cfg=do_cfg,
                          cfg_normalization=False, cfg_truncation=None,  # Z-Image's options; not read here
                          vae_tiling=vae_tiling, pos_embeds=embeds[:batch],
                          neg_embeds=embeds[batch:], latents=latents, stats=stats, parameters=parameters,
                          started=started, cond=cond, cond_shapes=cond_shapes)

    # ---- the edit hooks (Qwen-Image-Edit overrides them) ----------------------------------------------------------
    max_edit_images = 0

    def _edit_inputs(self, edit_images: Sequence[Any] | None) -> list:
        """The request's edit images, checked and prepared; none for this text-to-image model.

        Raises:
            InvalidRequestError: edit images given."""
        if edit_images is not None and len(edit_images):
            raise InvalidRequestError(f"{self.family} makes images from text: it does not edit images (use a "
                                      "Qwen-Image-Edit model)")
        return []

    def _default_size(self, edits: list) -> tuple[int, int]:
        """``(width, height)`` when the request gives none."""
        return self.defaults["width"], self.defaults["height"]

    def _encode(self, prompts: list[str], max_len: int, edits: list) -> list[Tensor]:
        """Caption features of ``prompts`` (with the edit images, where a pipeline edits)."""
        return self.encode_prompt(prompts, max_len)

    def _condition(self, ctx, edits: list, batch: int) -> "tuple[Tensor | None, tuple]":
        """The edit images' packed latents ``[batch, T, 64]`` and grids (see :class:`QwenImageJob`); none here."""
        return None, ()

    def _text_batch(self, job: DenoiseJob) -> tuple[Tensor, np.ndarray]:
        """The step's text features ``[B', L, D]`` (prompts, then negative prompts), zero-padded to the longest, and
        the mask ``[B', L]`` of real tokens."""
        ctx = job.ctx
        items = list(job.pos_embeds) + (list(job.neg_embeds) if job.do_cfg else [])
        longest = max(e.shape[0] for e in items)
        mask = np.zeros((len(items), longest), bool)
        rows = []
        for i, e in enumerate(items):
            mask[i, :e.shape[0]] = True
            extra = longest - e.shape[0]
            rows.append(e if not extra else ctx.concatenate([e, ctx.zeros((extra, e.shape[1]), e.dtype)], axis=0))
        return ctx.stack(rows, axis=0), mask

    @staticmethod
    def pack(x: Tensor) -> Tensor:
        """``[B, C, h, w] -> [B, h/2 * w/2, 4C]``, features in (c, row, column) order (diffusers
        ``_pack_latents``)."""
        b, c, h, w = x.shape
        return x.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)

    @staticmethod
    def unpack(x: Tensor, h: int, w: int) -> Tensor:
        """``[B, h/2 * w/2, 4C] -> [B, C, h, w]`` (diffusers ``_unpack_latents`` without the frame axis)."""
        b, _, f = x.shape
        c = f // 4
        return x.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def denoise(self, job: QwenImageJob) -> Iterator[Tensor]:
        """Run the denoising loop of a prepared job, yielding the evaluated float32 ``[B, 16, h, w]`` latents after
        each step (also in ``job.latents``). Closing the generator early leaves them where the last step left them."""
        ctx, stats = job.ctx, job.stats
        timesteps = self.scheduler.timesteps
        dtype = self.backend.compute_dtype
        batch, lh, lw = job.batch, job.lh, job.lw
        text, mask = self._text_batch(job)
        text = text if text.dtype == dtype else text.astype(dtype)
        img_shapes = ((1, lh // 2, lw // 2),) + job.cond_shapes
        tokens = (lh // 2) * (lw // 2)
        cond = None if job.cond is None else job.cond if job.cond.dtype == dtype else job.cond.astype(dtype)
        t_loop = time.perf_counter()
        for i in range(job.first, job.steps):
            t_step = time.perf_counter()
            t_in = np.float32(timesteps[i]) / np.float32(1000.0)  # diffusers: timestep / 1000
            x = self.pack(job.latents if dtype == DType.FLOAT32 else job.latents.astype(dtype))
            if cond is not None:  # an edit's image tokens follow the noisy ones (diffusers: torch.cat(dim=1))
                x = ctx.concatenate([x, cond], axis=1)
            if job.do_cfg:
                x = ctx.concatenate([x, x], axis=0)
            out = self.transformer(ctx, x, np.full((x.shape[0],), t_in, np.float32), text, img_shapes, mask)
            out = (out if cond is None else out[:, :tokens]).astype(DType.FLOAT32)
            pred = out[:batch]
            if job.do_cfg:
                neg = out[batch:]
                comb = neg + (pred - neg) * job.guidance
                cond_norm = (pred * pred).sum(axis=-1, keepdims=True).sqrt()
                noise_norm = (comb * comb).sum(axis=-1, keepdims=True).sqrt()
                pred = comb * (cond_norm / noise_norm)
            job.latents = self.scheduler.step(self.unpack(pred, lh, lw), i, job.latents)
            ctx.evaluate(job.latents)
            now = time.perf_counter()
            stats.step_seconds.append(now - t_step)
            stats.denoise_seconds = now - t_loop
            yield job.latents

    def decode(self, job: DenoiseJob) -> ImageResult:
        """Unnormalize the job's latents (``z / (1 / latents_std) + latents_mean``, as diffusers), VAE-decode them as
        one frame (in tiles above :attr:`tile_above_pixels` unless ``job.vae_tiling`` says otherwise) into 8-bit RGB
        images, and close the job."""
        stats = job.stats
        vae = self.vae
        try:
            t0 = time.perf_counter()
            lat_np = job.latents.numpy().astype(np.float32)
            tiled = (job.width * job.height > self.tile_above_pixels) if job.vae_tiling is None \
                else bool(job.vae_tiling)
            ctx = job.ctx
            inv_std = ctx.from_numpy((np.float32(1.0) / vae.latents_std).astype(np.float32))
            z = job.latents.transpose(0, 2, 3, 1) / inv_std + ctx.from_numpy(vae.latents_mean)
            decoded = (vae.decode_tiled(ctx, z, tile=self.vae_tile, overlap=self.vae_tile_overlap) if tiled
                       else vae.decode(ctx, z))
            pixels = decoded.numpy().astype(np.float32)
            stats.decode_seconds = time.perf_counter() - t0
            stats.tiled_decode = tiled
        finally:
            job.close()
        pixels = np.clip(pixels * 0.5 + 0.5, 0.0, 1.0)  # VaeImageProcessor.denormalize
        images = [Image.fromarray(a) for a in (pixels * 255).round().astype(np.uint8)]  # numpy_to_pil
        stats.peak_memory_bytes = self.backend.peak_memory()
        stats.total_seconds = time.perf_counter() - job.started
        return ImageResult(images=images, latents=lat_np, pixels=pixels, stats=stats, parameters=job.parameters)

    def __repr__(self) -> str:
        return f"QwenImagePipeline({str(self.folder)!r}, quantize={self.quantize})"
