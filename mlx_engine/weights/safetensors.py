"""safetensors reader: single files and sharded Hugging Face folders, memory-mapped and read tensor by tensor.

Format source: https://github.com/huggingface/safetensors (README, "Format"; ``safetensors/src/tensor.rs``)::

    u64 N (little-endian) | N bytes of UTF-8 JSON header | byte buffer
    header = {"__metadata__": {str: str}  (optional),
              name: {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...}

Offsets are relative to the start of the byte buffer (byte ``8 + N`` of the file); data is little-endian, C order.
Sharded checkpoints add ``<prefix>.safetensors.index.json`` = ``{"metadata": {...}, "weight_map": {name: file}}``.

The header is parsed and checked here (not by the ``safetensors`` package): the length fits the file, the JSON is an
object without duplicate keys, every dtype is known, ``prod(shape) * itemsize == end - begin``, every tensor lies
inside the file and no two overlap. Only then is the file memory-mapped, so a corrupt or truncated file raises
:class:`~mlx_engine.errors.WeightsError` and never reads past the end of the mapping.

mlx-community quantized folders (``config.json`` with ``"quantization": {"group_size": 64, "bits": 4}`` and optional
per-module overrides) store a quantized linear ``p`` as ``p.weight`` (U32), ``p.scales`` and ``p.biases``: these come
back as one :class:`QuantizedArray` under ``p.weight`` (2-D, or 3-D for mlx-lm's stacked experts ``switch_mlp``;
affine mode, 2, 3, 4, 5, 6 or 8 bits, each module at its own width), and ``p.scales`` / ``p.biases`` are not listed
separately.

This module imports NumPy only (never ``mlx``).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError, WeightsError
from mlx_engine.weights import quant
from mlx_engine.weights.base import Metadata, QuantizedArray, WeightFile, close_mapping

__all__ = ["DTYPES", "SafetensorsFile", "SafetensorsTensorInfo", "open_safetensors"]

MAX_HEADER_BYTES = 100_000_000  # the safetensors package's limit

#: safetensors dtype -> (storage dtype, itemsize)
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("u1"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
}
_CONVERT = {
    "BOOL": lambda a: a != 0,
    "BF16": quant.bf16_to_float32,
    "F8_E4M3": quant.fp8_e4m3fn_to_float32,
    "F8_E5M2": quant.fp8_e5m2_to_float32,
    "F8_E8M0": quant.fp8_e8m0_to_float32,
}


@dataclass(frozen=True)
class SafetensorsTensorInfo:
    """One tensor of a safetensors file: dtype name, shape (NumPy order), absolute byte offset and size, and file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: Path


