"""The MLX ``Tensor``: a thin wrapper over ``mx.array`` (one attribute, no checks on the hot path)."""

from __future__ import annotations

import operator

import mlx.nn as nn
import numpy as np

from mlx_engine.errors import UnsupportedError
from mlx_engine.ml import DType, RopeAngles, Tensor
from mlx_engine.mlx import cpu_kernels, runtime
from mlx_engine.mlx.runtime import mx

TO_MX = {
    DType.FLOAT32: mx.float32, DType.FLOAT16: mx.float16, DType.BFLOAT16: mx.bfloat16, DType.INT64: mx.int64,
    DType.INT32: mx.int32, DType.UINT32: mx.uint32, DType.INT8: mx.int8, DType.UINT8: mx.uint8, DType.BOOL: mx.bool_,
}
FROM_MX = {v: k for k, v in TO_MX.items()}
_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
            "!=": operator.ne}


def raw(x):
    """The ``mx.array`` behind a Tensor, or a scalar as it is."""
    return x.a if isinstance(x, MLXTensor) else x


def _index(index):
    if isinstance(index, tuple):
        return tuple(raw(i) for i in index)
    return raw(index)


def _matvec(w: "mx.array", x: "mx.array") -> "mx.array":
    """``w [M, K] @ x [K, 1] -> [M, 1]``: one row's linear layer (a decode step), as ``W @ x`` rather than
    ``x @ W^T``. On the CPU MLX hands both to BLAS sgemm; OpenBLAS packs the weight for ``x @ W^T`` but streams it for
    ``W @ x`` in its small-matrix kernel, the faster. Weights over ``runtime.matvec_block`` elements go in row blocks
    that stay in that kernel (a large output head too)."""
    block = runtime.matvec_block
    m, k = w.shape
    if not block or m * k <= block:
        return w @ x
    n = -(-m * k // block)
    rows = -(-m // n)
    while rows * k > block:
        n += 1
        rows = -(-m // n)
    return mx.concatenate([w[i:i + rows] @ x for i in range(0, m, rows)], axis=0)


def _weight_arg(w: "MLXQuantizedTensor") -> tuple:
    """A quantized weight as our kernels' argument tuple (w, scales, biases, group size, bits, super scales,
    codebook)."""
    return (w.w, w.scales, w.biases, w.group_size, w.bits, w.super_scales, w.codebook_id)


class MLXTensor(Tensor):
    __slots__ = ("a",)

    def __init__(self, a: "mx.array"):
        self.a = a

    def __repr__(self) -> str:
        return f"MLXTensor(shape={self.shape}, dtype={self.dtype.value})"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.a.shape)

    @property
    def dtype(self) -> DType:
        return FROM_MX[self.a.dtype]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes

    # arithmetic
    def __add__(self, o):
        return MLXTensor(self.a + raw(o))

    def __radd__(self, o):
        return MLXTensor(raw(o) + self.a)

    def __sub__(self, o):
        return MLXTensor(self.a - raw(o))

    def __rsub__(self, o):
        return MLXTensor(raw(o) - self.a)

    def __mul__(self, o):
        return MLXTensor(self.a * raw(o))

    def __rmul__(self, o):
        return MLXTensor(raw(o) * self.a)

    def __truediv__(self, o):
        return MLXTensor(self.a / raw(o))

    def __neg__(self):
        return MLXTensor(-self.a)

    def matmul(self, other):
        return MLXTensor(self.a @ other.a)

    def linear(self, weight, bias=None):
        if isinstance(weight, MLXQuantizedTensor):
            if runtime.on_cpu and cpu_kernels.qmatmul is not None:
                y = cpu_kernels.qmatmul(self.a, weight.w, weight.scales, weight.biases, weight.group_size, weight.bits,
                                        weight.activations, weight.super_scales, weight.codebook_id)
            else:
                y = mx.quantized_matmul(self.a, weight.w, *weight.float_scales(), transpose=True,
                                        group_size=weight.group_size, bits=weight.bits)
        elif self.a.size == self.a.shape[-1] and weight.a.ndim == 2:
            a = self.a
            y = _matvec(weight.a, a.reshape(a.shape[-1], 1)).reshape(*a.shape[:-1], weight.a.shape[0])
        else:
            y = self.a @ weight.a.T
        if bias is not None:
            y = y + bias.a
        return MLXTensor(y)

    def linear_many(self, weights, biases=None, shapes=None):
        # On the CPU, quantized weights of one input run as one product (one graph node, one parallel job), its
        # outputs made in the shapes asked for (no reshape nodes) when there are no biases to add first.
        if (len(weights) > 1 and runtime.on_cpu and cpu_kernels.qmatmul_many is not None
                and all(isinstance(w, MLXQuantizedTensor) for w in weights)
                and (shapes is None or biases is None or all(b is None for b in biases))):
            ys = cpu_kernels.qmatmul_many(self.a, [w.w for w in weights], [w.scales for w in weights],
                                          [w.biases for w in weights], [w.group_size for w in weights],
                                          [w.bits for w in weights],
                                          None if shapes is None else [list(shape) for shape in shapes],
                                          weights[0].activations, supers=[w.super_scales for w in weights],
                                          codebooks=[w.codebook_id for w in weights])
            biases = biases if biases is not None else [None] * len(weights)
            return [MLXTensor(y if b is None else y + b.a) for y, b in zip(ys, biases)]
        return super().linear_many(weights, biases, shapes)

    def _fused_qmatmul(self, weights, prologue, inputs, shapes=None, out_norms=None, eps=0.0):
        """The products of ``weights`` with their prologue and output norms as one graph node of our CPU kernel
        (``cpu_kernels.qmatmul_many``: each node of a decode step costs MLX scheduling time), or None
        where it does not run them: not on the CPU, a weight not quantized, something not float32."""
        if not (runtime.on_cpu and cpu_kernels.qmatmul_many is not None and self.a.dtype == mx.float32
                and all(isinstance(w, MLXQuantizedTensor) for w in weights)
                and all(t is not None and t.a.dtype == mx.float32 for t in inputs)
                and all(t is None or t.a.dtype == mx.float32 for t in out_norms or ())):
            return None
        return cpu_kernels.qmatmul_many(
            self.a, [w.w for w in weights], [w.scales for w in weights], [w.biases for w in weights],
            [w.group_size for w in weights], [w.bits for w in weights],
            None if shapes is None else [list(shape) for shape in shapes], weights[0].activations, prologue,
            [t.a for t in inputs], None if out_norms is None else [raw(t) for t in out_norms], eps,
            [w.super_scales for w in weights], [w.codebook_id for w in weights])

    def norm_linear(self, weights, norm, eps, residual=None, shapes=None, out_norms=None):
        if residual is None or residual.shape == self.shape:
            prologue, inputs = ("norm", [norm]) if residual is None else ("add_norm", [residual, norm])
            ys = self._fused_qmatmul(weights, prologue, inputs, shapes, out_norms, eps)
            if ys is not None:
                ys = [MLXTensor(y) for y in ys]
                return (self, ys) if residual is None else (ys[0], ys[1:])
        return super().norm_linear(weights, norm, eps, residual, shapes, out_norms)

    def gated_linear(self, up, activation, weight, out_norm=None, eps=0.0):
        if activation in ("silu", "gelu_tanh") and up.shape == self.shape:
            ys = self._fused_qmatmul([weight], activation, [up], None, None if out_norm is None else [out_norm], eps)
            if ys is not None:
                return MLXTensor(ys[0])
        return super().gated_linear(up, activation, weight, out_norm, eps)

    def linear_norm(self, weight, norm, eps):
        ys = self._fused_qmatmul([weight], "none", [], None, [norm], eps)
        return super().linear_norm(weight, norm, eps) if ys is None else MLXTensor(ys[0])

    def exp(self):
        return MLXTensor(mx.exp(self.a))

    def log(self):
        return MLXTensor(mx.log(self.a))

    def sqrt(self):
        return MLXTensor(mx.sqrt(self.a))

    def tanh(self):
        return MLXTensor(mx.tanh(self.a))

    def maximum(self, o):
        return MLXTensor(mx.maximum(self.a, raw(o)))

    def minimum(self, o):
        return MLXTensor(mx.minimum(self.a, raw(o)))

    def compare(self, op, o):
        try:
            fn = _COMPARE[op]
        except KeyError:
            raise ValueError(f"unknown comparison {op!r}; use one of {' '.join(_COMPARE)}") from None
        return MLXTensor(fn(self.a, raw(o)))

    def where(self, if_true, if_false):
        return MLXTensor(mx.where(self.a, raw(if_true), raw(if_false)))

    # reductions
    def sum(self, axis=None, keepdims=False):
        return MLXTensor(mx.sum(self.a, axis=axis, keepdims=keepdims))

    def mean(self, axis=None, keepdims=False):
        return MLXTensor(mx.mean(self.a, axis=axis, keepdims=keepdims))

    def max(self, axis=None, keepdims=False):
        return MLXTensor(mx.max(self.a, axis=axis, keepdims=keepdims))

    def argmax(self, axis=-1):
        return MLXTensor(mx.argmax(self.a, axis=axis))

    def argsort(self, axis=-1, descending=False):
        return MLXTensor(mx.argsort(-self.a if descending else self.a, axis=axis))

    def argpartition(self, kth, axis=-1):
        return MLXTensor(mx.argpartition(self.a, kth, axis=axis))

    def cumsum(self, axis=-1):
        return MLXTensor(mx.cumsum(self.a, axis=axis))

    def logsumexp(self, axis=-1, keepdims=False):
        return MLXTensor(mx.logsumexp(self.a, axis=axis, keepdims=keepdims))

    # shape and indexing
    def reshape(self, *shape):
        return MLXTensor(self.a.reshape(*shape))

    def transpose(self, *axes):
        return MLXTensor(self.a.transpose(*axes))

    def __getitem__(self, index):
        return MLXTensor(self.a[_index(index)])

    def __setitem__(self, index, value):
        self.a[_index(index)] = raw(value)

    def take(self, indices, axis=0):
        return MLXTensor(mx.take(self.a, raw(indices), axis=axis))

    def take_along_axis(self, indices, axis):
        return MLXTensor(mx.take_along_axis(self.a, indices.a, axis=axis))

    def put_along_axis(self, indices, values, axis):
        return MLXTensor(mx.put_along_axis(self.a, indices.a, raw(values), axis=axis))

    def astype(self, dtype):
        to = TO_MX[dtype]
        if (to == mx.float32 and self.a.dtype in (mx.float16, mx.bfloat16) and runtime.on_cpu
                and cpu_kernels.widen is not None):
            return MLXTensor(cpu_kernels.widen(self.a))  # MLX's CPU astype converts one element at a time
        return MLXTensor(self.a.astype(to))

    def copy(self):
        return MLXTensor(mx.contiguous(self.a))

    def gather_linear(self, weight, indices):
        if len(weight.shape) != 3:
            raise UnsupportedError(f"expert weights must be an [experts, out, in] tensor, not {weight.shape}")
        i = raw(indices)
        if isinstance(weight, MLXQuantizedTensor):  # the experts stay quantized
            if runtime.on_cpu and cpu_kernels.gather_qmatmul is not None and cpu_kernels.gather_problem() is None:
                return MLXTensor(cpu_kernels.gather_qmatmul(self.a, weight.w, weight.scales, weight.biases, i,
                                                            weight.group_size, weight.bits, weight.activations,
                                                            weight.super_scales, weight.codebook_id))
            y = mx.gather_qmm(self.a[:, None, None, :], weight.w, *weight.float_scales(), rhs_indices=i,
                              transpose=True, group_size=weight.group_size, bits=weight.bits)
            return MLXTensor(y.squeeze(2))
        y = mx.gather_mm(self.a[:, None, None, :], weight.a.swapaxes(-1, -2), rhs_indices=i)
        return MLXTensor(y.squeeze(2))

    def dequantize(self):
        return self

    def rows(self, rows):
        return MLXTensor(mx.take(self.a, mx.array(rows, dtype=mx.int32), axis=0))

    def quantize_weight(self, group_size=64, bits=8):
        w, s, b = mx.quantize(self.a, group_size=group_size, bits=bits)
        mx.eval(w, s, b)
        return MLXQuantizedTensor(w, s, b, group_size, bits)

    # neural-network operations
    def softmax(self, axis=-1):
        return MLXTensor(mx.softmax(self.a, axis=axis, precise=True))

    def rms_norm(self, weight, eps):
        w = raw(weight)
        if (runtime.on_cpu and cpu_kernels.rms_norm is not None and self.a.dtype == mx.float32
                and (w is None or w.dtype == mx.float32)):
            return MLXTensor(cpu_kernels.rms_norm(self.a, w, eps))  # one graph node, not MLX's four
        return MLXTensor(mx.fast.rms_norm(self.a, w, eps))

    def add_rms_norm(self, residual, weight, eps):
        w = raw(weight)
        if (runtime.on_cpu and cpu_kernels.add_rms_norm is not None and self.a.dtype == mx.float32
                and residual.a.dtype == mx.float32 and residual.shape == self.shape
                and (w is None or w.dtype == mx.float32)):
            s, n = cpu_kernels.add_rms_norm(self.a, residual.a, w, eps)  # one graph node, not two
            return MLXTensor(s), MLXTensor(n)
        return super().add_rms_norm(residual, weight, eps)

    def layer_norm(self, weight, bias, eps):
        return MLXTensor(mx.fast.layer_norm(self.a, raw(weight), raw(bias), eps))

    def group_norm(self, groups, weight, bias, eps):
        # Statistics over (spatial, channels of the group), as torch.nn.GroupNorm.
        x = self.a
        shape = x.shape
        c = shape[-1]
        g = x.reshape(shape[0], -1, groups, c // groups)
        mean = mx.mean(g, axis=(1, 3), keepdims=True)
        var = mx.var(g, axis=(1, 3), keepdims=True)
        y = ((g - mean) * mx.rsqrt(var + eps)).reshape(shape)
        if weight is not None:
            y = y * weight.a
        if bias is not None:
            y = y + bias.a
        return MLXTensor(y)

    def rope(self, positions, dims, base=10000.0, scale=1.0, traditional=False, freqs=None):
        a = self.a
        if isinstance(positions, RopeAngles):  # (MLXContext.rope_angles only makes them for the kernel)
            if not (a.ndim == 4 and a.shape[0] == 1 and a.dtype == mx.float32 and cpu_kernels.rope_apply is not None):
                raise ValueError(f"RoPE angles apply to float32 [1, H, L, Dh] on the CPU kernel, not {a.dtype} "
                                 f"{list(a.shape)}")
            return MLXTensor(cpu_kernels.rope_apply(a, positions.cos.a, positions.sin.a, dims, traditional))
        pos, f = raw(positions), raw(freqs)
        if runtime.on_cpu and cpu_kernels.rope_apply is not None and a.ndim == 4 and a.dtype == mx.float32:
            # MLX runs RoPE on the CPU as ~25 small operations; ours is one (the same result, bit for bit)
            rows = a.shape[2] if isinstance(pos, int) else pos.size
            table = cpu_kernels.rope_table(rows, pos, dims, base, scale, f)
            return MLXTensor(cpu_kernels.rope_apply(a, *table, dims, traditional))
        return MLXTensor(mx.fast.rope(a, dims, traditional=traditional, base=base, scale=scale, offset=pos, freqs=f))

    def gelu(self, approximate=False):
        if approximate and self._activation_kernel():
            return MLXTensor(cpu_kernels.activation(self.a, 1))
        return MLXTensor(nn.gelu_approx(self.a) if approximate else nn.gelu(self.a))

    def silu(self):
        if self._activation_kernel():
            return MLXTensor(cpu_kernels.activation(self.a, 0))
        return MLXTensor(nn.silu(self.a))

    def gated(self, up, activation="silu"):
        if (activation in ("silu", "gelu_tanh") and self._activation_kernel() and up.a.dtype == mx.float32
                and up.shape == self.shape):
            return MLXTensor(cpu_kernels.activation(self.a, 0 if activation == "silu" else 1, up.a))
        return super().gated(up, activation)

    def _activation_kernel(self) -> bool:
        # MLX's CPU backend runs these through scalar expf / tanhf; ours is vectorized
        return runtime.on_cpu and cpu_kernels.activation is not None and self.a.dtype == mx.float32

    def sigmoid(self):
        return MLXTensor(mx.sigmoid(self.a))

    def conv2d(self, weight, bias=None, stride=1, padding=0):
        y = mx.conv2d(self.a, weight.a, stride=stride, padding=padding)
        if bias is not None:
            y = y + bias.a
        return MLXTensor(y)

    def upsample_nearest(self, factor):
        b, h, w, c = self.a.shape
        y = mx.broadcast_to(self.a[:, :, None, :, None, :], (b, h, factor, w, factor, c))
        return MLXTensor(y.reshape(b, h * factor, w * factor, c))

    def numpy(self):
        a = self.a
        if a.dtype == mx.bfloat16:
            a = a.astype(mx.float32)
        return np.array(a, copy=True)


def _e8m0_scales(e: "mx.array") -> "mx.array":
    """MXFP4's exponents ``e`` (uint8) -> its scales ``2**(e - 128)`` float32, from the bits (``e`` 0 and 1: the
    subnormals ``2**-128`` and ``2**-127``), as llama.cpp's ``ggml_e8m0_to_fp32_half``."""
    u = e.astype(mx.uint32)
    return mx.view(mx.where(u >= 2, (u - 1) << 23, mx.array(0x00200000, mx.uint32) << u), mx.float32)


class MLXQuantizedTensor(MLXTensor):
    """An affine-quantized weight ``[rows, cols]`` (MLX's layout): ``w = scale * q + bias`` per group of
    ``group_size`` consecutive elements of a row, ``q`` packed into uint32 words, lowest bits first. A mixture of
    experts' stack ``[experts, rows, cols]`` serves ``gather_linear`` (our CPU kernel's ``gather_qmatmul``, else
    ``mx.gather_qmm``).

    ``linear`` runs our CPU kernel on the CPU (:mod:`mlx_engine.mlx.cpu_kernels`) and ``mx.quantized_matmul``
    elsewhere; ``take(axis=0)`` gathers rows and dequantizes them; any other operation works on the dequantized
    values. Scales and biases may be stored in a narrower dtype than ``dtype`` (float16 where that is exact); they
    are widened to ``dtype`` before any arithmetic, so dequantized values are exact in ``dtype``. ``biases`` None: a
    symmetric weight (GGUF's Q8_0, Q4_0, Q5_0), whose biases are ``-2**(bits - 1) * scales`` (exact: a power of
    two), made where needed instead of held (our CPU kernel makes them per row). ``codebook`` (int8 ``[16]``, 4 bits,
    no biases; GGUF's IQ4_NL, IQ4_XS and MXFP4, on the CPU with our kernels only): element ``scale * codebook[q]``,
    one of the levels our kernels hold (``cpu_kernels.CODEBOOKS``; ValueError for others); MXFP4's scales may be its
    E8M0 exponents ``e`` (uint8, scale ``2**(e - 128)``), as its file holds them.
    """

    __slots__ = ("w", "scales", "biases", "group_size", "bits", "_shape", "_dtype", "activations", "super_scales",
                 "codebook", "codebook_id")

    def __init__(self, w, scales, biases, group_size: int, bits: int, dtype=None, activations: str | None = None,
                 super_scales=None, codebook=None):
        self.w, self.scales, self.biases, self.codebook = w, scales, biases, codebook
        #: the codebook's id in our kernels' arguments (``cpu_kernels.CODEBOOKS``), 0 for an affine weight
        self.codebook_id = cpu_kernels.codebook_id(codebook)
        if codebook is not None and not self.codebook_id:
            raise ValueError("a codebook weight's levels must be IQ4_NL's or MXFP4's (those our kernels hold); make "
                             "others 8-bit affine first (weights.quant.codebook_to_affine)")
        #: two-level scales (GGUF's K-quants on the CPU), per 256 elements: ``scales`` and ``biases`` uint8 integers
        #: ``sc`` and ``m`` with this float16 ``[..., cols / 256, 2]`` holding ``(d, -dmin)`` (scale ``d * sc``, bias
        #: ``-dmin * m``: Q4_K, Q5_K, Q2_K), or int8 ``scales`` and no biases with ``[..., cols / 256, 1]`` holding
        #: ``d`` (a symmetric weight: Q6_K, Q3_K); None for one float scale and bias per group. Groups of 16 (Q6_K,
        #: Q3_K, Q2_K) run in our CPU kernels only (MLX's take 32 or more)
        self.super_scales = super_scales
        self.group_size, self.bits = group_size, bits
        #: what our CPU kernel does with x in products with this weight: "float32" or "int8" (the backend's choice,
        #: else the process default ``cpu_kernels.activations``); MLX's kernels elsewhere take x as it is
        self.activations = activations or cpu_kernels.activations
        self._shape = (*w.shape[:-1], w.shape[-1] * 32 // bits)  # [experts, rows, cols] for a stack
        self._dtype = dtype if dtype is not None else (
            scales.dtype if super_scales is None and scales.dtype != mx.uint8 else mx.float32)

    def __repr__(self) -> str:
        return f"MLXQuantizedTensor(shape={self.shape}, bits={self.bits}, group_size={self.group_size})"

    def float_scales(self, rows=None):
        """Scales and biases (of ``rows``, an index, or all) in :attr:`dtype`."""
        if self.super_scales is not None:  # two-level: the products in float32 (exact), then the dtype
            sup = self.super_scales if rows is None else self.super_scales[rows]
            sup = mx.repeat(sup.astype(mx.float32), 256 // self.group_size, axis=-2)  # [..., groups, 2 or 1]
            s = self.scales if rows is None else self.scales[rows]
            s = s.astype(mx.float32) * sup[..., 0]
            if self.codebook is not None:  # float32, rounded to the dtype once with the levels (_dequantized)
                return s, None
            if self.biases is None:  # int8 scales: a symmetric weight
                return s.astype(self._dtype), (s * -(2 ** (self.bits - 1))).astype(self._dtype)
            b = self.biases if rows is None else self.biases[rows]
            return s.astype(self._dtype), (b.astype(mx.float32) * sup[..., 1]).astype(self._dtype)
        s = self.scales if rows is None else self.scales[rows]
        if self.codebook is not None:  # as stored (float16), rounded to the dtype once with the levels
            return (_e8m0_scales(s) if s.dtype == mx.uint8 else s), None
        if s.dtype != self._dtype:
            s = s.astype(self._dtype)
        if self.biases is None:
            return s, s * -(2 ** (self.bits - 1))
        b = self.biases if rows is None else self.biases[rows]
        return s, (b if b.dtype == self._dtype else b.astype(self._dtype))

    def _dequantized(self, w, s, b):
        """``w`` (this weight's packed rows) with its scales ``s`` and biases ``b`` (from :meth:`float_scales`)."""
        if self.codebook is not None:  # the integers from MLX, each looked up, times its scale (one rounding)
            one = mx.ones(s.shape, mx.float32)
            q = mx.dequantize(w, one, mx.zeros_like(one), group_size=self.group_size, bits=self.bits)
            levels = mx.take(self.codebook.astype(mx.float32), q.astype(mx.int32))
            out = levels.reshape(*s.shape, -1) * s.astype(mx.float32)[..., None]
            return out.reshape(*out.shape[:-2], -1).astype(self._dtype)
        if self.group_size != 16:
            return mx.dequantize(w, s, b, group_size=self.group_size, bits=self.bits)
        # not one of MLX's group sizes: the integers from MLX, the arithmetic here
        one = mx.ones((*w.shape[:-1], s.shape[-1] // 2), self._dtype)
        q = mx.dequantize(w, one, mx.zeros_like(one), group_size=32, bits=self.bits)
        q = q.reshape(*q.shape[:-1], -1, 16)
        if self.biases is None and self.super_scales is not None:  # exact, as our kernels' fused multiply-add
            out = (q - 2 ** (self.bits - 1)) * s[..., None]
        else:
            out = q * s[..., None] + b[..., None]
        return out.reshape(*out.shape[:-2], -1)

    @property
    def a(self):
        return self._dequantized(self.w, *self.float_scales())

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return FROM_MX[self._dtype]

    @property
    def is_quantized(self):
        return True

    @property
    def nbytes(self):
        return (self.w.nbytes + self.scales.nbytes + (0 if self.biases is None else self.biases.nbytes)
                + (0 if self.super_scales is None else self.super_scales.nbytes))

    def rows(self, rows):
        i = mx.array(rows, dtype=mx.int32)
        sup = self.super_scales
        t = MLXQuantizedTensor(mx.take(self.w, i, axis=0), mx.take(self.scales, i, axis=0),
                               None if self.biases is None else mx.take(self.biases, i, axis=0), self.group_size,
                               self.bits, dtype=self._dtype, activations=self.activations,
                               super_scales=None if sup is None else mx.take(sup, i, axis=0), codebook=self.codebook)
        mx.eval(t.w, t.scales, *([] if t.biases is None else [t.biases]),  # apart from the weight it came from
                *([] if sup is None else [t.super_scales]))
        return t

    def take(self, indices, axis=0):
        if axis != 0:
            return super().take(indices, axis)
        i = raw(indices)
        if runtime.on_cpu and cpu_kernels.qtake is not None and self._dtype == mx.float32 and isinstance(i, mx.array):
            # one graph node, where MLX's CPU dequantize is about 20 (the same values, bit for bit)
            return MLXTensor(cpu_kernels.qtake(self.w, self.scales, self.biases, i, self.group_size, self.bits,
                                               self.super_scales, self.codebook_id))
        return MLXTensor(self._dequantized(self.w[i], *self.float_scales(i)))

    def dequantize(self):
        return MLXTensor(self.a)

    def __setitem__(self, index, value):
        raise UnsupportedError("a quantized weight cannot be updated in place; dequantize it first")


def takes_output_mlp(dtype, weights, norms, activation) -> bool:
    """:meth:`LayerFusion.takes_output_mlp`: our CPU kernel runs it (on the CPU, every weight quantized, everything
    float32)."""
    return (runtime.on_cpu and cpu_kernels.output_mlp is not None and activation in ("silu", "gelu_tanh")
            and dtype == DType.FLOAT32 and all(isinstance(w, MLXQuantizedTensor) for w in weights)
            and all(t is None or t.a.dtype == mx.float32 for t in norms))


def output_mlp(o, h, o_weight, norm, gate, up, down, activation, eps, o_norm=None, down_norm=None):
    """:meth:`LayerFusion.output_mlp` by our CPU kernel: one graph node for the six of the operations apart."""
    wo, wg, wu, wd = [_weight_arg(w) for w in (o_weight, gate, up, down)]
    s, m = cpu_kernels.output_mlp(o.a, h.a, wo, norm.a, wg, wu, wd, activation, eps, raw(o_norm), raw(down_norm),
                                  o_weight.activations)
    return MLXTensor(s), MLXTensor(m)
