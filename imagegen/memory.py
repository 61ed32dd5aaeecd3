"""How much memory an image pipeline needs, computed before any weight is read, and the refusal of a load that
cannot fit.

The bytes come from the component folders' safetensors headers (names, shapes, dtypes; nothing else is read) and the
transformer's ``config.json``:

- weights: every tensor of a component folder, floating ones at the backend's weight dtype (the backend casts them
  to its compute dtype at load: float32 on CPU, 16-bit on GPUs), others at their stored size. With ``quantize`` the
  linear weights that :func:`~mlx_engine.imagegen.quantize.quantizer` quantizes (2-D ``*.weight``, input width a
  multiple of 64, outside the prefixes kept float: the transformer's ``FLOAT_PREFIXES``, a text encoder's in
  :attr:`MemoryLayout.text_float`) take ``bits / 8`` bytes a weight plus a scale and a bias per group of 64 at the
  weight dtype (MLX's affine quantization: 8.5 and 4.5 bits a weight with 16-bit floats), in the transformer and in
  the text encoders that ``--quantize`` quantizes (those of :attr:`MemoryLayout.text_float`; not CLIP).
- phases: with ``quantize`` the transformer's backend quantizes each linear weight as it reads it
  (:func:`~mlx_engine.imagegen.quantize.quantizing`), so the load holds the quantized transformer plus
  the one float tensor being quantized (:func:`quantize_transient_bytes`), then the VAE beside it (``loading``); the
  text encoders are loaded for each prompt beside the transformer and VAE, quantized as they are read likewise
  (``encoding``: FLUX.1 loads CLIP and T5 together); the denoising loop holds the transformer, the VAE and one
  step's activations (``denoising``); :attr:`MemoryEstimate.peak` is the largest. A load is refused when its
  weights cannot fit (:attr:`MemoryEstimate.weights_peak`, :func:`check_memory`); a generation when its
  activations, at the size it asks for, cannot fit beside the loaded weights (:func:`check_request_memory`).
- activations (an upper bound, for one step at ``width x height``): per transformer pass (2 with guidance) the joint
  sequence of ``N`` image and text tokens at width ``D`` holds about :data:`LIVE_WIDTHS` ``N x D`` tensors (hidden
  state, Q, K, V, attention output, a 4x MLP hidden and the residual) and :data:`SCORE_COPIES` ``heads x N x N``
  attention score matrices (MLX's CPU attention materializes them; a fused GPU kernel needs less); the VAE decode of
  one tile (the whole image up to ``tile_above_pixels``) holds :data:`VAE_FLOATS_PER_PIXEL` per pixel. These are
  upper bounds measured on the CPU backend, at the backend's float size.

``available_memory(backend)`` is what the device can still give: its memory (``Backend.device_memory``) less what the
process holds (``active_memory``), and on a machine that shares it with other processes no more than the system has
free (psutil's ``available`` plus MLX's cache of freed buffers, which it gives back on demand).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_engine.errors import MemoryBudgetError, WeightsError
from mlx_engine.ml import Backend

__all__ = ["MemoryLayout", "MemoryEstimate", "TensorEntry", "folder_tensors", "weight_bytes", "estimate_memory",
           "estimate_folder", "quantize_transient_bytes", "available_memory", "check_memory", "check_pipeline_memory",
           "check_request_memory", "activation_bytes", "GROUP_SIZE", "LIVE_WIDTHS"]

GROUP_SIZE = 64  # the pipelines quantize with groups of 64 (their from_backend default)
LIVE_WIDTHS = 12  # N x D tensors alive at once inside one transformer block (see the module docstring)
TEXT_TOKENS = 512  # the longest prompt any pipeline gives the transformer (diffusers' max_sequence_length)
PASSES = 2  # transformer passes a step may run (guidance: the prompt and the negative prompt)
SCORE_COPIES = 3  # attention scores materialized at once (scores, softmax, its product's input) where not fused
#: floats a VAE decode holds per output pixel, ``a * C1 + b * C0``: measured on MLX's CPU backend (its convolutions
#: unfold 3x3 windows) with random diffusers VAEs of channels (16, 32), (32, 64), (64, 64) at 64 and 128 pixels
#: (27.0 and 16.3 fitted, linear in the channels and in the pixels), rounded up
VAE_FLOATS_PER_PIXEL = (28, 17)

_FLOAT_TYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_OTHER_TYPES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8}

#: one tensor of a component: ``(name, shape, safetensors dtype name)``
TensorEntry = tuple[str, tuple[int, ...], str]


@dataclass(frozen=True)
class MemoryLayout:
    """What a pipeline family loads, for the estimate.

    Attributes:
        float_prefixes: names of transformer tensors that ``--quantize`` leaves float (the transformer class's
            ``FLOAT_PREFIXES``).
        text: the component folders loaded together to encode a prompt (FLUX.1: CLIP and T5).
        text_float: the text folders that ``--quantize`` quantizes, each with the prefixes of its tensors kept float
            (``quantize.TEXT_MODEL_FLOAT``, ``quantize.T5_FLOAT``); a text folder not listed stays float (CLIP).
    """

    float_prefixes: tuple[str, ...]
    text: tuple[str, ...] = ("text_encoder",)
    text_float: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes an image pipeline needs (see the module docstring for how each is counted).

    Attributes:
        transformer: the transformer's weights as they stay loaded (quantized with ``quantize``).
        transformer_transient: what reading the transformer holds beyond its loaded weights: with ``quantize`` the
            largest quantized weight at the weight dtype (read in float, quantized, freed before the next); else 0.
        text: the text encoders loaded together for a prompt (quantized with ``quantize`` where the layout says).
        text_transient: what reading them holds beyond their loaded weights: with ``quantize`` the largest text
            weight quantized, at the weight dtype; else 0. vae: the VAE's weights.
        activations: one denoising step's transformer activations plus the VAE decode's, at ``width x height``.
        width, height: the image size the activations are for (pixels). quantize: None, 8 or 4.
    """

    transformer: int
    transformer_transient: int
    text: int
    vae: int
    activations: int
    width: int
    height: int
    quantize: int | None = None
    text_transient: int = 0

    @property
    def loading(self) -> int:
        return self.transformer + max(self.transformer_transient, self.vae)

    @property
    def encoding(self) -> int:
        return self.transformer + self.vae + self.text + self.text_transient

    @property
    def denoising(self) -> int:
        return self.transformer + self.vae + self.activations

    @property
    def weights_peak(self) -> int:
        """The most the weights alone take at once (loading or encoding): what a load is checked against."""
        return max(self.loading, self.encoding)

    @property
    def peak(self) -> int:
        """The most the pipeline holds at once: the largest of loading, encoding and denoising."""
        return max(self.loading, self.encoding, self.denoising)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def folder_tensors(folder: Path) -> list[TensorEntry]:
    """``(name, shape, dtype)`` of every tensor of a component folder's safetensors (sharded or not), from the
    headers only.

    Raises:
        WeightsError: no weights in the folder, or a corrupt header (the message names the file).
    """
    from mlx_engine.weights import open_weights

    with open_weights(folder) as wf:
        return [(n, tuple(wf.shape(n)), wf.type_name(n)) for n in wf.names()]