class _Shard:
    """One .safetensors file: the validated header and a read-only memory map of the whole file."""

    def __init__(self, path: Path):
        self.path = path
        self.mm: mmap.mmap | None = None
        self._file = None
        src = str(path)
        try:
            self._file = open(path, "rb")
            size = os.fstat(self._file.fileno()).st_size
        except FileNotFoundError:
            raise WeightsError(f"{src}: no such file") from None
        except IsADirectoryError:
            raise WeightsError(f"{src}: is a directory, not a safetensors file") from None
        except OSError as e:
            raise WeightsError(f"{src}: cannot open: {e.strerror or e}") from None
        try:
            self._parse(size)
        except BaseException:
            self.close()
            raise

    def _parse(self, size: int) -> None:
        src = str(self.path)
        if size < 8:
            raise WeightsError(f"{src}: not a safetensors file: only {size} bytes (the header length alone is 8)")
        head = self._file.read(8)
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER_BYTES:
            raise WeightsError(f"{src}: corrupt safetensors header: header length {n} exceeds {MAX_HEADER_BYTES}")
        if 8 + n > size:
            raise WeightsError(f"{src}: truncated or corrupt safetensors file: the header claims {n} bytes, "
                               f"the file has {size - 8} after the length")
        raw = self._file.read(n)
        if len(raw) != n:
            raise WeightsError(f"{src}: truncated safetensors header")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise WeightsError(f"{src}: corrupt safetensors header: not UTF-8 ({e.reason} at byte {8 + e.start})") \
                from None
        if not text.lstrip().startswith("{"):
            raise WeightsError(f"{src}: corrupt safetensors header: not a JSON object")
        try:
            header = json.loads(text, object_pairs_hook=_no_duplicates)
        except _DuplicateKey as e:
            raise WeightsError(f"{src}: corrupt safetensors header: duplicate key {e.args[0]!r}") from None
        except (ValueError, RecursionError) as e:
            raise WeightsError(f"{src}: corrupt safetensors header: invalid JSON ({e})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{src}: corrupt safetensors header: not a JSON object")
        meta = header.pop("__metadata__", None)
        if meta is None:
            meta = {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise WeightsError(f"{src}: corrupt safetensors header: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        data_start = 8 + n
        buffer_len = size - data_start
        entries: dict[str, SafetensorsTensorInfo] = {}
        for name, spec in header.items():
            entries[name] = self._entry(name, spec, data_start, buffer_len)
        spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise WeightsError(f"{src}: corrupt safetensors header: tensors {n0!r} (bytes {b0}-{e0}) and "
                                   f"{n1!r} (bytes {b1}-{e1}) overlap")
        self.entries = entries
        # file order: by position in the byte buffer
        self.order = [name for _, name in sorted((e.offset, name) for name, e in entries.items())]
        if size > 0:
            try:
                self.mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise WeightsError(f"{src}: cannot memory-map: {e}") from None
        self.size = size

    def _entry(self, name: str, spec: Any, data_start: int, buffer_len: int) -> SafetensorsTensorInfo:
        src = str(self.path)
        bad = f"{src}: corrupt safetensors header: tensor {name!r}"
        if not isinstance(spec, dict):
            raise WeightsError(f"{bad} is not an object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in spec:
                raise WeightsError(f"{bad} has no {key!r}")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WeightsError(f"{bad} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise WeightsError(f"{bad} has an invalid shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise WeightsError(f"{bad} has invalid data_offsets {offsets!r}")
        n_el = 1
        for d in shape:
            n_el *= d
        nbytes = n_el * DTYPES[dtype].itemsize
        begin, end = offsets
        if end - begin != nbytes:
            raise WeightsError(f"{bad}: {dtype} {shape} needs {nbytes} bytes, data_offsets {offsets} hold "
                               f"{end - begin}")
        if end > buffer_len:
            raise WeightsError(f"{src}: truncated or corrupt: tensor {name!r} ends at byte {data_start + end}, "
                               f"the file has {data_start + buffer_len}")
        return SafetensorsTensorInfo(name, dtype, tuple(shape), data_start + begin, nbytes, self.path)

    def array(self, e: SafetensorsTensorInfo) -> np.ndarray:
        """The stored tensor, converted (BF16 and FP8 to float32, BOOL to bool); read-only when not converted."""
        if self.mm is None or self.mm.closed:
            raise WeightsError(f"{self.path}: the file is closed")
        dt = DTYPES[e.dtype]
        if e.nbytes == 0:
            a = np.zeros(e.shape, dt)
        else:
            a = np.frombuffer(self.mm, dt, e.nbytes // dt.itemsize, e.offset).reshape(e.shape)
        conv = _CONVERT.get(e.dtype)
        if conv is not None:
            with np.errstate(all="ignore"):
                return conv(a)
        if not a.dtype.isnative and a.dtype.itemsize > 1:
            a = a.astype(a.dtype.newbyteorder("="))
        return a

    def close(self) -> None:
        mm, self.mm = self.mm, None
        f, self._file = self._file, None
        close_mapping(mm, f)


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WeightsError(f"{path}: no such file ({what})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: cannot read {what}: {e}") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise WeightsError(f"{path}: invalid JSON in {what}: {e}") from None


@dataclass(frozen=True)
class _QuantGroup:
    scales: str
    biases: str
    group_size: int
    bits: int


class SafetensorsFile(WeightFile):
    """A safetensors checkpoint: one file, or the shards of a folder listed by an index. Tensors are read lazily.

    Args:
        files: the .safetensors files (their tensors are merged; a name in two files is an error).
        path: what was opened (a file or folder), used in messages.
        config: the folder's ``config.json`` (a dict), or None.
        index_metadata: the index's ``"metadata"`` object, if any.
        index: ``weight_map`` of the index: every name listed must be in the file it names.

    :attr:`metadata` holds ``config.json``'s keys as they are (nested objects stay dicts) plus ``"__metadata__"``:
    the safetensors header metadata (``{str: str}``, merged over shards, the first shard winning) updated with the
    index's ``metadata``.

    :meth:`load` returns F32 float32, F16 float16, BF16 float32 (exact), F64 float64, the FP8 types float32,
    integers as stored, BOOL as bool; read-only views of the mapping when no conversion is needed.
    :meth:`type_name` returns the safetensors dtype (``F32``, ``BF16``, ``I64``...), or ``MLX_Q<bits>_G<group>`` for an
    mlx-community quantized weight.

    Raises:
        WeightsError: a missing or corrupt file or shard, an index naming a tensor its shard does not hold, a name
            in two shards, an unreadable ``config.json``. Messages start with the offending file's path.
    """

    format = "safetensors"

    def __init__(self, files: list[Path], *, path: Path, config: dict | None = None,
                 index_metadata: dict | None = None, index: dict[str, str] | None = None):
        self.path = Path(path)
        self._shards: list[_Shard] = []
        try:
            self._init(files, config, index_metadata, index)
        except BaseException:
            self.close()
            raise

    def _init(self, files, config, index_metadata, index) -> None:
        self._entries: dict[str, tuple[_Shard, SafetensorsTensorInfo]] = {}
        order: list[str] = []
        header_meta: dict[str, Any] = {}
        for f in files:
            shard = _Shard(Path(f))
            self._shards.append(shard)
            for k, v in shard.metadata.items():
                header_meta.setdefault(k, v)
            for name in shard.order:
                if name in self._entries:
                    raise WeightsError(f"{shard.path}: tensor {name!r} is also in {self._entries[name][0].path}")
                self._entries[name] = (shard, shard.entries[name])
                order.append(name)
        if index:
            for name, fname in index.items():
                got = self._entries.get(name)
                if got is None or got[0].path != self.path / fname:
                    raise WeightsError(f"{self.path}: the index puts tensor {name!r} in {fname}, "
                                       f"which does not hold it")
        if index_metadata:
            header_meta.update(index_metadata)
        values = dict(config or {})
        values["__metadata__"] = header_meta
        self._metadata = Metadata(values, str(self.path))
        self._quant = self._find_quantized(config or {})
        hidden = {g.scales for g in self._quant.values()} | {g.biases for g in self._quant.values()}
        self._names = [n for n in order if n not in hidden]
        self._listed = set(self._names)

    def _find_quantized(self, config: dict) -> dict[str, _QuantGroup]:
        q = config.get("quantization")
        if not isinstance(q, dict):
            q = config.get("quantization_config")
            if not isinstance(q, dict) or "quant_method" in q:
                return {}
        groups: dict[str, _QuantGroup] = {}
        for name, (_, e) in self._entries.items():
            if not name.endswith(".weight") or e.dtype != "U32":
                continue
            prefix = name[: -len(".weight")]
            scales, biases = prefix + ".scales", prefix + ".biases"
            if scales not in self._entries or biases not in self._entries:
                continue
            params = q.get(prefix)
            params = params if isinstance(params, dict) else q
            mode = params.get("mode", "affine")
            gs, bits = params.get("group_size", 64), params.get("bits", 4)
            if mode != "affine" or not _is_int(gs) or not _is_int(bits) or gs <= 0:
                continue
            groups[name] = _QuantGroup(scales, biases, gs, bits)
        return groups

    @property
    def metadata(self) -> Metadata:
        return self._metadata

    @property
    def files(self) -> list[Path]:
        """The .safetensors files, in the order read."""
        return [s.path for s in self._shards]

    def names(self) -> list[str]:
        return list(self._names)

    def _get(self, name: str) -> tuple[_Shard, SafetensorsTensorInfo]:
        got = self._entries.get(name)
        if got is None or name not in self._listed:
            raise WeightsError(f"{self.path}: no tensor named {name!r}")
        return got

    def info(self, name: str) -> SafetensorsTensorInfo:
        """The stored tensor (for a quantized weight, its packed U32 ``weight``). Raises WeightsError."""
        return self._get(name)[1]

    def shape(self, name: str) -> tuple[int, ...]:
        e = self.info(name)
        g = self._quant.get(name)
        if g is not None and len(e.shape) == 2 and e.shape[1] * 32 % g.bits == 0:
            return (e.shape[0], e.shape[1] * 32 // g.bits)
        return e.shape

    def type_name(self, name: str) -> str:
        e = self.info(name)
        g = self._quant.get(name)
        return f"MLX_Q{g.bits}_G{g.group_size}" if g is not None else e.dtype

    def load(self, name: str, requantize: int | None = None) -> "np.ndarray | QuantizedArray":
        """One tensor on the host (see the class docstring). ``requantize`` is accepted for the common interface;
        safetensors hold no GGUF block types, so it changes nothing.

        Raises:
            WeightsError: no such tensor, an inconsistent quantized triple, or the file is closed.
            InvalidRequestError: ``requantize`` is not None, 4 or 8.
        """
        if requantize not in (None, 4, 8):
            raise InvalidRequestError(f"requantize must be None, 4 or 8, not {requantize!r}")
        shard, e = self._get(name)
        try:
            g = self._quant.get(name)
            if g is not None:
                return self._load_quantized(name, e, g)
            return shard.array(e)
        except (WeightsError, InvalidRequestError):
            raise
        except Exception as ex:  # noqa: BLE001 - every failure must surface as the project's error type
            raise WeightsError(f"{shard.path}: loading tensor {name!r} failed: {type(ex).__name__}: {ex}") from ex

    def _load_quantized(self, name: str, e: SafetensorsTensorInfo, g: _QuantGroup) -> QuantizedArray:
        src = f"{e.file}: quantized tensor {name!r}"
        if g.bits not in (2, 3, 4, 5, 6, 8):  # MLX's affine widths (3, 5 and 6 bits: a bitstream across words)
            raise WeightsError(f"{src}: {g.bits}-bit MLX quantization is not supported (2, 3, 4, 5, 6 or 8 bits)")
        s_shard, s = self._entries[g.scales]
        b_shard, b = self._entries[g.biases]
        if len(e.shape) not in (2, 3):
            raise WeightsError(f"{src}: expected a 2-D packed weight (3-D: a stack of experts), found shape "
                               f"{list(e.shape)}")
        lead, cols = tuple(e.shape[:-1]), e.shape[-1] * 32 // g.bits
        if cols % g.group_size or s.shape != (*lead, cols // g.group_size) or b.shape != s.shape:
            raise WeightsError(f"{src}: scales {list(s.shape)} and biases {list(b.shape)} do not fit a "
                               f"{g.bits}-bit weight {[*lead, cols]} with group size {g.group_size}")
        weight = self._entries[name][0].array(e)
        scales = s_shard.array(s).astype(np.float32)
        biases = b_shard.array(b).astype(np.float32)
        return QuantizedArray(weight, scales, biases, g.group_size, g.bits)

    def close(self) -> None:
        for s in self._shards:
            s.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, files={len(self._shards)}, tensors={len(self._names)})"


def _sibling_config(folder: Path) -> dict | None:
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    config = _read_json(cfg, "config.json")
    if not isinstance(config, dict):
        raise WeightsError(f"{cfg}: config.json is not a JSON object")
    return config


def _open_index(index_path: Path) -> SafetensorsFile:
    folder = index_path.parent
    idx = _read_json(index_path, "the safetensors index")
    if not isinstance(idx, dict) or not isinstance(idx.get("weight_map"), dict):
        raise WeightsError(f"{index_path}: not a safetensors index (no \"weight_map\" object)")
    weight_map = idx["weight_map"]
    meta = idx.get("metadata") or {}
    if not isinstance(meta, dict):
        raise WeightsError(f"{index_path}: \"metadata\" is not an object")
    files: list[Path] = []
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise WeightsError(f"{index_path}: tensor {name!r} maps to {fname!r}, not a file name")
        p = Path(fname)
        if p.is_absolute() or ".." in p.parts:
            raise WeightsError(f"{index_path}: shard {fname!r} is outside the folder")
        full = folder / p
        if full not in files:
            # Symbolic links are followed: Hugging Face's hub cache links every shard to a blob elsewhere.
            if not full.is_file():
                raise WeightsError(f"{index_path}: missing shard {fname} (listed for tensor {name!r})")
            files.append(full)
    return SafetensorsFile(files, path=folder, config=_sibling_config(folder), index_metadata=meta,
                           index=weight_map)


def open_safetensors(path: "str | os.PathLike[str]") -> SafetensorsFile:
    """Open a .safetensors file, a ``*.safetensors.index.json`` index, or a folder holding either.

    A folder is read through its index (``model.safetensors.index.json`` first, else the only
    ``*.safetensors.index.json``), else ``model.safetensors``, else its only ``*.safetensors`` file. The folder's
    (or the file's folder's) ``config.json`` becomes the metadata.

    Raises:
        WeightsError: nothing to open, an ambiguous folder, a missing shard, or a corrupt file.
    """
    p = Path(path)
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        if (p / "model.safetensors.index.json").is_file():
            return _open_index(p / "model.safetensors.index.json")
        if len(indexes) == 1:
            return _open_index(indexes[0])
        if len(indexes) > 1:
            raise WeightsError(f"{p}: several safetensors indexes ({', '.join(i.name for i in indexes)}); "
                               f"open one of them")
        if (p / "model.safetensors").is_file():
            return SafetensorsFile([p / "model.safetensors"], path=p, config=_sibling_config(p))
        files = sorted(f for f in p.glob("*.safetensors") if f.is_file())
        if len(files) == 1:
            return SafetensorsFile(files, path=p, config=_sibling_config(p))
        if not files:
            raise WeightsError(f"{p}: no .safetensors file in the folder")
        raise WeightsError(f"{p}: several .safetensors files ({', '.join(f.name for f in files)}) and no index")
    if p.name.endswith(".index.json"):
        if not p.is_file():
            raise WeightsError(f"{p}: no such file")
        return _open_index(p)
    if not p.exists():
        raise WeightsError(f"{p}: no such file")
    return SafetensorsFile([p], path=p, config=_sibling_config(p.parent))
