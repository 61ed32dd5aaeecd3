"""Quantizing the linear weights of an image pipeline's diffusion transformer and text encoders (``--quantize 8|4``),
shared by the image families.

The rule (:func:`quantizer`) is applied per tensor: by the backend as it reads each one (:func:`quantizing`, what the
pipelines load the transformer and the text encoders with, so that neither is ever held whole in float), or to a
backend already loaded in float (:func:`quantize_linears`, the transformers' ``from_backend(..., quantize_bits=...)``).
Both quantize the same float tensor with the same ``Tensor.quantize_weight`` (MLX's affine ``mx.quantize``), so they
give the same bits. The text encoders quantize at the transformer's group size, 64. ``--quantize`` leaves CLIP and
the VAEs as stored: they are small (FLUX.1's CLIP 123 M parameters, the VAEs under 130 M, mostly convolutions) beside
the transformers and the other text encoders (4 to 24 B).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from mlx_engine.ml import Backend, Tensor

__all__ = ["quantizer", "quantize_linears", "quantizing", "transformer_backend", "TEXT_MODEL_FLOAT", "T5_FLOAT"]

#: What ``--quantize`` leaves as stored in a decoder text encoder's folder (Qwen-Image's Qwen2.5-VL, FLUX.2 dev's
#: Mistral 3): the vision towers and projectors saved beside the language model. Qwen-Image-Edit runs Qwen2.5-VL's
#: tower on its input images in float; Mistral 3's is never run. Everything else of the language model quantizes,
#: its token embedding too (the text models read quantized embeddings, as GGUF and mlx-lm's folders ship them).
TEXT_MODEL_FLOAT = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                    "model.multi_modal_projector.")
#: What ``--quantize`` leaves as stored in T5: its tables read by row rather than multiplied, the token embedding
#: (``shared``, or ``encoder.embed_tokens``) and the first block's relative position bias ``[buckets, heads]``.
T5_FLOAT = ("shared.", "encoder.embed_tokens.", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.")


def quantizer(bits: int, group_size: int, keep_float: tuple[str, ...]) -> Callable[[str, Tensor], Tensor]:
    """The per-tensor rule of a pipeline component's quantization (transformer or text encoder): ``q(name, t)``
    returns ``t`` affine-quantized (:meth:`Tensor.quantize_weight`, ``bits`` and ``group_size``) when it is a 2-D
    float ``*.weight`` of more than one row whose input width is a multiple of ``group_size`` and whose name starts
    with none of ``keep_float``, else ``t`` itself. Given to the backend as its load ``transform``
    (:func:`quantizing`), each weight is quantized as it is read.

    Raises:
        ValueError: ``bits`` not 4 or 8, or ``group_size`` not 32, 64 or 128.
    """
    if bits not in (4, 8):
        raise ValueError(f"quantize_bits must be 4 or 8, got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")

    def quantize(name: str, t: Tensor) -> Tensor:
        if (name.endswith(".weight") and t.ndim == 2 and not t.is_quantized and not name.startswith(keep_float)
                and t.shape[1] % group_size == 0 and t.shape[0] > 1):
            return t.quantize_weight(group_size, bits)
        return t

    return quantize


def quantize_linears(backend: Backend, weights: dict[str, Tensor], bits: int, group_size: int,
                     keep_float: tuple[str, ...]) -> dict[str, Tensor]:
    """A loaded component's linear weights quantized by :func:`quantizer`'s rule (those the backend
    already quantized at load stay as they are). The float copies are dropped from ``backend.weights`` (freed).
    Returns the new name -> tensor map.

    Raises:
        ValueError: as :func:`quantizer`.
    """
    q = quantizer(bits, group_size, keep_float)
    out = dict(weights)
    for name, t in weights.items():
        qt = q(name, t)
        if qt is not t:
            out[name] = backend.weights[name] = qt  # the float copy is freed
    return out


def quantizing(make_backend: Callable[..., Backend], quantize: int | None, keep_float: tuple[str, ...],
               group_size: int = 64) -> Callable[[Path], Backend]:
    """A backend factory for a pipeline component: ``make_backend`` itself without ``quantize``, else
    ``folder -> make_backend(folder, transform=quantizer(quantize, group_size, keep_float))``, whose backends quantize
    each linear weight as it is read: the load's peak is the quantized component plus one float tensor (not the
    whole float component), and the result is bit for bit that of quantizing after the load
    (:func:`quantize_linears`: the same ``Tensor.quantize_weight`` of the same float tensor).

    Raises:
        ValueError: as :func:`quantizer`.
    """
    if quantize is None:
        return make_backend
    return functools.partial(make_backend, transform=quantizer(quantize, group_size, keep_float))


def transformer_backend(make_backend: Callable[..., Backend], folder: Path, quantize: int | None,
                        keep_float: tuple[str, ...], group_size: int = 64) -> Backend:
    """A pipeline's transformer backend: ``quantizing(make_backend, quantize, keep_float, group_size)(folder)``.

    Raises:
        ValueError: as :func:`quantizer`; WeightsError: as ``make_backend``.
    """
    return quantizing(make_backend, quantize, keep_float, group_size)(folder)
