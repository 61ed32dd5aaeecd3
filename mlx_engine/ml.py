"""The interfaces every model, cache and pipeline is written against: ``Backend``, ``Context``, ``Tensor``.

This module imports nothing of ours but :class:`DType` (``mlx_engine.dtype``: the layer rule of the design note).
``mlx_engine/mlx/`` implements it on MLX; ``models/``, ``kvcache/`` and ``imagegen/`` see only these classes (and
:class:`mlx_engine.group.Group` for a distributed run).

Conventions (fixed here for every implementation):

- Shapes are in NumPy order, outermost first: hidden states ``[B, L, D]``, attention ``[B, H, L, Dh]``, KV cache
  storage ``[1, H_kv, cells, Dh]``, images ``[B, H, W, C]`` (channels last).
- A forward pass over a :class:`mlx_engine.batch.Batch` of ``N`` tokens (from one or several sequences) runs with
  ``B = 1, L = N``: sequences are kept apart by the attention mask, not by the batch axis (ollama's design).
- Masks are additive: ``0`` where a key is visible and ``-inf`` where it is hidden, shape ``[L, cells]`` (broadcast
  over batch and heads).
- Operations return new tensors; only ``Tensor.__setitem__`` changes a tensor in place.
- Computation may be lazy: nothing is guaranteed to have run until ``Context.evaluate`` or a copy out to NumPy.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from mlx_engine.dtype import DType
from mlx_engine.ml_config import ACTIVATIONS, CacheConfig  # noqa: F401 -- part of this interface

Scalar = Union[int, float, bool]
Index = Any  # what NumPy accepts inside [...]: ints, slices, Ellipsis, None, or an integer Tensor


@dataclass(frozen=True)
class RopeAngles:
    """RoPE's cosines and sines for the tokens of one forward pass (:meth:`Context.rope_angles`): ``cos`` and ``sin``
    ``[N, dims / 2]`` float32, row ``i`` for token ``i``, column ``j`` for pair ``j``."""

    cos: "Tensor"
    sin: "Tensor"


class Tensor(abc.ABC):
    """An n-dimensional array on the backend's device.

    Arithmetic operators (``+ - * / @``, unary ``-``) take another Tensor (broadcast by NumPy rules) or a Python
    scalar. Errors: shape mismatches raise ``ValueError`` from the implementation.
    """

    __slots__ = ()

    # ---- description -------------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The shape, NumPy order."""

    @property
    @abc.abstractmethod
    def dtype(self) -> DType:
        """The element type. For a quantized tensor, the dtype it dequantizes to."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of device memory this tensor holds (packed size for a quantized tensor)."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def is_quantized(self) -> bool:
        """True for an affine-quantized weight (see :meth:`linear`, :meth:`take`, :meth:`dequantize`)."""
        return False

    # ---- arithmetic --------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def __add__(self, other: "Tensor | Scalar") -> "Tensor": ...

    @abc.abstractmethod
    def __sub__(self, other: "Tensor | Scalar") -> "Tensor": ...

    @abc.abstractmethod
    def __mul__(self, other: "Tensor | Scalar") -> "Tensor": ...

    @abc.abstractmethod
    def __truediv__(self, other: "Tensor | Scalar") -> "Tensor": ...

    @abc.abstractmethod
    def __rsub__(self, other: Scalar) -> "Tensor": ...

    @abc.abstractmethod
    def __neg__(self) -> "Tensor": ...

    def __radd__(self, other: Scalar) -> "Tensor":
        return self + other

    def __rmul__(self, other: Scalar) -> "Tensor":
        return self * other

    def __matmul__(self, other: "Tensor") -> "Tensor":
        return self.matmul(other)

    @abc.abstractmethod
    def matmul(self, other: "Tensor") -> "Tensor":
        """Batched matrix product ``[..., M, K] @ [..., K, N] -> [..., M, N]``."""

    @abc.abstractmethod
    def linear(self, weight: "Tensor", bias: "Tensor | None" = None) -> "Tensor":
        """``self @ weight.T + bias``: ``[..., in] x [out, in] -> [..., out]``. ``weight`` may be quantized."""

    def linear_many(self, weights: "Sequence[Tensor]", biases: "Sequence[Tensor | None] | None" = None,
                    shapes: "Sequence[tuple[int, ...]] | None" = None) -> "list[Tensor]":
        """``[self.linear(w, b) for w, b in zip(weights, biases)]``: several projections of the same input (a
        layer's queries, keys and values). With ``shapes``, result ``i`` is reshaped to ``shapes[i]`` (the same
        number of elements, row-major order). A backend may run them as one operation; the results are the same."""
        biases = biases if biases is not None else [None] * len(weights)
        ys = [self.linear(w, b) for w, b in zip(weights, biases)]
        return ys if shapes is None else [y.reshape(*shape) for y, shape in zip(ys, shapes)]

    def add_rms_norm(self, residual: "Tensor", weight: "Tensor | None", eps: float) -> "tuple[Tensor, Tensor]":
        """``(s, s.rms_norm(weight, eps))`` with ``s = self + residual`` (same shapes): a residual add and the norm
        after it. A backend may compute both as one operation; the values are the same."""
        s = self + residual
        return s, s.rms_norm(weight, eps)

    def norm_linear(self, weights: "Sequence[Tensor]", norm: "Tensor", eps: float, residual: "Tensor | None" = None,
                    shapes: "Sequence[tuple[int, ...]] | None" = None,
                    out_norms: "Sequence[Tensor | None] | None" = None) -> "tuple[Tensor, list[Tensor]]":
        """A layer's input norm and the projections after it: ``s = self + residual`` (``self`` when ``residual`` is
        None), ``x = s.rms_norm(norm, eps)``, ``ys = x.linear_many(weights, shapes=shapes)``, and each ``ys[i]``
        whose ``out_norms[i]`` is not None RMSNorm-ed over its last axis with it (the per-head query and key norms
        of Qwen3 and Gemma 3); returns ``(s, ys)``. A backend may run it as one operation; the values are the
        same."""
        s, x = (self, self.rms_norm(norm, eps)) if residual is None else self.add_rms_norm(residual, norm, eps)
        ys = x.linear_many(weights, shapes=shapes)
        if out_norms is not None:
            ys = [y if w is None else y.rms_norm(w, eps) for y, w in zip(ys, out_norms)]
        return s, ys

    def gated_linear(self, up: "Tensor", activation: str, weight: "Tensor", out_norm: "Tensor | None" = None,
                     eps: float = 0.0) -> "Tensor":
        """A gated MLP's down projection: ``self.gated(up, activation).linear(weight)``, RMSNorm-ed with
        ``out_norm`` and ``eps`` where given (Gemma 3's norm after the MLP). A backend may run it as one operation;
        the values are the same. Raises ValueError for an activation :meth:`gated` does not know."""
        y = self.gated(up, activation).linear(weight)
        return y if out_norm is None else y.rms_norm(out_norm, eps)

    def linear_norm(self, weight: "Tensor", norm: "Tensor", eps: float) -> "Tensor":
        """``self.linear(weight).rms_norm(norm, eps)`` (Gemma 3's attention output projection and the norm after it).
        A backend may run it as one operation; the values are the same."""
        return self.linear(weight).rms_norm(norm, eps)

    def gated(self, up: "Tensor", activation: str = "silu") -> "Tensor":
        """A gated MLP's product ``act(self) * up`` (same shapes), ``act`` SiLU (``"silu"``, SwiGLU) or the tanh form
        of GELU (``"gelu_tanh"``, GeGLU; Shazeer 2020). A backend may compute it as one operation; the values are the
        same. Raises ValueError for another activation."""
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"gated: activation must be 'silu' or 'gelu_tanh', not {activation!r}")
        g = self.silu() if activation == "silu" else self.gelu(approximate=True)
        return g * up

    @abc.abstractmethod
    def exp(self) -> "Tensor": ...

    @abc.abstractmethod
    def log(self) -> "Tensor": ...

    @abc.abstractmethod
    def sqrt(self) -> "Tensor": ...

    @abc.abstractmethod
    def tanh(self) -> "Tensor": ...

    @abc.abstractmethod
    def maximum(self, other: "Tensor | Scalar") -> "Tensor": ...

    @abc.abstractmethod
    def minimum(self, other: "Tensor | Scalar") -> "Tensor": ...

    @abc.abstractmethod
    def compare(self, op: str, other: "Tensor | Scalar") -> "Tensor":
        """Elementwise comparison, ``op`` one of ``< <= > >= == !=``; returns a BOOL tensor."""

    @abc.abstractmethod
    def where(self, if_true: "Tensor | Scalar", if_false: "Tensor | Scalar") -> "Tensor":
        """``self`` is a BOOL condition; picks from ``if_true`` where it holds, else ``if_false``."""

    # ---- reductions --------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def sum(self, axis: int | None = None, keepdims: bool = False) -> "Tensor": ...

    @abc.abstractmethod
    def mean(self, axis: int | None = None, keepdims: bool = False) -> "Tensor": ...

    @abc.abstractmethod
    def max(self, axis: int | None = None, keepdims: bool = False) -> "Tensor": ...

    @abc.abstractmethod
    def argmax(self, axis: int = -1) -> "Tensor":
        """Index of the largest element along ``axis`` (INT32/UINT32), the axis removed."""

    @abc.abstractmethod
    def argsort(self, axis: int = -1, descending: bool = False) -> "Tensor": ...

    def argpartition(self, kth: int, axis: int = -1) -> "Tensor":
        """Indices that partition ``self`` along ``axis`` around its ``kth`` smallest element
        (``numpy.argpartition``): the first ``kth`` positions index elements no larger, the rest no smaller, in no
        particular order. For the sampler's top-k (a selection instead of a sort of the whole vocabulary). This
        default sorts fully, which is a valid partition; backends override it with a linear-time selection."""
        return self.argsort(axis=axis)

    @abc.abstractmethod
    def cumsum(self, axis: int = -1) -> "Tensor": ...

    @abc.abstractmethod
    def logsumexp(self, axis: int = -1, keepdims: bool = False) -> "Tensor": ...

    # ---- shape and indexing ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def reshape(self, *shape: int) -> "Tensor":
        """A view with a new shape; one entry may be ``-1``."""

    @abc.abstractmethod
    def transpose(self, *axes: int) -> "Tensor":
        """Permute axes (all of them, as ``numpy.transpose``)."""

    @abc.abstractmethod
    def __getitem__(self, index: Index) -> "Tensor":
        """NumPy basic indexing (ints, slices, ``...``, ``None``) and integer-Tensor indexing."""

    @abc.abstractmethod
    def __setitem__(self, index: Index, value: "Tensor | Scalar") -> None:
        """In-place update of a region (a slice update, or a scatter when ``index`` holds an integer Tensor)."""

    @abc.abstractmethod
    def take(self, indices: "Tensor", axis: int = 0) -> "Tensor":
        """Gather along ``axis`` (``numpy.take``). On a quantized ``[rows, cols]`` weight, ``axis=0`` gathers rows and
        returns them dequantized: the embedding lookup."""

    @abc.abstractmethod
    def take_along_axis(self, indices: "Tensor", axis: int) -> "Tensor": ...

    @abc.abstractmethod
    def put_along_axis(self, indices: "Tensor", values: "Tensor", axis: int) -> "Tensor":
        """A copy of ``self`` with ``values`` written at ``indices`` along ``axis`` (``numpy.put_along_axis``)."""

    @abc.abstractmethod
    def astype(self, dtype: DType) -> "Tensor": ...

    @abc.abstractmethod
    def gather_linear(self, weight: "Tensor", indices: "Tensor") -> "Tensor":
        """Mixture-of-experts projection: ``self [N, in]`` row ``n`` through the experts ``indices[n]`` of
        ``weight [E, out, in]`` (``x @ weight[e].T`` each); ``indices`` INT32 ``[N, k]``; returns ``[N, k, out]``."""

    @abc.abstractmethod
    def copy(self) -> "Tensor":
        """The same values in storage of their own: a slice kept this way no longer holds its parent's memory."""

    @abc.abstractmethod
    def dequantize(self) -> "Tensor":
        """A quantized tensor as a dense one in its ``dtype``; a dense tensor is returned as it is."""

    @abc.abstractmethod
    def rows(self, rows: "list[int]") -> "Tensor":
        """Rows ``rows`` (in that order) of a weight ``[rows, cols]``, still quantized where it is (an affine
        weight's rows are independent: their bytes, scales and biases): a fused projection split at load."""

    @abc.abstractmethod
    def quantize_weight(self, group_size: int = 64, bits: int = 8) -> "Tensor":
        """This float weight ``[rows, cols]`` as an affine-quantized weight (``is_quantized``; :meth:`linear` then
        runs a quantized matmul), per group of ``group_size`` consecutive elements of a row (32, 64 or 128), ``bits``
        4 or 8 (see :meth:`Context.quantize`). ``cols`` must be a multiple of ``group_size``. Used to quantize a
        diffusion transformer at load."""

    # ---- neural-network operations -----------------------------------------------------------------------------
    @abc.abstractmethod
    def softmax(self, axis: int = -1) -> "Tensor":
        """Softmax, computed in float32 for accuracy, returned in ``self.dtype``."""

    @abc.abstractmethod
    def rms_norm(self, weight: "Tensor | None", eps: float) -> "Tensor":
        """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last axis (Zhang & Sennrich 2019)."""

    @abc.abstractmethod
    def layer_norm(self, weight: "Tensor | None", bias: "Tensor | None", eps: float) -> "Tensor":
        """Layer normalisation over the last axis (Ba et al. 2016)."""

    @abc.abstractmethod
    def group_norm(self, groups: int, weight: "Tensor | None", bias: "Tensor | None", eps: float) -> "Tensor":
        """Group normalisation of a channels-last ``[B, ..., C]`` tensor (Wu & He 2018), as ``torch.nn.GroupNorm``."""

    @abc.abstractmethod
    def rope(self, positions: "Tensor | int | RopeAngles", dims: int, base: float | None = 10000.0,
             scale: float = 1.0, traditional: bool = False, freqs: "Tensor | None" = None) -> "Tensor":
        """Rotary position embedding (Su et al. 2021, RoFormer) on ``[B, H, L, Dh]``.

        Args:
            positions: an int (the position of token 0; tokens follow contiguously), an INT32 Tensor ``[B]`` of
                start positions, one per batch row, or the :class:`RopeAngles` of the ``L`` tokens from
                :meth:`Context.rope_angles` (then ``B == 1``, and ``base``, ``scale``, ``freqs`` are those it was made
                with and are not read again).
            dims: how many leading features of ``Dh`` are rotated.
            base: the frequency base ``theta``; ``None`` when ``freqs`` is given.
            scale: positions are multiplied by it (linear scaling).
            traditional: rotate interleaved pairs ``(2i, 2i+1)`` (GPT-J / llama.cpp "norm") instead of the halves
                ``(i, i + dims/2)`` (GPT-NeoX / Hugging Face).
            freqs: explicit per-pair periods ``[dims/2]`` replacing ``base ** (2i / dims)`` (the angle of pair ``i`` at
                position ``p`` is ``p / freqs[i]``; MLX's convention), e.g. after Llama 3 frequency scaling.
        """

    @abc.abstractmethod
    def gelu(self, approximate: bool = False) -> "Tensor":
        """GELU (Hendrycks & Gimpel 2016): exact erf form, or the tanh approximation when ``approximate``."""

    @abc.abstractmethod
    def silu(self) -> "Tensor":
        """``x * sigmoid(x)``."""

    @abc.abstractmethod
    def sigmoid(self) -> "Tensor": ...

    @abc.abstractmethod
    def conv2d(self, weight: "Tensor", bias: "Tensor | None" = None, stride: int = 1, padding: int = 0) -> "Tensor":
        """2-D convolution, channels last: ``[B, H, W, Cin] x [Cout, kH, kW, Cin] -> [B, H', W', Cout]``."""

    @abc.abstractmethod
    def upsample_nearest(self, factor: int) -> "Tensor":
        """Nearest-neighbour upsampling of ``[B, H, W, C]`` by an integer factor in H and W."""

    # ---- leaving the device ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def numpy(self) -> np.ndarray:
        """Evaluate and copy to host. BFLOAT16 comes back as float32."""

    def item(self) -> Scalar:
        return self.numpy().item()


class Context(abc.ABC):
    """The scope of one forward pass or one denoising step.

    It makes tensors, starts computation, and lets go of what it made when it closes. Use it as a context manager.
    """

    @abc.abstractmethod
    def from_numpy(self, array: np.ndarray, dtype: DType | None = None) -> Tensor:
        """A device tensor holding a copy of ``array`` (cast to ``dtype`` when given)."""

    def from_list(self, values: Sequence[Any], dtype: DType) -> Tensor:
        return self.from_numpy(np.asarray(values), dtype)

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: DType) -> Tensor: ...

    @abc.abstractmethod
    def full(self, shape: Sequence[int], value: Scalar, dtype: DType) -> Tensor: ...

    @abc.abstractmethod
    def arange(self, start: int, stop: int, dtype: DType = DType.INT32) -> Tensor: ...

    @abc.abstractmethod
    def concatenate(self, tensors: Sequence[Tensor], axis: int) -> Tensor: ...

    @abc.abstractmethod
    def stack(self, tensors: Sequence[Tensor], axis: int = 0) -> Tensor: ...

    @abc.abstractmethod
    def scaled_dot_product_attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float,
                                     mask: "Tensor | str | None" = None, softcap: float | None = None,
                                     sinks: "Tensor | None" = None) -> Tensor:
        """``softmax(q k^T * scale + mask) v`` (Vaswani et al. 2017); with ``softcap``, the scaled scores ``s`` are
        capped to ``softcap * tanh(s / softcap)`` before the mask (Gemma 2); with ``sinks`` ``[Hq]``, each head's
        softmax has one more logit, ``sinks[h]``, whose probability is dropped (attention sinks, gpt-oss:
        transformers' ``eager_attention_forward`` in ``modeling_gpt_oss.py``). A cap and sinks together are refused
        (``UnsupportedError``): no model has both.

        Shapes: ``q [B, Hq, L, Dh]``, ``k, v [B, Hkv, S, Dh]`` with ``Hq`` a multiple of ``Hkv`` (grouped-query
        attention), ``mask`` additive ``[L, S]`` (or broadcastable to ``[B, Hq, L, S]``), the string ``"causal"``
        (query ``i`` sees keys ``0..S-L+i``), or ``None``. Returns ``[B, Hq, L, Dh]``.
        """

    def rope_angles(self, positions: "Tensor | int", tokens: int, dims: int, base: float | None, scale: float,
                    freqs: "Tensor | None", dtype: DType) -> "RopeAngles | None":
        """The angles :meth:`Tensor.rope` would compute for ``tokens`` tokens at ``positions`` (an int: consecutive
        from it; an INT32 Tensor ``[tokens]``: one each), made once so that every layer with this RoPE shares them
        (a decode step would otherwise make them again in each layer). ``None`` where the backend rotates from the
        positions themselves (this default), or for a ``dtype`` it has no such path for; callers then pass the
        positions."""
        return None

    def cached_attention(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, cells: Tensor,
                         scale: float, mask: "Tensor | None", angles: "RopeAngles | None", dims: int,
                         traditional: bool) -> "tuple[Tensor, Tensor, Tensor] | None":
        """A decode step's attention and its KV cache write in one: ``q [1, Hq, N, Dh]`` and the new keys
        ``k [1, Hkv, N, Dh]`` rotated by ``angles`` (as :meth:`Tensor.rope` with ``dims`` and ``traditional``), ``k``
        and ``v [1, Hkv, N, Dv]`` written to cells ``start .. start + N - 1`` of the layer's storage ``keys
        [1, Hkv, C, Dh]`` and ``values [1, Hkv, C, Dv]``, and ``q`` attending to cells ``lo .. hi - 1`` with ``mask``
        (``[N, hi - lo]``, from :meth:`attention_mask`, or None), then unmasked to cells ``lo2 .. hi2 - 1`` (a
        wrapped sliding window's second run; none where ``lo2 == hi2``, always with a mask), as
        :meth:`scaled_dot_product_attention` does over those cells in that order. ``cells`` is an INT32 Tensor
        ``[5]``, ``(start, lo, hi, lo2, hi2)``: a tensor, not numbers, so that a compiled decode step serves every
        position; the caller keeps them in range (``0 <= start <= C - N``, ``0 <= lo < hi <= C``,
        ``0 <= lo2 <= hi2 <= C``) (a backend may give NaN and write nothing otherwise). ``angles`` None: ``q`` and
        ``k`` come rotated.
        ``keys`` and ``values`` may be of a narrower float dtype than ``q`` (a 16-bit cache): ``k`` and ``v`` are
        rounded to it as they are written (as ``astype``), and read back widened.

        Returns ``(o [1, Hq, N, Dv], keys', values')``: the storage after the write, which replaces ``keys`` and
        ``values`` (a backend may write into their buffers: the caller must not use them again). ``None`` (this
        default) where the backend has no such path for these tensors; the caller then rotates, writes and attends
        apart, with the same result."""
        return None

    def attention_mask(self, visible: np.ndarray, dtype: DType) -> Tensor:
        """The additive mask for :meth:`scaled_dot_product_attention` from a host boolean matrix ``visible``
        ``[L, S]`` (True where query ``i`` may see key ``j``): ``0`` where visible, ``-inf`` elsewhere, in ``dtype``.

        Every query must see at least one key. A backend may also remember which keys each block of queries can see,
        so that attention with this mask skips the blocks that are hidden whole (a causal prefill then computes about
        half the scores, a sliding window far fewer); the result is the same. This default builds the mask with
        NumPy.
        """
        mask = np.full(visible.shape, -np.inf, np.float32)
        mask[visible] = 0.0
        return self.from_numpy(mask, dtype)

    @abc.abstractmethod
    def quantize(self, x: Tensor, group_size: int = 64, bits: int = 8) -> tuple[Tensor, Tensor, Tensor]:
        """Affine quantization along the last axis (as ``mx.quantize``): ``x ~ scales * q + biases`` per group of
        ``group_size`` consecutive elements, ``q`` in ``[0, 2**bits)``.

        Args:
            x: a float tensor ``[..., D]`` with ``D`` a multiple of ``group_size``.
            group_size: elements per group (32, 64 or 128).
            bits: bits per element (4 or 8).

        Returns:
            ``(packed, scales, biases)``: packed UINT32 ``[..., D * bits / 32]`` (lowest bits first), scales and biases
            ``[..., D / group_size]`` in ``x.dtype``. Used by quantized KV caches.
        """

    @abc.abstractmethod
    def dequantize(self, packed: Tensor, scales: Tensor, biases: Tensor, group_size: int = 64,
                   bits: int = 8) -> Tensor:
        """The inverse of :meth:`quantize`: ``[..., D]`` in the dtype of ``scales``."""

    @abc.abstractmethod
    def categorical(self, logits: Tensor, seed_key: Any) -> Tensor:
        """Draw one index per row of ``logits [N, V]`` with probability ``softmax(logits)``; returns INT32 ``[N]``.
        ``seed_key`` is a value made by :meth:`random_key`."""

    @abc.abstractmethod
    def random_key(self, seed: int) -> Any:
        """A random-state key from an integer seed; the same seed gives the same draws."""

    @abc.abstractmethod
    def split_key(self, key: Any) -> tuple[Any, Any]:
        """Two independent keys from one."""

    @abc.abstractmethod
    def random_normal(self, shape: Sequence[int], dtype: DType, key: Any) -> Tensor:
        """Standard normal noise (used for diffusion latents)."""

    @abc.abstractmethod
    def evaluate(self, *tensors: Tensor) -> None:
        """Compute the given tensors now (blocking)."""

    @abc.abstractmethod
    def evaluate_async(self, *tensors: Tensor) -> None:
        """Start computing the given tensors and return at once (for pipelined decode)."""

    def close(self) -> None:
        """Let go of intermediates made in this context."""

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LayerFusion(abc.ABC):
    """An optional capability of a :class:`Backend` (checked with ``isinstance``): a decoder layer after attention as
    one operation, where the backend has a kernel for it. The model asks :meth:`takes_output_mlp` once per layer
    (its decode plan) and calls :meth:`output_mlp` only for the layers it accepted."""

    @abc.abstractmethod
    def takes_output_mlp(self, dtype: DType, weights: "Sequence[Tensor]", norms: "Sequence[Tensor | None]",
                         activation: str) -> bool:
        """Whether :meth:`output_mlp` runs as one operation for a layer computing in ``dtype`` with ``weights``
        (output, gate, up, down), ``norms`` (the MLP's input norm, and the norms after the output and down
        projections or None) and ``activation``."""

    @abc.abstractmethod
    def output_mlp(self, o: Tensor, h: Tensor, o_weight: Tensor, norm: Tensor, gate: Tensor, up: Tensor,
                   down: Tensor, activation: str, eps: float, o_norm: "Tensor | None" = None,
                   down_norm: "Tensor | None" = None) -> "tuple[Tensor, Tensor]":
        """A decoder layer after attention, ``o`` the attention output whose rows in row-major order are those of
        ``h [..., D]`` (one token's ``[1, H, 1, Dh]``): ``y = o.linear(o_weight)`` (then RMSNorm-ed with ``o_norm``,
        Gemma 3's), ``s = h + y``, ``x = s.rms_norm(norm, eps)``, ``m = (act(x @ gate) * (x @ up)) @ down`` (then
        RMSNorm-ed with ``down_norm``); returns ``(s, m)``, the layer's output being ``s + m``: the values of
        :meth:`Tensor.linear_norm`, :meth:`Tensor.norm_linear` and :meth:`Tensor.gated_linear` in turn."""


