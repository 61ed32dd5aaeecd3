"""What a weight reader returns: named host arrays (NumPy) plus typed metadata. Device upload is the backend's job."""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`pack`: uint32 ``[rows, w]`` -> uint8 ``[rows, w * 32 / bits]``."""
    rows = weight.shape[0]
    if bits in (3, 5, 6):
        b = np.ascontiguousarray(weight).astype("<u4").view(np.uint8).reshape(rows, -1, bits)
        padded = np.zeros((rows, b.shape[1], 8), np.uint8)
        padded[:, :, :bits] = b
        v = padded.view("<u8").astype(np.uint64)
        q = (v >> (np.arange(8, dtype=np.uint64) * np.uint64(bits))) & np.uint64((1 << bits) - 1)
        return q.reshape(rows, -1).astype(np.uint8)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    q = (weight[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(rows, -1).astype(np.uint8)


@dataclass
class QuantizedArray:
    """An affine-quantized 2-D weight in MLX's layout: element ``j`` of row ``r`` is
    ``scales[r, j // group_size] * q + biases[r, j // group_size]`` where ``q`` is the ``bits``-bit unsigned integer
    at bit ``bits * (j % (32 // bits))`` of word ``weight[r, j // (32 // bits)]``.

    This is MLX's affine layout (``mx.quantize`` / ``mx.dequantize`` / ``mx.quantized_matmul``), so the three arrays
    upload as they are. GGUF Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K and Q5_K map onto it without loss; see
    :mod:`mlx_engine.weights.quant`.

    A stack of such weights (a mixture of experts' ``[experts, rows, cols]``) has the leading axes on all three arrays.

    Two-level scales (GGUF's K-quants, as the file holds them), per super-block of 256 elements (8 groups of 32, or
    16 of 16): either ``super_scales`` float16 ``[rows, cols / 256, 2]`` holding ``(d, -dmin)`` with ``scales`` and
    ``biases`` the uint8 integers ``sc`` and ``m`` (scale ``d * sc``, bias ``-dmin * m``: Q4_K, Q5_K, Q2_K), or
    ``super_scales`` float16 ``[rows, cols / 256, 1]`` holding ``d`` with ``scales`` int8 integers ``sc`` and
    ``biases`` None (scale ``d * sc``, a symmetric weight: element ``(q - 2**(bits - 1)) * scale``: Q6_K, Q3_K).
    Each product is exact in float32 (:meth:`expanded` makes them). A Q4_K weight so takes 4.625 bits per element
    (its file's 4.5), not 6; a Q6_K one 6.5625, its file's.

    A codebook weight (GGUF's IQ4_NL and IQ4_XS: ``codebook`` int8 ``[16]``, 4 bits, no biases): element
    ``scale * codebook[q]`` (one rounding), the scales float16 (IQ4_NL) or two-level int8 ones (IQ4_XS).

    Attributes:
        weight: uint32 ``[rows, cols * bits / 32]`` (``[experts, rows, cols * bits / 32]`` for a stack).
        scales, biases: float32 or float16 (both the same) ``[rows, cols / group_size]`` (with the same leading axes);
            for two-level scales see above.
        group_size: elements per scale (32 for GGUF types and for re-quantized tensors; 16 for Q6_K, Q3_K, Q2_K,
            which only our CPU kernels run: see ``quant.regroup``).
        bits: 2, 3, 4, 5, 6 or 8.
        codebook: int8 ``[2**bits]``, the values the integers stand for, or None (affine).
    """

    weight: np.ndarray
    scales: np.ndarray
    biases: "np.ndarray | None"
    group_size: int
    bits: int
    super_scales: "np.ndarray | None" = None
    codebook: "np.ndarray | None" = None

    def __post_init__(self) -> None:
        two_level = self.scales.dtype in (np.uint8, np.int8)
        if (self.super_scales is not None) != two_level:
            raise ValueError("two-level scales are integer scales with their super_scales, and only those")
        if self.codebook is not None and (self.biases is not None or self.codebook.shape != (1 << self.bits,)):
            raise ValueError("a codebook weight has no biases and one value per integer")
        if (self.biases is None) != (self.scales.dtype == np.int8 or self.codebook is not None):
            raise ValueError("a weight has biases but for two-level int8 scales or a codebook (a symmetric weight's)")
        if self.super_scales is not None and self.super_scales.shape[-1] != (1 if self.biases is None else 2):
            raise ValueError(f"super scales of shape {self.super_scales.shape} do not fit their scales")

    @property
    def per_super(self) -> int:
        """Groups per super-block of 256 elements (two-level scales)."""
        return 256 // self.group_size

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.weight.shape[:-1], self.weight.shape[-1] * 32 // self.bits)

    def stacked(self, lead: tuple[int, ...]) -> "QuantizedArray":
        """This ``[rows, cols]`` weight as ``[*lead, rows / prod(lead), cols]`` (views, no copy)."""
        sup = self.super_scales
        w, s = (a.reshape(*lead, -1, a.shape[-1]) for a in (self.weight, self.scales))
        b = None if self.biases is None else self.biases.reshape(*lead, -1, self.biases.shape[-1])
        return QuantizedArray(w, s, b, self.group_size, self.bits,
                              None if sup is None else sup.reshape(*lead, -1, *sup.shape[-2:]), self.codebook)

    def expanded(self) -> "QuantizedArray":
        """The same weight with one float32 scale and bias per group (itself when it has them already); a symmetric
        one's biases ``-2**(bits - 1) * scale`` (exact); a codebook weight's scales alone (still no biases)."""
        if self.super_scales is None:
            return self
        sup = np.repeat(self.super_scales.astype(np.float32), self.per_super, axis=-2)
        s = self.scales.astype(np.float32) * sup[..., 0]
        if self.codebook is not None:
            return QuantizedArray(self.weight, s, None, self.group_size, self.bits, codebook=self.codebook)
        if self.biases is None:
            b = s * np.float32(-(2 ** (self.bits - 1)))
        else:
            b = self.biases.astype(np.float32) * sup[..., 1]
        return QuantizedArray(self.weight, s, b, self.group_size, self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays together."""
        return (self.weight.nbytes + self.scales.nbytes + (0 if self.biases is None else self.biases.nbytes)
                + (0 if self.super_scales is None else self.super_scales.nbytes))

    def slice(self, axis: int, start: int, stop: int) -> "QuantizedArray":
        """Rows (``axis=0``) or columns (``axis=1``) ``start .. stop - 1``, still quantized (copies, so that the
        result does not hold a memory-mapped file open). Columns must begin and end on a group boundary.

        Raises:
            ValueError: a range out of bounds, or columns that cut a group of ``group_size``.
        """
        if self.weight.ndim != 2:
            raise ValueError(f"a stack of weights {self.shape} is not cut")
        rows, cols = self.shape
        sup = self.super_scales
        if sup is not None and axis == 1 and (start % 256 or (stop % 256 and stop != cols)):
            return self.expanded().slice(axis, start, stop)  # a cut inside a super-block
        if not 0 <= start < stop <= (rows if axis == 0 else cols):
            raise ValueError(f"slice {start}:{stop} of axis {axis} is out of the weight's shape {self.shape}")
        b = self.biases
        if axis == 0:
            w, s = self.weight[start:stop], self.scales[start:stop]
            b = None if b is None else b[start:stop]
            sup = None if sup is None else sup[start:stop]
        else:
            g = self.group_size
            if start % max(g, 32) or (stop % max(g, 32) and stop != cols):
                raise ValueError(f"columns {start}:{stop} cut a quantization group of {g} (or of 32 elements)")
            # 32 elements fill whole words at every bit width (32 * bits bits)
            w = self.weight[:, start * self.bits // 32:stop * self.bits // 32]
            s = self.scales[:, start // g:-(-stop // g)]
            b = None if b is None else b[:, start // g:-(-stop // g)]
            sup = None if sup is None else sup[:, start // 256:-(-stop // 256)]
        return QuantizedArray(np.ascontiguousarray(w), np.ascontiguousarray(s),
                              None if b is None else np.ascontiguousarray(b), self.group_size, self.bits,
                              None if sup is None else np.ascontiguousarray(sup), self.codebook)

    def dequantize(self, rows_per_chunk: int = 4096, symmetric: bool = False) -> np.ndarray:
        """float32 ``[rows, cols]`` (a stack: ``[experts, rows, cols]``): ``scale * q + bias`` evaluated in float32
        (for GGUF Q4_0, Q4_1 and Q8_0 this equals ``gguf.quants.dequantize`` exactly), or for a symmetric weight of
        two-level scales (``symmetric``, GGUF's Q6_K and Q3_K) ``(q - 2**(bits - 1)) * scale``, exact (``q * scale``
        alone may not be), or for a codebook weight ``codebook[q] * scale`` (one rounding, as ``gguf``'s). Works
        through ``rows_per_chunk`` rows at a time, so the only large allocation is the result."""
        if self.super_scales is not None:
            return self.expanded().dequantize(rows_per_chunk, symmetric=self.biases is None)
        shape = self.shape
        cols = shape[-1]
        weight, scales = (a.reshape(-1, a.shape[-1]) for a in (self.weight, self.scales))
        biases = None if self.biases is None else self.biases.reshape(-1, self.biases.shape[-1])
        rows = weight.shape[0]
        out = np.empty((rows, cols), np.float32)
        for r0 in range(0, rows, rows_per_chunk):
            r1 = min(rows, r0 + rows_per_chunk)
            g = unpack(weight[r0:r1], self.bits)
            g = (g if self.codebook is None else self.codebook[g]).astype(np.float32)
            g = g.reshape(r1 - r0, -1, self.group_size)
            s = scales[r0:r1, :, None].astype(np.float32)
            if self.codebook is not None:
                out[r0:r1] = (g * s).reshape(r1 - r0, cols)
                continue
            b = biases[r0:r1, :, None].astype(np.float32)
            if symmetric:
                out[r0:r1] = ((g - np.float32(2 ** (self.bits - 1))) * s).reshape(r1 - r0, cols)
            else:
                out[r0:r1] = (g * s + b).reshape(r1 - r0, cols)
        return out.reshape(shape)


class Metadata(Mapping[str, Any]):
    """Key-value metadata with typed access. Errors name the file and the key."""

    def __init__(self, values: dict[str, Any], source: str):
        self._values = values
        self.source = source

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def _typed(self, key: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
        from mlx_engine.errors import WeightsError

        if key not in self._values:
            if default is _REQUIRED:
                raise WeightsError(f"{self.source}: metadata key {key!r} is missing")
            return default
        value = self._values[key]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise WeightsError(f"{self.source}: metadata {key!r} should be {what}, found {type(value).__name__}")
        return value

    def get_int(self, key: str, default: Any = None) -> int:
        return self._typed(key, (int, np.integer), _REQUIRED if default is None else default, "an integer")

    def get_float(self, key: str, default: Any = None) -> float:
        v = self._typed(key, (int, float, np.integer, np.floating), _REQUIRED if default is None else default,
                        "a number")
        return float(v)

    def get_str(self, key: str, default: Any = None) -> str:
        return self._typed(key, (str,), _REQUIRED if default is None else default, "a string")

    def get_bool(self, key: str, default: Any = None) -> bool:
        return self._typed(key, (bool,), _REQUIRED if default is None else default, "a boolean")

    def get_list(self, key: str, default: Any = None) -> list:
        return self._typed(key, (list, tuple, np.ndarray), _REQUIRED if default is None else default, "an array")


_REQUIRED = object()


class WeightFile(abc.ABC):
    """An open model file (or folder of shards). Use as a context manager; ``close`` releases file handles."""

    path: Path
    format: str  # "gguf" or "safetensors"

    @property
    @abc.abstractmethod
    def metadata(self) -> Metadata: ...

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Tensor names in file order."""

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape in NumPy order (GGUF's reversed ggml order already undone)."""

    @abc.abstractmethod
    def type_name(self, name: str) -> str:
        """The stored type: ``F32``, ``F16``, ``BF16``, ``Q4_0``, ``Q4_K``... (GGUF's names; safetensors dtypes as
        ``F32``/``F16``/``BF16``/``I32``...)."""

    def nbytes(self, name: str) -> int:
        """Bytes the tensor occupies in the file (as stored, before any unpacking)."""
        return int(self.info(name).nbytes)  # type: ignore[attr-defined]

    def fingerprint(self) -> str:
        """A digest of the tensor table (names, types, shapes, stored sizes) and of the metadata (keys, and values
        or their lengths): two files that differ in model, quantization or tokenizer differ in it."""
        h = hashlib.sha256()
        for name in self.names():
            h.update(f"{name}|{self.type_name(name)}|{self.shape(name)}|{self.nbytes(name)};".encode())
        for key in sorted(self.metadata):
            v = self.metadata[key]
            h.update(f"{key}={f'[{len(v)}]' if isinstance(v, (list, tuple, np.ndarray)) else str(v)[:64]};".encode())
        return h.hexdigest()[:16]

    @abc.abstractmethod
    def load(self, name: str, requantize: int | None = None) -> "np.ndarray | QuantizedArray":
        """One tensor on the host. GGUF's quantized types with an exact affine form (Q4_0 ... Q6_K, see
        ``gguf.LOSSLESS_TYPES``) come back as a lossless :class:`QuantizedArray`; other quantized types dequantized
        to float32 (or re-quantized to ``requantize`` bits, 4 or 8, group 32, when given); F16 as float16, BF16 as
        float32, F32 as float32, integers as stored. Arrays may be read-only views of a memory-mapped file. Raises
        ``WeightsError`` naming the file and tensor (and ``InvalidRequestError`` for a ``requantize`` other than
        None, 4 or 8)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> "WeightFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_mapping(mm: Any, f: Any) -> None:
    """Close a memory map and its file. Arrays already handed out stay valid: while they use the map, closing it
    raises BufferError and it is unmapped when the last of them is freed."""
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass
    if f is not None:
        f.close()