def _quantized(name: str, shape: Sequence[int], float_prefixes: tuple[str, ...]) -> bool:
    """Whether the pipelines' load quantizes this tensor (the rule of ``quantize.quantizer``)."""
    return (name.endswith(".weight") and len(shape) == 2 and not name.startswith(float_prefixes)
            and shape[1] % GROUP_SIZE == 0 and shape[0] > 1)


def weight_bytes(tensors: Iterable[TensorEntry], itemsize: int, *, quantize: int | None = None,
                 float_prefixes: tuple[str, ...] = ()) -> int:
    """Bytes the tensors take once loaded: floating ones at ``itemsize`` bytes an element, others as stored; with
    ``quantize`` (8 or 4) the quantizable linear weights at ``quantize / 8`` bytes plus a scale and a bias of
    ``itemsize`` bytes per group of :data:`GROUP_SIZE`.

    Raises:
        WeightsError: a dtype that is not a safetensors one.
    """
    total = 0
    for name, shape, dtype in tensors:
        n = math.prod(shape)
        if quantize is not None and dtype in _FLOAT_TYPES and _quantized(name, shape, float_prefixes):
            total += n * quantize // 8 + (n // GROUP_SIZE) * 2 * itemsize
        elif dtype in _FLOAT_TYPES:
            total += n * itemsize
        elif dtype in _OTHER_TYPES:
            total += n * _OTHER_TYPES[dtype]
        else:
            raise WeightsError(f"tensor {name!r}: dtype {dtype!r} is not a safetensors dtype")
    return total


def quantize_transient_bytes(tensors: Iterable[TensorEntry], itemsize: int, *, quantize: int | None,
                             float_prefixes: tuple[str, ...] = ()) -> int:
    """The most a load that quantizes as it reads holds beyond its quantized weights: the largest tensor it
    quantizes, at ``itemsize`` bytes an element (0 without ``quantize``)."""
    if quantize is None:
        return 0
    return max((math.prod(shape) * itemsize for name, shape, dtype in tensors
                if dtype in _FLOAT_TYPES and _quantized(name, shape, float_prefixes)), default=0)