class Backend(abc.ABC):
    """Made from a model file or folder. Owns the weights, the metadata, the device, and the memory controls.

    Errors: constructing one from a missing or corrupt file raises ``mlx_engine.errors.WeightsError``.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The device in words, e.g. ``"mlx cpu (OpenBLAS)"``."""

    @property
    @abc.abstractmethod
    def compute_dtype(self) -> DType:
        """The float type models compute in on this device (float32 on CPU, float16 or bfloat16 on GPUs)."""

    @property
    @abc.abstractmethod
    def metadata(self) -> Mapping[str, Any]:
        """Key-value metadata of the model file (GGUF keys, or ``config.json`` flattened with its keys)."""

    @property
    @abc.abstractmethod
    def weights(self) -> Mapping[str, Tensor]:
        """The model's tensors by the names in the file."""

    @abc.abstractmethod
    def new_context(self) -> Context: ...

    def cache_config(self) -> CacheConfig:
        """The KV cache layout this backend prefers."""
        return CacheConfig()

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A function that computes what ``fn`` computes, which the backend may trace once per input shape and dtype
        and run as one fused graph (MLX: ``mx.compile``), with no per-operation Python cost.

        ``fn`` takes Tensors (positional) and returns a Tensor or a tuple of Tensors. It must be a pure function of
        its arguments: whatever else it reads (Python numbers, captured tensors) is frozen when it is first traced,
        and it must not change a tensor in place. Calls with tensors of a new shape or dtype trace it again. The
        default returns ``fn`` itself.
        """
        return fn

    # ---- memory controls (bytes) ---------------------------------------------------------------------------
    @abc.abstractmethod
    def set_memory_limit(self, nbytes: int) -> int:
        """Limit device memory; returns the previous limit."""

    @abc.abstractmethod
    def set_cache_limit(self, nbytes: int) -> int:
        """Limit the allocator's cache of freed buffers; returns the previous limit."""

    @abc.abstractmethod
    def set_wired_limit(self, nbytes: int) -> int:
        """Wire (pin) up to this much memory (Metal only; a no-op elsewhere). Opt-in; returns the previous limit."""

    @abc.abstractmethod
    def active_memory(self) -> int: ...

    @abc.abstractmethod
    def peak_memory(self) -> int: ...

    @abc.abstractmethod
    def reset_peak_memory(self) -> None: ...

    @abc.abstractmethod
    def cache_memory(self) -> int:
        """Bytes of freed buffers the allocator keeps for reuse (what :meth:`clear_cache` gives back)."""

    @abc.abstractmethod
    def clear_cache(self) -> None:
        """Return the allocator's cached buffers, and the free pages of the heap they came from, to the system."""

    def device_memory(self) -> int:
        """Bytes of memory the device has: the machine's physical memory unless the backend knows better (a GPU's
        own memory, or the working set Metal recommends)."""
        import os

        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return 1 << 40  # unknown: do not refuse on a guess

    def close(self) -> None:
        """Drop the weights."""

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)
