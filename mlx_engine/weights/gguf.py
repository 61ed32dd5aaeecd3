"""GGUF reader: typed metadata and memory-mapped tensors.

Format source: the GGUF specification, ``docs/gguf.md`` in ggml / llama.cpp, and its readers (``ggml/src/gguf.cpp``;
``gguf-py/gguf/gguf_reader.py``, the ``gguf`` package). Layout, all little-endian::

    u32 magic "GGUF" | u32 version (2 or 3) | u64 tensor_count | u64 kv_count
    kv_count x   { string key | u32 value_type | value }
    tensor_count x { string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset }
    padding to general.alignment (default 32) | tensor data (each tensor at data_start + offset)

    string = u64 length + UTF-8 bytes;  array value = u32 element_type | u64 count | elements

``dims`` is ggml's order (fastest-varying first); :meth:`GGUFFile.shape` returns NumPy's order (reversed).

The header is parsed here rather than with ``gguf.GGUFReader``: that reader builds one NumPy view per array element
(seconds for Gemma 3's 262,144-token vocabulary) and checks neither sizes nor offsets. This parser
checks every count, length, type, dimension, offset and size against the file size before any data is touched, so a
corrupt or truncated file raises :class:`~mlx_engine.errors.WeightsError` and never reads past the end of the mapping.
The ``gguf`` package still supplies the type enums, block sizes and ``gguf.quants.dequantize``; the test suite checks
this parser against ``gguf.GGUFReader`` on real files.

This module imports NumPy and ``gguf`` (never ``mlx``).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.weights import quant
from mlx_engine.weights.base import Metadata, QuantizedArray, WeightFile, close_mapping

__all__ = ["GGUFFile", "GGUFTensorInfo", "LOSSLESS_TYPES", "open_gguf"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8

#: Types kept quantized without loss, as MLX affine group-32 arrays.
LOSSLESS_TYPES = frozenset(quant.REPACK_BITS)

# Types returned as they are stored (NumPy dtype, little-endian).
_PLAIN_TYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}

_SCALARS: dict[int, tuple[str, int]] = {  # value type -> (struct format, size)
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_ARRAY_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("u1"),
    GGUFValueType.INT8: np.dtype("i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _type_label(t: int) -> str:
    try:
        return GGUFValueType(t).name
    except ValueError:
        return f"type {t}"


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where and how one tensor is stored.

    Attributes:
        name: the tensor's name.
        type_name: the ggml type (``F32``, ``Q4_K``...).
        shape: the logical shape in NumPy order (ggml's ``dims`` reversed).
        offset: absolute byte offset of the data in the file.
        nbytes: stored size in bytes.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType[self.type_name]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last NumPy axis)."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (self.shape[-1] if self.shape else 1) // block * size


class _Header:
    """A bounds-checked cursor over the memory-mapped header."""

    def __init__(self, buf: mmap.mmap, size: int, source: str):
        self.buf, self.size, self.source, self.pos = buf, size, source, 0

    def fail(self, what: str) -> WeightsError:
        return WeightsError(f"{self.source}: {what}")

    def need(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated or corrupt header: {what} at byte {self.pos} needs {n} bytes, "
                            f"the file has {self.size}")
        p = self.pos
        self.pos += n
        return p

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.need(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        p = self.need(n, what)
        try:
            return self.buf[p:p + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} at byte {p} is not valid UTF-8 ({e.reason})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        sc = _SCALARS.get(vtype)
        if sc is not None:
            v = struct.unpack_from(sc[0], self.buf, self.need(sc[1], what))[0]
            if vtype == GGUFValueType.FLOAT32:
                return float(v)
            return v
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        itype = self.u32(f"element type of {what}")
        n = self.u64(f"length of {what}")
        remaining = self.size - self.pos
        dt = _ARRAY_DTYPES.get(itype)
        if dt is not None or itype == GGUFValueType.BOOL:
            itemsize = 1 if dt is None else dt.itemsize
            p = self.need(n * itemsize, f"{n} elements of {what}")
            if dt is None:
                return np.frombuffer(self.buf, np.uint8, n, p) != 0
            arr = np.frombuffer(self.buf, dt, n, p)
            return arr.astype(dt.newbyteorder("="), copy=True)
        if itype == GGUFValueType.STRING:
            if n * 8 > remaining:
                raise self.fail(f"truncated or corrupt header: {what} claims {n} strings, only {remaining} bytes left")
            return self._strings(n, what)
        if itype == GGUFValueType.ARRAY:
            if n * 12 > remaining:
                raise self.fail(f"truncated or corrupt header: {what} claims {n} arrays, only {remaining} bytes left")
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(n)]
        raise self.fail(f"{what} has unknown element type {itype}")

    def _strings(self, n: int, what: str) -> list[str]:
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out = []
        append = out.append
        try:
            for i in range(n):
                if pos + 8 > size:
                    raise self.fail(f"truncated or corrupt header: {what}[{i}] at byte {pos} runs past the end")
                ln = unpack(buf, pos)[0]
                pos += 8
                end = pos + ln
                if end > size:
                    raise self.fail(f"truncated or corrupt header: {what}[{i}] at byte {pos} claims {ln} bytes, "
                                    f"the file has {size}")
                append(buf[pos:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError as e:
            raise self.fail(f"{what}[{len(out)}] at byte {pos} is not valid UTF-8 ({e.reason})") from None
        self.pos = pos
        return out


def _guard(what: str):
    """Turn any exception other than WeightsError into a WeightsError naming the file (and tensor)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except (WeightsError, InvalidRequestError):
                raise
            except Exception as e:  # noqa: BLE001 - every failure must surface as the project's error type
                detail = f" {args[0]!r}" if args and isinstance(args[0], str) else ""
                raise WeightsError(f"{self.path}: {what}{detail} failed: {type(e).__name__}: {e}") from e

        return wrapper

    return deco


