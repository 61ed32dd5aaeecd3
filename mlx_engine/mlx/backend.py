"""The MLX ``Backend`` and ``Context``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, UnsupportedError
from mlx_engine.ml import ACTIVATIONS, Backend, CacheConfig, Context, DType, LayerFusion, RopeAngles
from mlx_engine.mlx import attention, cpu_kernels, runtime, tensor
from mlx_engine.mlx.runtime import blas_description, mx, select_device, trim_heap
from mlx_engine.mlx.tensor import TO_MX, MLXQuantizedTensor, MLXTensor
from mlx_engine.weights import QuantizedArray, open_weights
from mlx_engine.weights.quant import codebook_to_affine, regroup


_COMPILE_WORKS: "bool | None" = None


def _compile_works() -> bool:
    """Whether ``mx.compile`` can build and run a fused kernel here (checked once per process)."""
    global _COMPILE_WORKS
    if _COMPILE_WORKS is None:
        try:
            probe = mx.compile(lambda x: mx.tanh(x * 0.5) * 2.0 + 1.0)
            _COMPILE_WORKS = bool(np.allclose(np.array(probe(mx.zeros((4,)))), 1.0))
        except Exception:  # noqa: BLE001 (any failure of the JIT: no compiler, no writable temp folder...)
            _COMPILE_WORKS = False
    return _COMPILE_WORKS


class MLXContext(Context):
    """Makes MLX tensors. MLX frees intermediates by reference counting, so closing has nothing to release."""

    def from_numpy(self, array, dtype=None):
        a = mx.array(np.asarray(array))
        return MLXTensor(a if dtype is None else a.astype(TO_MX[dtype]))

    def zeros(self, shape, dtype):
        return MLXTensor(mx.zeros(tuple(shape), dtype=TO_MX[dtype]))

    def full(self, shape, value, dtype):
        return MLXTensor(mx.full(tuple(shape), value, dtype=TO_MX[dtype]))

    def arange(self, start, stop, dtype=DType.INT32):
        return MLXTensor(mx.arange(start, stop, dtype=TO_MX[dtype]))

    def concatenate(self, tensors, axis):
        return MLXTensor(mx.concatenate([t.a for t in tensors], axis=axis))

    def stack(self, tensors, axis=0):
        return MLXTensor(mx.stack([t.a for t in tensors], axis=axis))

    def rope_angles(self, positions, tokens, dims, base, scale, freqs, dtype):
        # Only for our RoPE kernel, whose table this is (bit for bit mx.fast.rope's angles); MLX's own RoPE on a GPU
        # computes them in the kernel.
        if not (runtime.on_cpu and cpu_kernels.rope_apply is not None and dtype == DType.FLOAT32):
            return None
        pos = positions.a if isinstance(positions, MLXTensor) else positions
        if isinstance(pos, int) and tokens == 1 and freqs is None:  # a decode step: a row of a table made once
            cos, sin = cpu_kernels.rope_row(pos, dims, base, scale)
            return RopeAngles(MLXTensor(cos), MLXTensor(sin))
        cos, sin = cpu_kernels.rope_table(tokens, pos, dims, base, scale, None if freqs is None else freqs.a)
        return RopeAngles(MLXTensor(cos), MLXTensor(sin))

    def cached_attention(self, q, k, v, keys, values, cells, scale, mask, angles, dims, traditional):
        return attention.cached_attention(q, k, v, keys, values, cells, scale, mask, angles, dims, traditional)

    def attention_mask(self, visible, dtype):
        return attention.attention_mask(visible, dtype)

    def scaled_dot_product_attention(self, q, k, v, scale, mask=None, softcap=None, sinks=None):
        return attention.attend(q, k, v, scale, mask, softcap, sinks)

    def quantize(self, x, group_size=64, bits=8):
        w, s, b = mx.quantize(x.a, group_size=group_size, bits=bits)
        return MLXTensor(w), MLXTensor(s), MLXTensor(b)

    def dequantize(self, packed, scales, biases, group_size=64, bits=8):
        return MLXTensor(mx.dequantize(packed.a, scales.a, biases.a, group_size=group_size, bits=bits))

    def categorical(self, logits, seed_key):
        return MLXTensor(mx.random.categorical(logits.a, key=seed_key).astype(mx.int32))

    def random_key(self, seed):
        return mx.random.key(int(seed))

    def split_key(self, key):
        k1, k2 = mx.random.split(key)
        return k1, k2

    def random_normal(self, shape, dtype, key):
        return MLXTensor(mx.random.normal(tuple(shape), dtype=TO_MX[dtype], key=key))

    def evaluate(self, *tensors):
        mx.eval(*[t.w if t.is_quantized else t.a for t in tensors])

    def evaluate_async(self, *tensors):
        mx.async_eval(*[t.w if t.is_quantized else t.a for t in tensors])


def _cut(host: "np.ndarray | QuantizedArray", axis: int, start: int, stop: int) -> "np.ndarray | QuantizedArray":
    if isinstance(host, QuantizedArray):
        return host.slice(axis, start, stop)
    index = [slice(None)] * host.ndim
    index[axis] = slice(start, stop)
    return np.ascontiguousarray(host[tuple(index)])


def _e8m0(scales: np.ndarray) -> np.ndarray:
    """MXFP4's scales ``2**(e - 128)`` (float16 or float32, as ``weights.quant`` holds them) -> the exponents ``e``
    (uint8, the file's bytes; exact: each scale is a power of two, ``0.5 * 2**(e - 127)`` in ``frexp``'s terms)."""
    return (np.frexp(scales.astype(np.float32))[1] + 127).astype(np.uint8)


def _symmetric(host: QuantizedArray) -> bool:
    """Whether every bias is ``-2**(bits - 1)`` times its scale, exactly (GGUF's Q8_0, Q4_0 and Q5_0 repacked: a
    signed integer times its scale, stored as an unsigned one with that zero point)."""
    if host.super_scales is not None or host.biases is None:  # a K-quant's: its mins, or none (Q6_K, Q3_K, IQ4)
        return host.biases is None
    return bool(np.array_equal(host.biases, host.scales * np.asarray(-(2 ** (host.bits - 1)), host.scales.dtype)))


def _check_activations(activations: str | None, device: str) -> str:
    """``activations`` as :class:`MLXBackend` takes it (None: the process default), checked for ``device``."""
    if activations is None:
        return cpu_kernels.activations if device == "cpu" else "float32"
    if activations not in ACTIVATIONS:
        raise InvalidRequestError(f"activations must be one of {', '.join(ACTIVATIONS)}, "
                                  f"not {activations!r}")
    if activations != "float32":
        if device != "cpu":
            raise UnsupportedError(f"{activations} activations are a CPU kernel's; on {device} MLX's quantized kernels "
                                   "take the activations in the compute dtype: leave activations unset (or float32)")
        problem = cpu_kernels.activations_problem(activations)
        if problem:
            raise UnsupportedError(f"{activations} activations cannot run here: {problem}; use float32")
    return activations


class MLXBackend(Backend, LayerFusion):
    """Weights from a GGUF file, a safetensors file, or a Hugging Face folder, on an MLX device.

    Args:
        path: the model file or folder.
        device: ``cpu``, ``gpu``, ``metal``, ``cuda`` or None (automatic; see ``mlx_engine.mlx.runtime``).
        dtype: the compute dtype; float weights are cast to it. Default: float32 on CPU (MLX's CPU backend has no
            fast half-precision matmul), ``half_dtype`` on GPUs.
        requantize: re-quantize tensors of quantized types that have no exact form (IQ3_S, TQ2_0...), and on
            GPUs (or without our CPU kernels) those of 16-element groups (Q6_K, Q3_K, Q2_K, which only our CPU
            kernels run), to this many bits (4 or 8, group size 32); 0 keeps them dequantized (float). Default: 8
            where weights stay quantized (the closest MLX form: an 8-bit grid is 4x finer than Q6_K's own), else 0.
            (IQ4_NL, IQ4_XS and MXFP4 keep their codebook on the CPU with our kernels, and are 8-bit affine without
            loss elsewhere.)
        quantized: keep quantized weights quantized. Default: yes on GPUs (``mx.quantized_matmul``), and on the CPU
            where our CPU kernels loaded (:mod:`mlx_engine.mlx.cpu_kernels`); without them, no on the CPU, where
            MLX's own quantized matmul is far slower than a BLAS float32 matmul, so weights are dequantized at load.
        shard: load only part of the file (one rank of a distributed run): ``shard(weight_file)`` returns, for each
            tensor to load, None (all of it) or ``(axis, start, stop)`` (that range of rows or columns); tensors it
            leaves out are not read. Each tensor is read, cut and uploaded alone, so the host never holds more
            than one whole tensor.
        half_dtype: the GPU's default compute dtype (the architecture's :attr:`DecoderModel.half_dtype`).
        transform: ``transform(name, tensor) -> tensor``, applied to each tensor once it is on the device and before
            the next is read; the backend keeps what it returns (an image pipeline quantizes its transformer's
            and text encoders' linear weights so: the float copy is freed before the next tensor is read, and the
            load never holds the whole float model). None: the tensors as read.
        activations: what the CPU's quantized products do with x: ``"float32"`` (the exact product with the
            dequantized weight: the float model's tokens) or ``"int8"`` (x quantized as llama.cpp does for the
            weight's type, per 32 elements as its Q8_0 or per 256 as its Q8_K, and integer dot products: llama.cpp's
            numerics, faster; needs AVX-512 VNNI or AVX2) or ``"int16"``
            (x quantized per 32 elements to 16 bits, d = max|x| / 32639, and the same integer dot products, in
            products of fewer than 64 rows of x, a prompt's taking the float32 kernel: the float path's numerics to a
            few 1e-5, a faster decode than float32; needs AVX-512 VNNI or AVX2).
            Default: ``$MLX_ENGINE_ACTIVATIONS``, else float32.

    Raises:
        WeightsError: the file is missing, truncated or corrupt (the message names it).
        InvalidRequestError: ``activations`` is none of float32, int8, int16.
        UnsupportedError: int8 or int16 activations where they cannot run (a GPU, whose MLX kernels take x as it is;
            a CPU without our kernels, or an x86-64 one without the instructions: the message says which).
    """

    def __init__(self, path: "str | Path | None" = None, *, device: str | None = None, dtype: "DType | str | None" = None,
                 requantize: int | None = None, quantized: bool | None = None,
                 shard: "Callable[[Any], Mapping[str, tuple[int, int, int] | None]] | None" = None,
                 half_dtype: "DType | str" = DType.FLOAT16, activations: str | None = None,
                 transform: "Callable[[str, MLXTensor], MLXTensor] | None" = None):
        self._device = select_device(device)
        self.activations = _check_activations(activations, self._device)
        if quantized is None:
            quantized = self._device != "cpu" or cpu_kernels.qmatmul is not None
        self._keep_quantized = quantized
        if requantize is None:
            requantize = 8 if quantized else 0
        requantize = requantize or None
        self._requantize = requantize
        self._dtype = DType.parse(dtype) if dtype else (DType.FLOAT32 if self._device == "cpu" else
                                                         DType.parse(half_dtype))
        self._weights: dict[str, MLXTensor] = {}
        self._metadata: Mapping[str, Any] = {}
        self.path = Path(path) if path is not None else None
        #: bytes in use on the device before this load (other models): the load's own peak is peak - this
        self.memory_before_load = mx.get_active_memory()
        if path is not None:
            mx.reset_peak_memory()  # so that peak_memory() after the load is the load's own peak
            with open_weights(path) as wf:
                self._metadata = wf.metadata
                self.tensor_types = {n: wf.type_name(n) for n in wf.names()}
                self.tensor_shapes = [wf.shape(n) for n in wf.names()]
                wanted = shard(wf) if shard is not None else dict.fromkeys(wf.names())
                #: what identifies the file's contents to the other ranks of a distributed run
                self.fingerprint = wf.fingerprint()
                for name in wf.names():
                    if name not in wanted:
                        continue
                    host = wf.load(name, requantize=requantize)
                    if wanted[name] is not None:
                        host = _cut(host, *wanted[name])
                    t = self._to_device(host)
                    del host  # the host copy (a converted BF16 tensor) goes before the next is read
                    self._weights[name] = t if transform is None else transform(name, t)
                    del t
        #: bytes of the weights' memory backed by huge pages (Linux, on the CPU: a decode step streams every weight,
        #: and 4 KiB pages cost a TLB miss each; see ``cpu_kernels.huge_pages``); 0 where not
        self.huge_page_bytes = 0
        if self._weights and self._device == "cpu" and cpu_kernels.huge_pages is not None:
            arrays = []
            for t in self._weights.values():
                parts = (t.w, t.scales, t.biases, t.super_scales) if isinstance(t, MLXQuantizedTensor) else (t.a,)
                arrays += [a for a in parts if a is not None]
            self.huge_page_bytes = cpu_kernels.huge_pages(arrays)

    def _to_device(self, host: "np.ndarray | QuantizedArray") -> MLXTensor:
        dt = TO_MX[self._dtype]
        ours = self._device == "cpu" and cpu_kernels.qmatmul is not None
        if isinstance(host, QuantizedArray) and host.group_size == 16 and not ours:
            # MLX's kernels take groups of 32 or more: the closest MLX form, or float
            host = regroup(host, self._requantize) if self._requantize else host.dequantize()
        if isinstance(host, QuantizedArray) and host.codebook is not None and not (
                ours and cpu_kernels.codebook_id(host.codebook)):  # (IQ4_NL's and MXFP4's levels: those ours hold)
            host = codebook_to_affine(host)  # MLX's kernels are affine: 8 bits hold the levels exactly
        if isinstance(host, QuantizedArray) and self._keep_quantized:
            if host.super_scales is not None and not ours:
                host = host.expanded()  # MLX's kernels take one float scale and bias per group
            mxfp4 = ours and cpu_kernels.codebook_id(host.codebook) == cpu_kernels.MXFP4
            s = mx.array(_e8m0(host.scales) if mxfp4 else host.scales)  # MXFP4: its exponents, as the file holds them
            b = None if host.biases is None else mx.array(host.biases)
            if self._device != "cpu":  # mx.quantized_matmul wants them in the compute dtype
                s, b = s.astype(dt), b.astype(dt)
            elif ours and _symmetric(host):
                b = None  # our kernel makes them from the scales: Q8_0 held in its file's 34 bytes per 32, not 36
            sup = None if host.super_scales is None else mx.array(host.super_scales)
            t = MLXQuantizedTensor(mx.array(host.weight), s, b, host.group_size, host.bits, dtype=dt,
                                   activations=self.activations, super_scales=sup,
                                   codebook=None if host.codebook is None else mx.array(host.codebook))
            mx.eval(t.w, t.scales, *([] if b is None else [b]), *([] if sup is None else [sup]))
            return t
        if isinstance(host, QuantizedArray):
            host = host.dequantize()  # on the host, so the device never holds both forms
        a = mx.array(host)
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dt:
            a = a.astype(dt)
        mx.eval(a)
        return MLXTensor(a)

    @property
    def name(self) -> str:
        if self._device == "cpu":
            return f"mlx cpu ({blas_description()}; quantized kernels: {cpu_kernels.status(self.activations)})"
        return f"mlx {self._device}"

    @property
    def device(self) -> str:
        return self._device

    @property
    def compute_dtype(self) -> DType:
        return self._dtype

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self._metadata

    @property
    def weights(self) -> dict[str, MLXTensor]:
        return self._weights

    def weights_nbytes(self) -> int:
        return sum(t.nbytes for t in self._weights.values())

    def new_context(self) -> MLXContext:
        runtime.watch_thread_exit()
        return MLXContext()

    def compile(self, fn):
        """``mx.compile`` of ``fn`` on the arrays behind its Tensor arguments (a quantized weight travels as its
        packed words, scales and biases). One trace per pattern of dense / quantized arguments, and per shape.

        On the CPU, MLX builds fused kernels with the system C++ compiler (once per machine: they are kept in
        ``$TMPDIR/mlx``); where that fails (no compiler), ``fn`` itself is returned and runs op by op.

        Each thread gets its own ``mx.compile`` object: MLX keeps traces in a per-thread cache keyed by the traced
        function's address and, when a compiled function dies, erases them only from the cache of the thread that
        called it last. A function called on two threads (a model warmed on the main thread, then served by a
        scheduler thread) left its trace behind in the other, where a later function allocated at the same address
        was handed the dead one's graph (MLX 0.32.4)."""
        if not _compile_works():
            return fn
        traced: dict[tuple, Any] = {}
        returns_tuple: dict[tuple, bool] = {}

        def call(*tensors):
            spec, flat = [], []  # one pass: this runs twice per layer and decode step
            for t in tensors:
                if isinstance(t, MLXQuantizedTensor):
                    spec.append((t.group_size, t.bits, t._dtype, t.biases is None, t.activations,
                                 t.super_scales is not None, t.codebook_id))
                    flat += (t.w, t.scales) if t.biases is None else (t.w, t.scales, t.biases)
                    if t.super_scales is not None:
                        flat.append(t.super_scales)
                else:
                    spec.append(None)
                    flat.append(t.a)
            spec = tuple(spec)
            key = (threading.get_ident(), spec)
            cfn = traced.get(key)
            if cfn is None:
                def raw(*arrays):
                    it = iter(arrays)
                    args = [MLXTensor(next(it)) if s is None else
                            MLXQuantizedTensor(next(it), next(it), None if s[3] else next(it), *s[:3],
                                               activations=s[4], super_scales=next(it) if s[5] else None,
                                               codebook=mx.array(cpu_kernels.CODEBOOKS[s[6]]) if s[6] else None)
                            for s in spec]
                    out = fn(*args)
                    returns_tuple[spec] = isinstance(out, tuple)
                    return tuple(o.a for o in out) if isinstance(out, tuple) else (out.a,)
                cfn = traced[key] = mx.compile(raw)
            out = cfn(*flat)
            if returns_tuple[spec]:
                return tuple(MLXTensor(a) for a in out)
            return MLXTensor(out[0])

        return call

    def cache_config(self) -> CacheConfig:
        return CacheConfig(padding=1, mask_dtype=self._dtype, step=256)

    def takes_output_mlp(self, dtype, weights, norms, activation):
        return tensor.takes_output_mlp(dtype, weights, norms, activation)

    def output_mlp(self, o, h, o_weight, norm, gate, up, down, activation, eps, o_norm=None, down_norm=None):
        return tensor.output_mlp(o, h, o_weight, norm, gate, up, down, activation, eps, o_norm, down_norm)

    def set_memory_limit(self, nbytes: int) -> int:
        return mx.set_memory_limit(int(nbytes))

    def set_cache_limit(self, nbytes: int) -> int:
        return mx.set_cache_limit(int(nbytes))

    def set_wired_limit(self, nbytes: int) -> int:
        if self._device != "metal":
            return 0
        return mx.set_wired_limit(int(nbytes))

    def active_memory(self) -> int:
        return mx.get_active_memory()

    def peak_memory(self) -> int:
        return mx.get_peak_memory()

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()

    def cache_memory(self) -> int:
        return mx.get_cache_memory()

    def clear_cache(self) -> None:
        mx.clear_cache()
        trim_heap()  # on CPU MLX's freed buffers went back to malloc, whose heap keeps their pages (see trim_heap)

    def device_memory(self) -> int:
        if self._device != "cpu":
            info = mx.device_info()
            for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
                if info.get(key):
                    return int(info[key])
        return super().device_memory()

    def close(self) -> None:
        self._weights.clear()
        self.clear_cache()