def _transformer_activations(config: Mapping[str, Any], tokens: int, itemsize: int) -> int:
    """One step's transformer activations for ``tokens`` joint tokens (see the module docstring)."""
    heads = int(config.get("num_attention_heads") or config.get("n_heads") or 1)
    width = int(config.get("dim") or heads * int(config.get("attention_head_dim") or 128))
    per_pass = tokens * width * itemsize * LIVE_WIDTHS + SCORE_COPIES * heads * tokens * tokens * itemsize
    return PASSES * per_pass


def _vae_activations(vae_config: Mapping[str, Any], width: int, height: int, tile_side: int | None,
                     itemsize: int) -> int:
    """The VAE decode's activations for one tile (or the whole image when ``tile_side`` is None), plus the decoded
    image in float32: :data:`VAE_FLOATS_PER_PIXEL` per output pixel (``C0``, ``C1``: the channels of the first two
    levels; ``AutoencoderKLQwenImage`` gives ``base_dim * dim_mult``)."""
    blocks = vae_config.get("block_out_channels") or [
        int(vae_config.get("base_dim") or 96) * m for m in (vae_config.get("dim_mult") or [1, 2, 4, 4])]
    c0, c1 = int(blocks[0]), int(blocks[min(1, len(blocks) - 1)])
    tw, th = (width, height) if tile_side is None else (min(width, tile_side), min(height, tile_side))
    a, b = VAE_FLOATS_PER_PIXEL
    return (a * c1 + b * c0) * tw * th * itemsize + width * height * 3 * 4