class GGUFFile(WeightFile):
    """An open GGUF file: typed metadata plus lazily read, memory-mapped tensors.

    Metadata values (:attr:`metadata`) are Python ``int`` (all integer types), ``float`` (FLOAT32 and FLOAT64),
    ``bool``, ``str`` (UTF-8 decoded); arrays of strings are ``list[str]`` (``tokenizer.ggml.tokens``, ``merges``),
    arrays of numbers are 1-D NumPy arrays of the stored type (``tokenizer.ggml.scores`` float32,
    ``token_type`` int32), arrays of bools NumPy bool arrays, arrays of arrays Python lists. The GGUF version,
    alignment and data offset are attributes, not metadata.

    :meth:`load` returns, by stored type:

    - ``Q4_0``, ``Q4_1``, ``Q8_0``, ``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``, ``Q3_K``, ``Q2_K``, ``IQ4_NL``,
      ``IQ4_XS`` 2-D tensors, and 3-D ones (a mixture of experts' stacked weights, ``[experts, rows, cols]``): a
      lossless :class:`QuantizedArray` (4, 4, 8, 5, 5, 4, 5, 6, 3, 2, 4, 4 bits; group size 32, 16 for Q6_K, Q3_K
      and Q2_K; the IQ4 types with their ``codebook``) whose ``dequantize()`` equals ``gguf.quants.dequantize``
      exactly. Other ranks: float32 (dequantized).
    - other quantized types (the other ``IQ*``, ``TQ*``, ``MXFP4``...): float32 from
      ``gguf.quants.dequantize`` (``Q8_K`` by this package), or, with ``requantize=4`` or ``8`` and a 2-D or 3-D
      shape whose last axis is a multiple of 32, a :class:`QuantizedArray` made by :func:`quant.quantize_affine`
      (MLX's formula).
    - ``F32`` float32, ``F16`` float16, ``BF16`` float32, ``F64`` float64, ``I8``/``I16``/``I32``/``I64`` as stored.
      These are read-only views of the mapping when no conversion is needed; copy one to write to it.

    Raises:
        WeightsError: the file is missing, empty, not GGUF (bad magic), of an unsupported version or byte order, or
            its header is truncated or inconsistent (a count, length, type, dimension, alignment or tensor extent
            that does not fit the file). Messages start with the file's path.
    """

    format = "gguf"

    def __init__(self, path: "str | os.PathLike[str]"):
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        self._file = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------------ parsing

    def _open(self) -> None:
        src = str(self.path)
        try:
            self._file = open(self.path, "rb")
            size = os.fstat(self._file.fileno()).st_size
        except FileNotFoundError:
            raise WeightsError(f"{src}: no such file") from None
        except IsADirectoryError:
            raise WeightsError(f"{src}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise WeightsError(f"{src}: cannot open: {e.strerror or e}") from None
        if size < 24:
            raise WeightsError(f"{src}: not a GGUF file: only {size} bytes (a GGUF header needs at least 24)")
        try:
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise WeightsError(f"{src}: cannot memory-map: {e}") from None
        self.file_size = size
        try:
            self._parse(size)
        except WeightsError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WeightsError(f"{src}: corrupt GGUF header: {type(e).__name__}: {e}") from e

    def _parse(self, size: int) -> None:
        src = str(self.path)
        h = _Header(self._mm, size, src)
        magic = self._mm[0:4]
        if magic != GGUF_MAGIC:
            raise WeightsError(f"{src}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        h.pos = 4
        version = h.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            raise WeightsError(f"{src}: big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise WeightsError(f"{src}: unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = h.u64("tensor count")
        n_kv = h.u64("metadata count")
        # every key-value pair takes at least 8 + 4 + 1 bytes, every tensor info 8 + 4 + 4 + 8
        if n_kv * 13 > size - h.pos:
            raise h.fail(f"truncated or corrupt header: {n_kv} metadata entries cannot fit in {size} bytes")
        if n_tensors * 24 > size - h.pos:
            raise h.fail(f"truncated or corrupt header: {n_tensors} tensors cannot fit in {size} bytes")

        values: dict[str, Any] = {}
        types: dict[str, str] = {}
        for i in range(n_kv):
            key = h.string(f"metadata key #{i}")
            if key in values:
                raise h.fail(f"duplicate metadata key {key!r}")
            vtype = h.u32(f"value type of {key!r}")
            start = h.pos
            values[key] = h.value(vtype, f"metadata {key!r}")
            types[key] = self._describe_type(vtype, start)
        self._metadata = Metadata(values, src)
        self._value_types = types

        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in values:
            alignment = values["general.alignment"]
            if types["general.alignment"] != "UINT32":
                raise h.fail(f"general.alignment should be UINT32, found {types['general.alignment']}")
            if alignment == 0 or alignment & (alignment - 1):
                raise h.fail(f"general.alignment {alignment} is not a power of two")
        self.alignment = alignment

        infos = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = h.string(f"name of tensor #{i}")
            if name in seen:
                raise h.fail(f"duplicate tensor name {name!r}")
            seen.add(name)
            n_dims = h.u32(f"dimension count of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise h.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [h.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            raw_type = h.u32(f"type of tensor {name!r}")
            offset = h.u64(f"offset of tensor {name!r}")
            infos.append((name, dims, raw_type, offset))

        data_start = h.pos + (-h.pos % alignment)
        self.data_offset = data_start
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, raw_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise h.fail(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            for d in dims:
                if d >= 1 << 62:
                    raise h.fail(f"tensor {name!r} has an impossible dimension {d}")
            n_el = 1
            for d in dims:
                n_el *= d
            if block > 1 and not dims:
                raise h.fail(f"tensor {name!r} ({qtype.name}) has no dimensions")
            if dims and dims[0] % block:
                raise h.fail(f"tensor {name!r} ({qtype.name}) has a row of {dims[0]} elements, "
                             f"not a multiple of the block size {block}")
            nbytes = n_el // block * type_size
            if offset % alignment:
                raise h.fail(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {alignment}")
            begin = data_start + offset
            if begin + nbytes > size:
                raise h.fail(f"truncated or corrupt: tensor {name!r} ({qtype.name}, {nbytes} bytes at byte {begin}) "
                             f"extends past the end of the file ({size} bytes)")
            tensors[name] = GGUFTensorInfo(name, qtype.name, tuple(int(d) for d in reversed(dims)), begin, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise h.fail(f"corrupt: tensors {n0!r} (bytes {b0}-{e0}) and {n1!r} (bytes {b1}-{e1}) overlap")
        self._tensors = tensors
        self._names = [info[0] for info in infos]

    def _describe_type(self, vtype: int, start: int) -> str:
        if vtype != GGUFValueType.ARRAY:
            return _type_label(vtype)
        return f"ARRAY[{_type_label(_U32.unpack_from(self._mm, start)[0])}]"

    # ------------------------------------------------------------------------------------------------------- access

    @property
    def metadata(self) -> Metadata:
        return self._metadata

    def metadata_type(self, key: str) -> str:
        """The stored GGUF value type of a metadata key: ``UINT32``, ``STRING``, ``ARRAY[INT32]``..."""
        try:
            return self._value_types[key]
        except KeyError:
            raise WeightsError(f"{self.path}: metadata key {key!r} is missing") from None

    def names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str) -> GGUFTensorInfo:
        """Where and how tensor ``name`` is stored. Raises WeightsError if there is no such tensor."""
        try:
            return self._tensors[name]
        except KeyError:
            raise WeightsError(f"{self.path}: no tensor named {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def type_name(self, name: str) -> str:
        return self.info(name).type_name

    def _buffer(self) -> mmap.mmap:
        if self._mm is None or self._mm.closed:
            raise WeightsError(f"{self.path}: the file is closed")
        return self._mm

    @_guard("reading raw data of tensor")
    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor: a read-only uint8 view ``[*shape[:-1], row_bytes]`` of the mapping (for
        plain types the same bytes, ``[*shape[:-1], shape[-1] * itemsize]``)."""
        t = self.info(name)
        lead = t.shape[:-1]
        if t.nbytes == 0:
            return np.zeros((*lead, t.row_bytes), np.uint8)
        return np.frombuffer(self._buffer(), np.uint8, t.nbytes, t.offset).reshape(*lead, t.row_bytes)

    @_guard("loading tensor")
    def load(self, name: str, requantize: int | None = None) -> "np.ndarray | QuantizedArray":
        """One tensor on the host (see the class docstring for the type of each stored type).

        Args:
            name: the tensor's name.
            requantize: None, 4 or 8: re-quantize 2-D and 3-D tensors of quantized types not in
                :data:`LOSSLESS_TYPES` to this many bits (MLX affine, group size 32) instead of returning float32.
                Ignored for other types.

        Returns:
            a NumPy array in the logical shape (NumPy order), or a :class:`QuantizedArray` ``[rows, cols]`` (or
            ``[experts, rows, cols]``).

        Raises:
            WeightsError: no such tensor, a type this reader cannot decode (``Q8_1``, ``Q1_0``...), or the file
                is closed.
            InvalidRequestError: ``requantize`` is not None, 4 or 8.
        """
        if requantize not in (None, 4, 8):
            raise InvalidRequestError(f"requantize must be None, 4 or 8, not {requantize!r}")
        t = self.info(name)
        buf = self._buffer()
        shape = t.shape
        n_el = int(np.prod(shape, dtype=object)) if shape else 1
        if t.type_name in _PLAIN_TYPES:
            dt = _PLAIN_TYPES[t.type_name]
            if n_el == 0:
                return np.zeros(shape, dt.newbyteorder("="))
            arr = np.frombuffer(buf, dt, n_el, t.offset).reshape(shape)
            return arr if dt.isnative or dt.itemsize == 1 else arr.astype(dt.newbyteorder("="))
        if t.type_name == "BF16":
            if n_el == 0:
                return np.zeros(shape, np.float32)
            return quant.bf16_to_float32(np.frombuffer(buf, "<u2", n_el, t.offset)).reshape(shape)
        rows = n_el // shape[-1] if shape and shape[-1] else 0
        cols = shape[-1] if shape else 1
        lead = tuple(shape[:-2])  # a stack of matrices (experts) stays quantized as one
        if t.type_name in LOSSLESS_TYPES and len(shape) in (2, 3) and n_el:
            dt = quant.BLOCKS[t.type_name]
            blocks = np.frombuffer(buf, dt, t.nbytes // dt.itemsize, t.offset)
            return quant.repack_gguf(blocks, t.type_name, rows, cols).stacked(lead)
        if requantize and len(shape) in (2, 3) and n_el and cols % quant.GROUP_SIZE == 0 \
                and t.type_name not in LOSSLESS_TYPES:
            out = self._dequantize(t, rows, cols)
            return quant.quantize_affine(out, requantize, quant.GROUP_SIZE).stacked(lead)
        return self._dequantize(t, rows, cols).reshape(shape)

    def _dequantize(self, t: GGUFTensorInfo, rows: int, cols: int) -> np.ndarray:
        """float32 ``[rows, cols]`` of a block-quantized tensor, dequantized in chunks of rows."""
        out = np.empty((rows, cols), np.float32)
        if out.size == 0:
            return out
        qtype = t.qtype
        row_bytes = t.row_bytes
        raw = np.frombuffer(self._buffer(), np.uint8, t.nbytes, t.offset).reshape(rows, row_bytes)
        if t.type_name == "Q8_K":
            blocks = np.frombuffer(self._buffer(), quant.Q8_K_BLOCK, t.nbytes // quant.Q8_K_BLOCK.itemsize, t.offset)
            fn = None
        elif qtype in gguf_quants._type_traits or t.type_name in LOSSLESS_TYPES:  # noqa: SLF001
            fn = functools.partial(gguf_quants.dequantize, qtype=qtype)
        else:
            raise WeightsError(f"{self.path}: tensor {t.name!r} has type {t.type_name}, which cannot be dequantized "
                               f"(no dequantizer in gguf {_gguf_version()})")
        step = max(1, (1 << 24) // max(1, cols * 4))
        with np.errstate(all="ignore"):
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                if fn is None:
                    nb = cols // 256
                    out[r0:r1] = quant.dequantize_q8_k(blocks[r0 * nb:r1 * nb]).reshape(r1 - r0, cols)
                else:
                    out[r0:r1] = fn(raw[r0:r1])
        return out

    def close(self) -> None:
        """Release the file handle and mapping. Arrays already returned stay valid (they keep the mapping alive)."""
        mm, self._mm = self._mm, None
        f, self._file = self._file, None
        close_mapping(mm, f)

    def __repr__(self) -> str:
        n = len(self._names) if hasattr(self, "_names") else "?"
        return f"GGUFFile({str(self.path)!r}, version={getattr(self, 'version', '?')}, tensors={n})"


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001
        return "?"


def open_gguf(path: "str | os.PathLike[str]") -> GGUFFile:
    """Open a GGUF file (see :class:`GGUFFile`). Raises WeightsError."""
    return GGUFFile(path)
