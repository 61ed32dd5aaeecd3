"""The FLUX.2 text-to-image and multi-reference editing pipelines, as diffusers' ``Flux2Pipeline`` (FLUX.2 dev:
Mistral 3 text encoder, guidance-distilled) and ``Flux2KleinPipeline`` (FLUX.2 klein: Qwen3 text encoder, classifier-
free guidance unless step-distilled).

Sources: diffusers 0.42 ``pipelines/flux2/pipeline_flux2.py`` and ``pipeline_flux2_klein.py`` (``__call__``,
``prepare_latents``, ``prepare_image_latents``, ``_prepare_text_ids``, ``_prepare_latent_ids``,
``_prepare_image_ids``, ``_patchify_latents``, ``_unpatchify_latents``, ``_pack_latents``, ``compute_empirical_mu``),
``pipelines/flux2/image_processor.py`` (``Flux2ImageProcessor``), ``models/autoencoders/autoencoder_kl_flux2.py``.
The steps, in :meth:`Flux2Pipeline.prepare`, the generator :meth:`Flux2Pipeline.denoise` and
:meth:`Flux2Pipeline.decode`::

    prompt -> text encoder -> features [L, 3 D] of all max_sequence_length rows; text ids (0, 0, 0, l)
    seed -> noise [B, 128, H/16, W/16] (32 VAE channels x 2x2 patch) -> tokens [B, h w, 128]; ids (0, y, x, 0)
    edit images -> center-cropped to multiples of 16 -> VAE mean -> 2x2 patches -> (x - bn_mean) / bn_std -> tokens;
        image i has ids (10 + 10 i, y, x, 0); the tokens of all of them follow the noisy ones in every step
    sigmas = linspace(1, 1/n, n); mu = compute_empirical_mu(h w, n) -> scheduler.set_timesteps(sigmas, mu)
    per step: v = transformer([noisy, references], timestep / 1000, text, guidance)[:, :h w]
              (klein with CFG: v = neg + g (pos - neg), the negative prompt "" by default)
              latents = scheduler.step(v, i, latents)
    latents * bn_std + bn_mean -> unpatchify [B, 32, H/8, W/8] -> VAE decode -> [0, 1] -> uint8 -> PIL

``bn_mean``, ``bn_std`` are the VAE's BatchNorm running statistics (``sqrt(running_var + batch_norm_eps)``).
Latents are kept as diffusers hands them to ``prepare_latents``: ``[B, 128, h, w]`` float32 (``h = H / 16``).

Guidance: FLUX.2 dev embeds ``guidance`` in the transformer (one pass per step; diffusers' ``guidance_scale``,
default 4); klein runs the prompt and the negative prompt when ``guidance > 1`` and the folder's ``model_index.json``
does not say ``is_distilled`` (``neg + guidance * (pos - neg)``), else one pass.

Memory: the text encoder is loaded for each generation and closed before the denoising loop unless
``keep_text_encoder``; the VAE decodes above :attr:`Flux2Pipeline.tile_above_pixels` in tiles.
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
from PIL import Image

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.imagegen.pipeline import (MAX_SIDE, DenoiseJob, ImageGenerationStats, ImageResult, StepCallback,
                                          check_image_size, component_folder, load_init_image, read_defaults,
                                          read_json, read_model_index)
from mlx_engine.imagegen.zimage import ZImagePipeline
from mlx_engine.ml import Backend, Context, DType, Tensor

__all__ = ["Flux2Pipeline", "PIPELINE_CLASSES", "compute_empirical_mu", "edit_image_pixels"]

#: ``_class_name`` values of ``model_index.json`` this pipeline loads.
PIPELINE_CLASSES = ("Flux2Pipeline", "Flux2KleinPipeline")
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
#: the hidden states (transformers' ``hidden_states`` indices) stacked into the text features (diffusers' defaults).
TEXT_LAYERS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}
#: diffusers' defaults (50 steps, guidance 4, 512 text tokens, the layers of :data:`TEXT_LAYERS` when None); a
#: step-distilled klein: Black Forest Labs' 4 steps without guidance. A folder's ``mlx_engine.json`` may change them.
BUILTIN_DEFAULTS = {"steps": 50, "guidance": 4.0, "negative_prompt": None, "max_sequence_length": 512,
                    "text_encoder_out_layers": None}
DISTILLED_DEFAULTS = {**BUILTIN_DEFAULTS, "steps": 4, "guidance": 1.0}
#: an edit image above this many pixels is scaled down to it first (``Flux2Pipeline.__call__``).
EDIT_MAX_AREA = 1024 * 1024
#: the most edit images per generation: Black Forest Labs' documented limits (FLUX.2 [dev]: 6 recommended at most;
#: [klein]: up to 4). diffusers sets none.
MAX_EDIT_IMAGES = {"Flux2Pipeline": 6, "Flux2KleinPipeline": 4}
#: the reference images' time ids are ``REF_T_SCALE * (1 + i)`` (``_prepare_image_ids(scale=10)``).
REF_T_SCALE = 10


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's schedule shift ``mu`` (diffusers ``compute_empirical_mu``, from Black Forest Labs'
    ``flux2/src/flux2/sampling.py``): a line in the step count between fits at 10 and 200 steps, each linear in the
    image tokens; above 4300 tokens the 200-step fit alone."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def edit_image_pixels(image: Any, multiple: int, min_side: int = 64, max_ratio: float = 8.0) -> np.ndarray:
    """An edit (reference) image as float32 ``[1, H, W, 3]`` in ``[-1, 1]``, as ``Flux2Pipeline.__call__`` prepares
    it: refused below ``min_side`` pixels or beyond a ``max_ratio`` aspect (``check_image_input``); scaled (Lanczos)
    to about one megapixel when larger (``_resize_to_target_area``); center-cropped to multiples of ``multiple``
    (``preprocess(resize_mode="crop")``, whose crop does not resize); RGB; ``2 x / 255 - 1``.

    Raises:
        InvalidRequestError: an unreadable image, or one too small or too elongated (the message says which).
    """
    img = load_init_image(image)
    w, h = img.size
    if w < min_side or h < min_side:
        raise InvalidRequestError(f"edit image too small: {w}x{h}; both sides must be at least {min_side} pixels")
    if max(w / h, h / w) > max_ratio:
        raise InvalidRequestError(f"edit image too elongated: {w}x{h}; the aspect ratio may be at most "
                                  f"{max_ratio:g}:1")
    if w * h > EDIT_MAX_AREA:
        scale = math.sqrt(EDIT_MAX_AREA / (w * h))
        img = img.resize((int(w * scale), int(h * scale)), Image.LANCZOS)
        w, h = img.size
    cw, ch = w // multiple * multiple, h // multiple * multiple
    left, top = (w - cw) // 2, (h - ch) // 2
    img = img.crop((left, top, left + cw, top + ch))
    if img.mode != "RGB":
        img = img.convert("RGB")
    a = np.asarray(img, dtype=np.float32) / np.float32(255.0)
    return (2.0 * a - 1.0)[None].astype(np.float32)


@dataclass
class Flux2Job(DenoiseJob):
    """A :class:`~mlx_engine.imagegen.pipeline.DenoiseJob` with the edit images' tokens ``[B, N_ref, 128]`` and their
    position ids ``[N_ref, 4]`` (both None without edit images)."""

    ref_tokens: Tensor | None = None
    ref_ids: np.ndarray | None = None


def _grid_ids(h: int, w: int, t: int = 0) -> np.ndarray:
    """Position ids ``(t, y, x, 0)`` of an ``h x w`` token grid in row-major order, ``[h w, 4]``."""
    y, x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([np.full(h * w, t), y.reshape(-1), x.reshape(-1), np.zeros(h * w, np.int64)], -1)


class Flux2Pipeline:
    """A FLUX.2 (dev or klein) diffusers folder, loaded for generation.

    Args:
        folder: the diffusers folder (``model_index.json``, ``transformer/``, ``vae/``, ``text_encoder/``,
            ``tokenizer/``, ``scheduler/``).
        make_backend: ``make_backend(component_folder) -> Backend`` (``mlx_engine.api`` passes ``MLXBackend``); with
            ``quantize``, ``make_backend(folder, transform=...)`` for the transformer, as ZImagePipeline's.
        quantize: quantize the transformer's block weights and the text encoder's language model to 8 or 4 bits as
            they are read (None: as stored).
        keep_text_encoder: keep the text encoder loaded between generations.
        resolve_model: accepted for the registry's common signature; FLUX.2 folders hold their text encoder.
        memory_check: as :class:`~mlx_engine.imagegen.zimage.ZImagePipeline`'s (refuse a load that cannot fit).

    Attributes:
        kind: the ``_class_name`` (``Flux2Pipeline`` or ``Flux2KleinPipeline``). is_distilled: klein's flag (no CFG).
        max_edit_images: the most edit images a generation takes (:data:`MAX_EDIT_IMAGES`).
        size_multiple: width and height must be multiples of it (16: the VAE's 8 times the 2x2 packing).
        defaults: width, height, steps, guidance, negative_prompt.

    Raises:
        ModelNotFoundError: no such folder or no ``model_index.json``. WeightsError: a missing component, config or
        tensor. UnsupportedError: another pipeline or component class. InvalidRequestError: ``quantize`` not 4 or 8.
        MemoryBudgetError: ``memory_check`` given and the model cannot fit (the message gives both numbers).
    """

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
        self.kind = self.model_index["_class_name"]
        self.is_distilled = bool(self.model_index.get("is_distilled", False))
        self.max_edit_images = MAX_EDIT_IMAGES[self.kind]
        self.name = str(self.folder)
        self.transformer_config = read_json(component_folder(self.folder, "transformer") / "config.json",
                                            "the transformer config")
        self.vae_config = read_json(component_folder(self.folder, "vae") / "config.json", "the VAE config")
        text_config = read_json(component_folder(self.folder, "text_encoder") / "config.json",
                                "the text encoder config")
        self.text_config = text_config.get("text_config") or text_config  # Mistral3ForConditionalGeneration's
        if not (component_folder(self.folder, "tokenizer") / "tokenizer.json").is_file():
            raise WeightsError(f"{self.folder / 'tokenizer'}: no tokenizer.json in the tokenizer folder")
        self.scheduler = FlowMatchEulerScheduler.from_folder(self.folder / "scheduler")
        self.vae_scale_factor = 2 ** (len(self.vae_config.get("block_out_channels") or [0] * 4) - 1)
        self.size_multiple = self.vae_scale_factor * 2
        self.min_side = self.size_multiple
        self.max_side = MAX_SIDE
        self.tile_above_pixels = 1024 * 1024
        self.vae_tile, self.vae_tile_overlap = 64, 16
        side = int(self.vae_config.get("sample_size") or 1024)
        side = max(self.min_side, min(self.max_side, side - side % self.size_multiple))
        builtin = DISTILLED_DEFAULTS if self.is_distilled else BUILTIN_DEFAULTS
        self.defaults = read_defaults(self.folder, {**builtin, "width": side, "height": side})
        #: the bytes the model needs (:mod:`mlx_engine.imagegen.memory`), when the load was checked
        self.memory_estimate = check_pipeline_memory(self, memory_check)
        self._backends: list[Backend] = []
        self._text_encoder = None
        self._closed = False
        try:
            self.transformer = self._load_transformer()
            self.vae, self.bn_mean, self.bn_std = self._load_vae()
            if keep_text_encoder:
                self._load_text_encoder()
        except BaseException:
            self.close()
            raise

    @classmethod
    def memory_layout(cls):
        """What the load holds (:class:`~mlx_engine.imagegen.memory.MemoryLayout`) for the memory estimate."""
        from mlx_engine.imagegen.flux2_transformer import Flux2Transformer
        from mlx_engine.imagegen.memory import MemoryLayout
        from mlx_engine.imagegen.quantize import TEXT_MODEL_FLOAT

        return MemoryLayout(float_prefixes=Flux2Transformer.FLOAT_PREFIXES,
                            text_float={"text_encoder": TEXT_MODEL_FLOAT})

    # ---- loading ------------------------------------------------------------------------------------------------
    def _read_model_index(self) -> dict:
        f = self.folder
        index = read_model_index(f)
        name = index.get("_class_name")
        if name not in PIPELINE_CLASSES:
            raise UnsupportedError(f"{f}: pipeline {name!r} is not supported by the FLUX.2 pipeline, which runs "
                                   f"{' and '.join(PIPELINE_CLASSES)} folders")
        for comp in COMPONENTS:
            if comp not in index:
                raise WeightsError(f"{f / 'model_index.json'}: no {comp!r} component listed")
        expected = {"transformer": "Flux2Transformer2DModel", "vae": "AutoencoderKLFlux2",
                    "scheduler": "FlowMatchEulerDiscreteScheduler"}
        for comp, cls in expected.items():
            entry = index.get(comp)
            got = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
            if got is not None and got != cls:
                raise UnsupportedError(f"{f}: {comp} is a {got}; this engine implements {cls}")
        return index

    def _load_transformer(self):
        from mlx_engine.imagegen.flux2_transformer import Flux2Transformer
        from mlx_engine.imagegen.quantize import transformer_backend

        backend = transformer_backend(self._make_backend, component_folder(self.folder, "transformer"), self.quantize,
                                      Flux2Transformer.FLOAT_PREFIXES)
        self._backends.append(backend)
        return Flux2Transformer.from_backend(backend, quantize_bits=self.quantize)

    def _load_vae(self):
        """The VAE, and the BatchNorm statistics of its packed latents as ``[128]`` float32 tensors ``(mean, std)``
        with ``std = sqrt(running_var + batch_norm_eps)`` (the pipeline's ``latents_bn_mean`` / ``latents_bn_std``)."""
        from mlx_engine.imagegen.vae import AutoencoderKL

        backend = self._make_backend(component_folder(self.folder, "vae"))
        self._backends.append(backend)
        vae = AutoencoderKL.from_backend(backend)
        stats = []
        for name in ("bn.running_mean", "bn.running_var"):
            t = backend.weights.get(name)
            if t is None:
                raise WeightsError(f"{self.folder / 'vae'}: tensor {name!r} is missing (AutoencoderKLFlux2's "
                                   "BatchNorm statistics)")
            stats.append(t.numpy().astype(np.float32))
        eps = np.float32(self.vae_config.get("batch_norm_eps", 1e-4))
        mean, std = stats[0], np.sqrt(stats[1] + eps).astype(np.float32)
        if mean.shape != (4 * vae.latent_channels,) or std.shape != mean.shape:
            raise WeightsError(f"{self.folder / 'vae'}: BatchNorm statistics of shape {mean.shape}, expected "
                               f"({4 * vae.latent_channels},) (latent channels times a 2x2 patch)")
        backend.close()  # the VAE keeps its own copies
        ctx = self.backend.new_context()
        return vae, ctx.from_numpy(mean), ctx.from_numpy(std)

    def _load_text_encoder(self):
        from mlx_engine.imagegen.flux2_text import SYSTEM_MESSAGE, Flux2TextEncoder, padding_side
        from mlx_engine.imagegen.quantize import TEXT_MODEL_FLOAT, quantizing
        from mlx_engine.models.registry import load_text_checkpoint

        if self._text_encoder is None:
            tok = component_folder(self.folder, "tokenizer")
            try:
                text = load_text_checkpoint(component_folder(self.folder, "text_encoder"),
                                            quantizing(self._make_backend, self.quantize, TEXT_MODEL_FLOAT),
                                            tokenizer_folder=tok)
            except KeyError as e:
                raise WeightsError(f"{self.folder / 'text_encoder'}: missing tensor {e}") from None
            try:
                self._text_encoder = Flux2TextEncoder(
                    text.model, text.tokenizer, text.backend, pad_side=padding_side(tok),
                    system_message=SYSTEM_MESSAGE if self.kind == "Flux2Pipeline" else None)
            except BaseException:
                text.backend.close()
                raise
        return self._text_encoder

    def free_text_encoder(self) -> None:
        """Close the text encoder and drop its weights (loaded again by the next generation)."""
        te, self._text_encoder = self._text_encoder, None
        if te is not None:
            te.close()
            te.backend.clear_cache()

    # what Z-Image's pipeline does the same way (the transformer's backend, memory figures, closing), shared rather
    # than copied
    backend = ZImagePipeline.backend
    backend_name = ZImagePipeline.backend_name
    memory = ZImagePipeline.memory
    close = ZImagePipeline.close
    __enter__ = ZImagePipeline.__enter__
    __exit__ = ZImagePipeline.__exit__

    def check_size(self, width: Any, height: Any) -> tuple[int, int]:
        """``(width, height)`` as ints when the model can make that size (multiples of 16)."""
        return check_image_size(width, height, multiple=self.size_multiple, min_side=self.min_side,
                                max_width=self.max_side, max_height=self.max_side)

    # ---- the steps ----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompts: Sequence[str], max_sequence_length: int,
                      layers: Sequence[int]) -> list[Tensor]:
        """Text features ``[max_sequence_length, len(layers) * D]`` of each prompt (the text encoder's business)."""
        te = self._load_text_encoder()
        with te.backend.new_context() as ctx:
            return te.encode(ctx, list(prompts), max_sequence_length, layers)

    def generate(self, prompt: "str | Sequence[str]", *, negative_prompt: "str | Sequence[str] | None" = None,
                 width: int | None = None, height: int | None = None, steps: int | None = None,
                 guidance: float | None = None, seed: int | None = None, edit_images: Sequence[Any] | None = None,
                 image: Any = None, strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                 callback: StepCallback | None = None, max_sequence_length: int | None = None,
                 sigmas: Sequence[float] | None = None, text_encoder_out_layers: Sequence[int] | None = None,
                 vae_tiling: bool | None = None) -> ImageResult:
        """Generate images: :meth:`prepare`, every step of :meth:`denoise` (``callback`` after each), :meth:`decode`.

        Args:
            prompt: the text, or a list of texts (one image each).
            negative_prompt: klein with classifier-free guidance only: what it steers away from (default ``""``,
                diffusers' choice). FLUX.2 dev has no negative prompt (refused).
            width, height: pixels, multiples of 16 (default: the first edit image's cropped size, else the model's).
            steps: denoising steps (>= 1). guidance: dev: the embedded guidance scale; klein: the CFG scale (on above
                1 unless the model is step-distilled).
            seed: the noise seed (one ``Context.random_normal`` draw of ``[B, 128, H/16, W/16]``); None draws one.
            edit_images: reference images for editing (PIL images, paths or uint8 arrays; one, or a list, shared by
                the batch): each is encoded by the VAE and its tokens, with their own positions, join every step.
            image, strength: image-to-image with an init image is not what FLUX.2 does (refused; use
                ``edit_images``).
            noise: the initial noise, float32 ``[B, 128, H/16, W/16]`` (parity tests), instead of the seeded draw.
            callback: :data:`~mlx_engine.imagegen.pipeline.StepCallback` after each step.
            max_sequence_length: the text tokens, padded or cut (default 512, or the folder's ``mlx_engine.json``).
            sigmas: custom sigmas (default ``linspace(1, 1/steps, steps)``).
            text_encoder_out_layers: the text encoder's hidden states to stack (default (10, 20, 30) for dev,
                (9, 18, 27) for klein, or the folder's ``mlx_engine.json``; as many as the transformer's
                ``joint_attention_dim`` takes).
            vae_tiling: decode in tiles (True), at once (False), or above :attr:`tile_above_pixels` (None).

        Returns:
            :class:`~mlx_engine.imagegen.pipeline.ImageResult` (``latents`` ``[B, 128, H/16, W/16]``).

        Raises:
            InvalidRequestError: bad sizes, steps, guidance, seed, noise or edit images; a negative prompt for dev;
                an init image.
        """
        job = self.prepare(prompt, negative_prompt=negative_prompt, width=width, height=height, steps=steps,
                           guidance=guidance, seed=seed, edit_images=edit_images, image=image, strength=strength,
                           noise=noise, max_sequence_length=max_sequence_length, sigmas=sigmas,
                           text_encoder_out_layers=text_encoder_out_layers, vae_tiling=vae_tiling)
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
                guidance: float | None = None, seed: int | None = None, edit_images: Sequence[Any] | None = None,
                image: Any = None, strength: float | None = None, noise: "np.ndarray | Tensor | None" = None,
                max_sequence_length: int | None = None, sigmas: Sequence[float] | None = None,
                text_encoder_out_layers: Sequence[int] | None = None,
                vae_tiling: bool | None = None) -> DenoiseJob:
        """Check the request, set the schedule, encode the prompts (then free the text encoder unless kept), encode
        the edit images and make the start latents. Arguments as :meth:`generate`; nothing heavy runs before the
        checks pass.

        Returns:
            a :class:`DenoiseJob` owning a Context until closed (its ``refs`` hold the edit images' tokens and ids).
        """
        from mlx_engine.imagegen.scheduler import check_steps

        if self._closed:
            raise InvalidRequestError("the image pipeline is closed")
        started = time.perf_counter()
        d = self.defaults
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else []
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError(f"the prompt must be a string (or a list of strings), got {prompt!r}")
        if image is not None or strength is not None:
            raise InvalidRequestError("FLUX.2 does not run image-to-image from an init image (image=, strength=); "
                                      "give the image as a reference to edit: edit_images=[...]")
        batch = len(prompts)
        steps = check_steps(d["steps"] if steps is None else steps)
        guidance = d["guidance"] if guidance is None else guidance
        if (isinstance(guidance, bool) or not isinstance(guidance, (int, float, np.number))
                or not math.isfinite(guidance) or guidance < 0):
            raise InvalidRequestError(f"guidance must be a number >= 0, got {guidance!r}")
        guidance = float(guidance)
        klein = self.kind == "Flux2KleinPipeline"
        do_cfg = klein and guidance > 1 and not self.is_distilled  # Flux2KleinPipeline.do_classifier_free_guidance
        negative_prompt = d.get("negative_prompt") if negative_prompt is None else negative_prompt
        if negative_prompt is not None and not klein:
            raise InvalidRequestError("FLUX.2 dev has no negative prompt (its guidance is embedded in the model)")
        negs: list[str] = []
        if do_cfg:
            negs = [""] * batch if negative_prompt is None else (
                [negative_prompt] if isinstance(negative_prompt, str) else list(negative_prompt))
            if len(negs) != batch or not all(isinstance(p, str) for p in negs):
                raise InvalidRequestError(f"give one negative prompt (a string) per prompt: {batch} prompt(s), "
                                          f"negative_prompt={negative_prompt!r}")
        max_len = d["max_sequence_length"] if max_sequence_length is None else max_sequence_length
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= 4096:
            raise InvalidRequestError(f"max_sequence_length must be an integer in 1..4096, got {max_len!r}")
        layers = self._text_layers(d["text_encoder_out_layers"] if text_encoder_out_layers is None
                                   else text_encoder_out_layers)

        if isinstance(edit_images, (Image.Image, np.ndarray, str, os.PathLike)):
            edit_images = [edit_images]  # one image
        if edit_images is not None and len(edit_images) > self.max_edit_images:
            raise InvalidRequestError(f"{self.name}: {self.kind} takes at most {self.max_edit_images} edit images, "
                                      f"got {len(edit_images)}")
        refs = [edit_image_pixels(im, self.size_multiple) for im in (edit_images or [])]
        if refs and width is None and height is None:
            height, width = refs[0].shape[1:3]  # diffusers: height = height or image_height (the first image's)
        width = d["width"] if width is None else width
        height = d["height"] if height is None else height
        width, height = self.check_size(width, height)
        channels = int(self.transformer_config.get("in_channels", 128))
        lh, lw = height // self.size_multiple, width // self.size_multiple  # prepare_latents: 2 * (H // 16) // 2
        shape = (batch, channels, lh, lw)
        if noise is not None:
            if tuple(noise.shape) != shape:
                raise InvalidRequestError(f"noise has shape {tuple(noise.shape)}; this request needs {shape} "
                                          "([B, C, h, w])")
        elif seed is None:
            seed = secrets.randbelow(2 ** 32)
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 64:
            raise InvalidRequestError(f"seed must be an integer in 0 .. 2**64 - 1, got {seed!r}")

        sig = list(sigmas) if sigmas is not None else np.linspace(1.0, 1 / steps, steps)
        self.scheduler.set_timesteps(steps, mu=compute_empirical_mu(lh * lw, steps), sigmas=sig)
        steps = self.scheduler.num_inference_steps

        backend = self.backend
        backend.reset_peak_memory()
        stats = ImageGenerationStats(seed=None if noise is not None else int(seed), width=width, height=height,
                                     steps=steps, steps_run=steps, guidance=guidance)
        parameters = {"prompt": prompt, "negative_prompt": negative_prompt if do_cfg else None, "seed": stats.seed,
                      "steps": steps, "guidance": guidance, "width": width, "height": height, "strength": None,
                      "max_sequence_length": int(max_len)}

        t0 = time.perf_counter()
        try:
            embeds = self.encode_prompt(prompts + negs, int(max_len), layers)
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
                latents = ctx.random_normal(shape, DType.FLOAT32, ctx.random_key(int(seed)))
            ref_tokens, ref_ids = self._encode_references(ctx, refs, batch)
            ctx.evaluate(latents, *([ref_tokens] if ref_tokens is not None else []))
        except BaseException:
            ctx.close()
            raise
        return Flux2Job(ctx=ctx, batch=batch, channels=channels, lh=lh, lw=lw, width=width, height=height,
                        steps=steps, first=0, guidance=guidance, do_cfg=do_cfg, cfg_normalization=False,
                        cfg_truncation=None, vae_tiling=vae_tiling, pos_embeds=embeds[:batch],
                        neg_embeds=embeds[batch:], latents=latents, stats=stats, parameters=parameters,
                        started=started, ref_tokens=ref_tokens, ref_ids=ref_ids)

    def _text_layers(self, layers: Sequence[int] | None) -> tuple[int, ...]:
        """The hidden states to stack, checked against the text encoder's config (``0 .. num_hidden_layers``) and
        the transformer's (``len(layers) * hidden_size == joint_attention_dim``)."""
        layers = TEXT_LAYERS[self.kind] if layers is None else tuple(layers)
        joint = int(self.transformer_config.get("joint_attention_dim", 15360))
        width, depth = self.text_config.get("hidden_size"), self.text_config.get("num_hidden_layers")
        if not layers or not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in layers):
            raise InvalidRequestError(f"text_encoder_out_layers must be layer indices, got {layers!r}")
        if isinstance(depth, int) and not all(0 <= k <= depth for k in layers):
            raise InvalidRequestError(f"text_encoder_out_layers {list(layers)} must be in 0..{depth} (the text "
                                      "encoder's hidden_states indices)")
        if isinstance(width, int) and len(layers) * width != joint:
            raise InvalidRequestError(f"{len(layers)} text encoder layers of width {width} do not make the "
                                      f"transformer's joint_attention_dim {joint}")
        return tuple(int(k) for k in layers)

    def _encode_references(self, ctx: Context, refs: list[np.ndarray], batch: int) -> tuple[Tensor | None, Any]:
        """The edit images' tokens ``[B, sum(h_i w_i), 128]`` (``prepare_image_latents``: the VAE's mean, 2x2
        patches, BatchNorm-normalized, packed, concatenated, repeated over the batch) and their ids, or
        ``(None, None)``."""
        if not refs:
            return None, None
        dtype = self.backend.compute_dtype
        tokens, ids = [], []
        for i, px in enumerate(refs):
            x = ctx.from_numpy(px, DType.FLOAT32)
            mean = self.vae.encode(ctx, x if dtype == DType.FLOAT32 else x.astype(dtype)).astype(DType.FLOAT32)
            _, h, w, c = mean.shape  # [1, H/8, W/8, C]
            p = mean.reshape(1, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4).reshape(1, h // 2, w // 2, 4 * c)
            tokens.append(((p - self.bn_mean) / self.bn_std).reshape((h // 2) * (w // 2), 4 * c))
            ids.append(_grid_ids(h // 2, w // 2, REF_T_SCALE * (1 + i)))
        t = ctx.concatenate(tokens, axis=0) if len(tokens) > 1 else tokens[0]
        return ctx.stack([t] * batch, axis=0), np.concatenate(ids)

    def denoise(self, job: DenoiseJob) -> Iterator[Tensor]:
        """Run the denoising loop of a prepared job, yielding the evaluated float32 ``[B, 128, h, w]`` latents after
        each step (also in ``job.latents``)."""
        ctx, stats = job.ctx, job.stats
        c, lh, lw, batch = job.channels, job.lh, job.lw, job.batch
        n = lh * lw
        ref_tokens, ref_ids = job.ref_tokens, job.ref_ids
        img_ids = _grid_ids(lh, lw) if ref_ids is None else np.concatenate([_grid_ids(lh, lw), ref_ids])
        pos = ctx.stack(job.pos_embeds, axis=0)
        txt_len = pos.shape[1]
        txt_ids = np.stack([np.zeros(txt_len, np.int64)] * 3 + [np.arange(txt_len)], -1)  # _prepare_text_ids
        txt = ctx.concatenate([pos, ctx.stack(job.neg_embeds, axis=0)], axis=0) if job.do_cfg else pos
        klein = self.kind == "Flux2KleinPipeline"
        g = None if klein else np.full(txt.shape[0], job.guidance, np.float32)
        t_loop = time.perf_counter()
        for i in range(job.first, job.steps):
            t_step = time.perf_counter()
            t_in = np.float32(self.scheduler.timesteps[i]) / np.float32(1000.0)
            x = job.latents.reshape(batch, c, n).transpose(0, 2, 1)  # _pack_latents
            if ref_tokens is not None:
                x = ctx.concatenate([x, ref_tokens], axis=1)
            if job.do_cfg:
                x = ctx.concatenate([x, x], axis=0)
            v = self.transformer(ctx, x, img_ids, txt, txt_ids, t_in, g)[:, :n].astype(DType.FLOAT32)
            if job.do_cfg:
                v = v[batch:] + (v[:batch] - v[batch:]) * job.guidance
            v = v.transpose(0, 2, 1).reshape(batch, c, lh, lw)
            job.latents = self.scheduler.step(v, i, job.latents)
            ctx.evaluate(job.latents)
            now = time.perf_counter()
            stats.step_seconds.append(now - t_step)
            stats.denoise_seconds = now - t_loop
            yield job.latents

    def vae_input(self, latents: Tensor) -> Tensor:
        """The VAE decoder's input ``[B, 2h, 2w, 32]`` (channels last) from latents ``[B, 128, h, w]``: the BatchNorm
        undone (``x * bn_std + bn_mean``), then each token's 128 features spread over its 2x2 patch
        (``_unpatchify_latents``: feature ``4 c + 2 i + j`` is channel ``c`` at ``(2y + i, 2x + j)``)."""
        b, c, lh, lw = latents.shape
        z = latents.transpose(0, 2, 3, 1) * self.bn_std + self.bn_mean
        return z.reshape(b, lh, lw, c // 4, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(b, 2 * lh, 2 * lw, c // 4)

    def decode(self, job: DenoiseJob) -> ImageResult:
        """Undo the BatchNorm, unpatchify and VAE-decode the job's latents (in tiles above
        :attr:`tile_above_pixels` unless ``job.vae_tiling`` says otherwise), make 8-bit RGB images, close the job."""
        stats = job.stats
        try:
            t0 = time.perf_counter()
            lat_np = job.latents.numpy().astype(np.float32)
            z = self.vae_input(job.latents)
            tiled = (job.width * job.height > self.tile_above_pixels) if job.vae_tiling is None \
                else bool(job.vae_tiling)
            decoded = (self.vae.decode_tiled(job.ctx, z, tile=self.vae_tile, overlap=self.vae_tile_overlap) if tiled
                       else self.vae.decode(job.ctx, z))
            pixels = decoded.numpy().astype(np.float32)
            stats.decode_seconds = time.perf_counter() - t0
            stats.tiled_decode = tiled
        finally:
            job.close()
        pixels = np.clip(pixels * 0.5 + 0.5, 0.0, 1.0)  # VaeImageProcessor.denormalize
        images = [Image.fromarray(a) for a in (pixels * 255).round().astype(np.uint8)]
        stats.peak_memory_bytes = self.backend.peak_memory()
        stats.total_seconds = time.perf_counter() - job.started
        return ImageResult(images=images, latents=lat_np, pixels=pixels, stats=stats, parameters=job.parameters)

    def __repr__(self) -> str:
        return f"Flux2Pipeline({str(self.folder)!r}, kind={self.kind!r}, quantize={self.quantize})"