def activation_bytes(transformer_config: Mapping[str, Any], vae_config: Mapping[str, Any], *, width: int,
                     height: int, itemsize: int, tile_above_pixels: int = 1024 * 1024, tile_side: int = 512) -> int:
    """The upper bound on one step's transformer activations plus the VAE decode's at ``width x height`` pixels
    (see the module docstring), in bytes at ``itemsize`` bytes a float."""
    patch = 16  # pixels per transformer token: every family packs 2x2 latents of an 8x VAE
    tokens = (width // patch) * (height // patch) + TEXT_TOKENS
    tiled = width * height > tile_above_pixels
    return (_transformer_activations(transformer_config, tokens, itemsize)
            + _vae_activations(vae_config, width, height, tile_side if tiled else None, itemsize))


def estimate_memory(components: Mapping[str, Sequence[TensorEntry]], layout: MemoryLayout, *,
                    transformer_config: Mapping[str, Any], vae_config: Mapping[str, Any], itemsize: int,
                    quantize: int | None, width: int, height: int, tile_above_pixels: int = 1024 * 1024,
                    tile_side: int = 512) -> MemoryEstimate:
    """The bytes a pipeline needs, from its components' tensors (see the module docstring).

    Args:
        components: component folder name -> its tensors (``transformer``, ``vae`` and the layout's text folders;
            a text folder that is missing counts 0, as a store text model the folder does not hold).
        layout: the family's :class:`MemoryLayout`. transformer_config, vae_config: their ``config.json``.
        itemsize: bytes of a floating weight and activation on the backend (4 on CPU, 2 on GPUs).
        quantize: None, 8 or 4 (the transformer and the layout's ``text_float`` folders). width, height: the image
            size in pixels.
        tile_above_pixels, tile_side: the VAE decodes tiles of ``tile_side`` pixels above that many pixels.
    """
    acts = activation_bytes(transformer_config, vae_config, width=width, height=height, itemsize=itemsize,
                            tile_above_pixels=tile_above_pixels, tile_side=tile_side)
    t = components["transformer"]
    text = [(components.get(c, ()), quantize if c in layout.text_float else None, layout.text_float.get(c, ()))
            for c in layout.text]
    return MemoryEstimate(
        transformer=weight_bytes(t, itemsize, quantize=quantize, float_prefixes=layout.float_prefixes),
        transformer_transient=quantize_transient_bytes(t, itemsize, quantize=quantize,
                                                       float_prefixes=layout.float_prefixes),
        text=sum(weight_bytes(c, itemsize, quantize=q, float_prefixes=keep) for c, q, keep in text),
        text_transient=max((quantize_transient_bytes(c, itemsize, quantize=q, float_prefixes=keep)
                            for c, q, keep in text), default=0),
        vae=weight_bytes(components["vae"], itemsize), activations=acts, width=width, height=height,
        quantize=quantize)


def estimate_folder(folder: Path, layout: MemoryLayout, *, itemsize: int, quantize: int | None, width: int,
                    height: int, **tiling: int) -> MemoryEstimate:
    """:func:`estimate_memory` of a diffusers folder, from its safetensors headers and configs (no weight is read;
    a text component the folder does not hold, a store model, counts 0).

    Raises:
        WeightsError: a missing component folder, config or weights, or a corrupt header.
    """
    from mlx_engine.imagegen.pipeline import component_folder, read_json

    comps: dict[str, list[TensorEntry]] = {}
    for name in ("transformer", "vae", *layout.text):
        if name in layout.text and not (folder / name).is_dir():
            continue
        comps[name] = folder_tensors(component_folder(folder, name))
    configs = {name: read_json(folder / name / "config.json", f"the {name} config") for name in ("transformer", "vae")}
    return estimate_memory(comps, layout, transformer_config=configs["transformer"], vae_config=configs["vae"],
                           itemsize=itemsize, quantize=quantize, width=width, height=height, **tiling)


def available_memory(backend: Backend) -> int:
    """Bytes the device can still give this process: ``device_memory() - active_memory()``, at most what the system
    has free (psutil's ``available``) plus MLX's cache of freed buffers."""
    import psutil

    device = backend.device_memory() - backend.active_memory()
    system = psutil.virtual_memory().available + backend.cache_memory()
    return max(0, min(device, system))


def check_memory(folder: Path, layout: MemoryLayout, backend: Backend, *, quantize: int | None, width: int,
                 height: int, what: str, **tiling: int) -> MemoryEstimate:
    """Refuse a load whose weights cannot fit: :attr:`MemoryEstimate.weights_peak` of ``folder`` at ``backend``'s
    dtype against :func:`available_memory`. The activations (estimated at ``width x height``, ``tiling`` as
    :func:`estimate_memory`'s ``tile_above_pixels`` and ``tile_side``) are checked per generation, at the size it
    asks for (:func:`check_request_memory`).

    Returns:
        the estimate, when it fits.

    Raises:
        MemoryBudgetError: the weights need more than is available; the message gives both numbers, the parts,
            and whether ``--quantize 8`` / ``4`` would fit.
        WeightsError: as :func:`estimate_folder`.
    """
    itemsize = backend.compute_dtype.itemsize
    est = estimate_folder(folder, layout, itemsize=itemsize, quantize=quantize, width=width, height=height, **tiling)
    have = available_memory(backend)
    if est.weights_peak <= have:
        return est
    advice = []
    for bits in (8, 4):
        if quantize is None or bits < quantize:
            q = estimate_folder(folder, layout, itemsize=itemsize, quantize=bits, width=width, height=height,
                                **tiling)
            if q.weights_peak <= have:
                advice.append(f"--quantize {bits} (quantize={bits}) needs {_gb(q.weights_peak)}")
                break
    hint = "; ".join(advice) if advice else "no setting of this model fits: free memory or use a smaller model"
    raise MemoryBudgetError(
        f"{what} needs {_gb(est.weights_peak)} for its weights (transformer {_gb(est.transformer)}, text encoder "
        f"{_gb(est.text)} while encoding, VAE {_gb(est.vae)}), but {_gb(have)} of memory is available; {hint}")


def check_pipeline_memory(pipe: Any, backend: Backend | None) -> MemoryEstimate | None:
    """What every pipeline's ``__init__`` runs after reading its configs and before reading any weight:
    :func:`check_memory` of ``pipe.folder`` with its ``memory_layout()``, ``quantize`` and default size (None, and no
    check, when ``backend`` is None).

    Raises:
        MemoryBudgetError, WeightsError: as :func:`check_memory`.
    """
    if backend is None:
        return None
    d = pipe.defaults
    return check_memory(pipe.folder, pipe.memory_layout(), backend, quantize=pipe.quantize, width=int(d["width"]),
                        height=int(d["height"]), what=f"the image model {pipe.folder}",
                        tile_above_pixels=pipe.tile_above_pixels, tile_side=pipe.vae_tile * pipe.vae_scale_factor)


def check_request_memory(pipe: Any, width: int, height: int) -> None:
    """Refuse a generation at ``width x height`` that cannot fit beside the loaded pipeline: its activations
    (:func:`activation_bytes`) or its text encoders (loaded for the prompt), whichever is more, against
    :func:`available_memory` of the pipeline's backend (the loaded weights are in its active memory). Nothing is
    checked for a pipeline loaded without ``memory_check`` (``pipe.memory_estimate`` None).

    Raises:
        MemoryBudgetError: the message gives both numbers and what to do (a smaller size).
    """
    est = getattr(pipe, "memory_estimate", None)
    if est is None:
        return
    backend = pipe.backend
    acts = activation_bytes(pipe.transformer_config, pipe.vae_config, width=width, height=height,
                            itemsize=backend.compute_dtype.itemsize, tile_above_pixels=pipe.tile_above_pixels,
                            tile_side=pipe.vae_tile * pipe.vae_scale_factor)
    text = 0 if getattr(pipe, "keep_text_encoder", False) else est.text + est.text_transient
    need, have = max(acts, text), available_memory(backend)
    if need > have:
        raise MemoryBudgetError(
            f"a {width}x{height} image needs {_gb(need)} beside the loaded model (activations {_gb(acts)}, text "
            f"encoder {_gb(text)}), but {_gb(have)} of memory is available; ask for a smaller image")
